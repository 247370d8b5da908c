"""Host-side launch heuristics and scratch of paged decode.

Owns the split heuristic (`choose_num_splits` and its knobs), the per-device SM count
(`num_sms`) the launch heuristics of the kernels package size their grids by, the tile and
launch parameters (`decode_config`), the split-K scratch (`DecodeWorkspace`), the device side of
a decode plan (`DecodePlanBuffers`), and `local_first_key`, the host twin of the kernels' first
reachable key. Invariants: everything here depends only on shapes and host integers (no device
synchronization); the workspace and plan buffers allocate once, at construction.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _validate as v

#: Split heuristic knobs (see `choose_num_splits` and docs/kernels.md).
TARGET_WAVES = 4
MIN_TOKENS_PER_SPLIT = 256
DEFAULT_MAX_SPLITS = 64

#: Longest context the kernels serve (token indices stay in int32 with room for a tile).
MAX_SEQ_CAP = 1 << 30

_SM_COUNT: dict = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached per device), which the launch heuristics
    size their grids by; a fixed 132 off CUDA (the interpreter has none)."""
    if device.type != "cuda":
        return 132  # the interpreter has no SMs; any fixed figure keeps the heuristic testable
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def decode_config(head_dim: int, group: int, dtype: torch.dtype) -> dict:
    """Tile size and launch parameters for the main decode kernel (`dtype`: the cache's).

    `FP8_COMPUTE` (fp8 caches only): "fp16" widens the fp8 tiles (and q) to fp16 for the
    tensor-core products, the native e4m3 conversion; "q" widens them to q's dtype.
    `SWAP_AB` computes the transposed products (`K·qᵀ`, `Vᵀ·pᵀ`): the tokens on the MMA's M side
    and the query group on N, the K/V tiles as the register operand."""
    tile_n = 64 if head_dim <= 128 else 32
    if dtype == v.FP8:
        # Half the bytes per tile: a 128-token tile keeps as many bytes in flight as the 16-bit
        # one; the transposed products with 3 stages were the fastest of the H200 sweep
        # (docs/performance.md, fp8).
        return {"TILE_N": 2 * tile_n, "num_warps": 4, "num_stages": 3, "FP8_COMPUTE": "fp16",
                "SWAP_AB": True}
    return {"TILE_N": tile_n, "num_warps": 4, "num_stages": 3, "FP8_COMPUTE": "q",
            "SWAP_AB": False}


def choose_num_splits(
    num_seqs: int,
    kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    *,
    max_splits: int = DEFAULT_MAX_SPLITS,
) -> int:
    """Number of splits per sequence for split-K decode.

    Without splitting the grid has `num_seqs * kv_heads` programs. The split count is the
    largest power of two that keeps the grid within `TARGET_WAVES * num_sms` programs (about four
    resident programs per SM for the default decode config, so one full wave with room to even
    out ragged lengths), that leaves every piece of the longest possible sequence at least
    `MIN_TOKENS_PER_SPLIT` tokens (shorter pieces cost more in setup and merge traffic than they
    win), and that does not exceed `max_splits`.
    """
    programs = max(1, num_seqs * kv_heads)
    target = TARGET_WAVES * num_sms
    splits = min(target // programs, max_seq_len // MIN_TOKENS_PER_SPLIT, max_splits)
    if splits <= 1:
        return 1
    # Round down to a power of two: a power-of-two context then splits into equal, tile-aligned
    # pieces, and the grid stays within the target instead of spilling a ragged extra wave
    # (measured on the H200: 8 splits beat 9 at batch 8 x 8 kv heads, 70.6 vs 79.1 us).
    return 1 << (splits.bit_length() - 1)


class DecodeWorkspace:
    """Preallocated split-K scratch: partial outputs and log-sum-exps, fp32.

    Created once with the largest batch it will serve; `paged_decode` carves views out of it
    without allocating, so a captured CUDA graph keeps pointing at the same memory. The capacity
    covers whatever `choose_num_splits` picks for any batch up to `max_num_seqs` (and any context
    length), unless `capacity` (the largest `num_seqs * num_splits` to serve) is given; a call
    that needs more raises `KernelShapeError`.
    """

    def __init__(
        self,
        max_num_seqs: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        device,
        max_splits: int = DEFAULT_MAX_SPLITS,
        capacity: Optional[int] = None,
    ):
        v.check_int("max_num_seqs", max_num_seqs, 1)
        v.check_int("num_q_heads", num_q_heads, 1)
        v.check_int("num_kv_heads", num_kv_heads, 1)
        v.check_int("head_dim", head_dim, 1)
        v.check_int("max_splits", max_splits, 1, 4096)
        if num_q_heads % num_kv_heads:
            raise v.KernelShapeError(
                f"num_q_heads: is {num_q_heads}, expected a multiple of num_kv_heads "
                f"({num_kv_heads})"
            )
        self.device = torch.device(device)
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_num_seqs = max_num_seqs
        self.max_splits = max_splits
        if capacity is None:
            sms = num_sms(self.device)
            # Worst case over batch sizes of seqs * splits, with unbounded context length.
            capacity = 1
            for n in range(1, max_num_seqs + 1):
                s = choose_num_splits(n, num_kv_heads, 1 << 40, sms, max_splits=max_splits)
                capacity = max(capacity, n * s if s > 1 else 1)
        else:
            v.check_int("capacity", capacity, 1)
        cap = capacity
        self.max_seq_splits = cap
        self.partial_out = torch.empty(cap * num_q_heads * head_dim, dtype=torch.float32, device=self.device)
        self.partial_lse = torch.empty(cap * num_q_heads, dtype=torch.float32, device=self.device)

    def views(self, num_seqs: int, num_splits: int):
        need = num_seqs * num_splits
        if need > self.max_seq_splits:
            raise v.KernelShapeError(
                f"num_seqs * num_splits: is {num_seqs} * {num_splits} = {need}, expected at most "
                f"{self.max_seq_splits} (DecodeWorkspace capacity)"
            )
        h, d = self.num_q_heads, self.head_dim
        po = self.partial_out[: need * h * d].view(num_seqs, h, num_splits, d)
        pl = self.partial_lse[: need * h].view(num_seqs, h, num_splits)
        return po, pl


class DecodePlanBuffers:
    """The device side of a split-K decode plan: what `paged_decode(..., plan=)` reads.

    `meta` int32 `[items_off + 4 * capacity]`: word 0 the item count, words `1 .. num_seqs + 1`
    each sequence's first item (indptr), and from `items_off` the items, four words each
    (sequence, start, end, partial row or -1), in launch order; `partial_out` and `partial_lse`
    hold the fp32 partial states of `capacity` items. The kernels only read `meta`; the host
    planner that fills it (`pagedkv.decode_plan.DecodePlan`, through the extension) subclasses
    this, so the kernels package needs nothing but device tensors. Correctness never depends on
    `meta` matching the device lengths: a stale plan only costs balance.
    """

    def __init__(
        self,
        max_num_seqs: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        device,
    ):
        self.device = torch.device(device)
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.max_num_seqs = max_num_seqs
        self.capacity = capacity
        # The items start on a 16-byte boundary after the count and the indptr.
        self.items_off = -(-(2 + max_num_seqs) // 4) * 4
        self.meta = torch.zeros(self.items_off + 4 * capacity, dtype=torch.int32,
                                device=self.device)
        self.partial_out = torch.empty(
            capacity * num_q_heads * head_dim, dtype=torch.float32, device=self.device
        )
        self.partial_lse = torch.empty(
            capacity * num_q_heads, dtype=torch.float32, device=self.device
        )
        #: What the last plan written into `meta` covers (sequences, items, chunk length).
        self.num_seqs = 0
        self.num_items = 0
        self.chunk = 0


def local_first_key(seq_len: int, window: int = 0, chunk: int = 0) -> int:
    """Host twin of the kernels' `_first_key`: the first key position the query at position
    `seq_len - 1` attends (0 without a window or chunk; `window`/`chunk` 0 mean unused)."""
    lo = 0
    if window:
        lo = max(lo, seq_len - window)
    if chunk and seq_len > 0:
        lo = max(lo, (seq_len - 1) // chunk * chunk)
    return lo
