"""Paged decode attention: one query token per sequence against its paged K/V.

Owns `paged_decode`, `DecodeWorkspace` and the split heuristic `choose_num_splits`.

Layouts: `q` `[num_seqs, q_heads, head_dim]`; pool `[num_blocks, block_size, kv_heads, head_dim]`
(contiguous); `block_tables` int32 `[num_seqs, max_blocks]` (row stride may exceed the width);
`seq_lens` int32 `[num_seqs]`; `out` like `q`. Query head `h` reads kv head
`h // (q_heads // kv_heads)` (GQA; MQA when kv_heads == 1).

Kernel shape. One program per (sequence, kv head, split) serves the whole query group of that kv
head, so each K/V byte is read once per step whatever the GQA ratio. The group is padded to 16
rows so the two products per tile (`q·Kᵀ` and `p·V`) run on the tensor cores. Each iteration
gathers `TILE_N` tokens (several pool blocks) through the block table and folds them in with an
online softmax (running max and sum in fp32, exp2 with log2(e) folded into the scale).

Split-K (flash-decoding). When `num_seqs * kv_heads` programs cannot fill the GPU, each
sequence's tokens are cut into `num_splits` contiguous ranges, each a multiple of `TILE_N`, sized
from that sequence's own length in the kernel (no host sync); every split writes its normalized
partial output and its log-sum-exp into the workspace, and a second small kernel merges them.

Invariants: only `ceil(seq_len / block_size)` block-table entries of a row are read (stale
columns past them never are); masked K/V lanes load zeros, so stale or NaN pool contents past a
sequence's end cannot reach the output; a sequence of length 0 yields zeros. Bounds by
construction (docs/kernels.md, "Bounds contract"): whatever `seq_lens` and the table hold, no
access leaves the pool, the table rows, `q`, `out` or the workspace: a length is clamped to
`[0, width * block_size]`, and a sequence whose used entries include an id outside
`[0, num_blocks)` reads only in-pool blocks and yields zeros (split or not). The call performs
no host synchronization and, given `out` and a `DecodeWorkspace`, no allocation: the launch
configuration depends only on shapes and host integers, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _validate as v

__all__ = ["paged_decode", "DecodeWorkspace", "choose_num_splits", "decode_config"]

_LOG2E = 1.4426950408889634

#: Split heuristic knobs (see `choose_num_splits` and docs/kernels.md).
TARGET_WAVES = 4
MIN_TOKENS_PER_SPLIT = 256
DEFAULT_MAX_SPLITS = 64

#: Longest context the kernels serve (token indices stay in int32 with room for a tile).
MAX_SEQ_CAP = 1 << 30

_SM_COUNT: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter has no SMs; any fixed figure keeps the heuristic testable
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def decode_config(head_dim: int, group: int, dtype: torch.dtype) -> dict:
    """Tile size and launch parameters for the main decode kernel."""
    tile_n = 64 if head_dim <= 128 else 32
    return {"TILE_N": tile_n, "num_warps": 4, "num_stages": 3}


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
            sms = _num_sms(self.device)
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


@triton.jit(do_not_specialize=["num_blocks", "seq_cap"])
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    po_ptr,
    pl_ptr,
    qk_scale,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
    stride_os,
    stride_oh,
    num_splits,
    num_blocks,
    seq_cap,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # Bounds by construction: a length outside [0, seq_cap] (seq_cap = table width * block size)
    # is clamped, so no table column past the row's width is ever read.
    seq_len = tl.load(seq_lens_ptr + seq)
    seq_len = tl.minimum(tl.maximum(seq_len, 0), seq_cap)
    if SPLIT:
        per = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_N) * TILE_N
        start = split * per
        end = tl.minimum(start + per, seq_len)
    else:
        start = 0
        end = seq_len

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)
    g_ok = offs_g < GROUP
    qh = kvh * GROUP + offs_g
    seq64 = seq.to(tl.int64)
    q = tl.load(
        q_ptr + seq64 * stride_qs + qh[:, None] * stride_qh + offs_d[None, :],
        mask=g_ok[:, None],
        other=0.0,
    )
    bt_row = bt_ptr + seq64 * stride_bts
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    bad = tl.zeros([TILE_N], dtype=tl.int32)
    for t0 in range(start, end, TILE_N):
        offs_t = t0 + offs_n
        t_ok = offs_t < end
        blk = tl.load(bt_row + offs_t // BLOCK_SIZE, mask=t_ok, other=0)
        # An id outside [0, num_blocks) is clamped into the pool (so every load stays inside it)
        # and flagged; a flagged sequence's output is replaced by zeros below. Clamping instead
        # of masking the loads keeps the loop's registers (and so its occupancy) as they were.
        bad = bad | ((blk < 0) | (blk >= num_blocks)).to(tl.int32)
        blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
        in_blk = offs_t % BLOCK_SIZE
        k = tl.load(
            k_head + (blk * stride_kb + in_blk * stride_kt)[:, None] + offs_d[None, :],
            mask=t_ok[:, None],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vv = tl.load(
            v_head + (blk * stride_vb + in_blk * stride_vt)[:, None] + offs_d[None, :],
            mask=t_ok[:, None],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PRECISION)
        m_i = m_new

    seq_bad = tl.max(bad, 0) > 0
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = tl.where(seq_bad, 0.0, acc / l_safe[:, None])
    if not SPLIT:
        tl.store(
            out_ptr + seq64 * stride_os + qh[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None],
        )
    else:
        # Partial layout [num_seqs, q_heads, num_splits, HEAD_DIM], packed.
        row = (seq64 * (tl.num_programs(1) * GROUP) + qh) * num_splits + split
        tl.store(po_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_ok[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        # +inf marks a split that met an out-of-pool id: the merge then zeroes the sequence, so
        # the result does not depend on how the sequence was split.
        lse = tl.where(seq_bad, float("inf"), lse)
        tl.store(pl_ptr + row, lse, mask=g_ok)


@triton.jit
def _merge_kernel(
    po_ptr,
    pl_ptr,
    out_ptr,
    stride_os,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    base = (seq.to(tl.int64) * tl.num_programs(1) + h) * num_splits
    lse = tl.load(pl_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    # A split marked +inf met an out-of-pool block id: the sequence's output is zeros.
    poisoned = tl.max(tl.where(lse == float("inf"), 1, 0), 0) > 0
    lse = tl.where(poisoned, float("-inf"), lse)
    live = lse > float("-inf")
    mx = tl.max(lse, 0)
    mx = tl.where(mx > float("-inf"), mx, 0.0)
    w = tl.where(live, tl.math.exp2(lse - mx), 0.0)
    # Empty splits (lse = -inf) are not read at all.
    o = tl.load(
        po_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=live[:, None],
        other=0.0,
    )
    den = tl.sum(w, 0)
    num = tl.sum(w[:, None] * o, 0)
    res = num / tl.where(den > 0.0, den, 1.0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_os + h * stride_oh + offs_d,
        res.to(out_ptr.dtype.element_ty),
    )


def _check_decode_args(q, k_cache, v_cache, block_tables, seq_lens, out):
    num_blocks, block_size, kv_heads, head_dim = v.check_cache_pair(k_cache, v_cache)
    dev = k_cache.device
    v.check_tensor("q", q, ndim=3, dtypes=(k_cache.dtype,))
    v.check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    v.check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,))
    v.check_same_device(dev, q=q, block_tables=block_tables, seq_lens=seq_lens)
    v.ensure_launchable(dev)
    num_seqs, q_heads, _ = q.shape
    v.check_dim("q", q, 2, head_dim, "head_dim of the pool")
    if q_heads % kv_heads:
        raise v.KernelShapeError(
            f"q: has {q_heads} heads (dim 1), expected a multiple of the pool's kv_heads ({kv_heads})"
        )
    v.check_min_dim("block_tables", block_tables, 0, num_seqs, "one row per sequence of q")
    v.check_dim("seq_lens", seq_lens, 0, num_seqs, "one length per sequence of q")
    v.check_inner_contiguous("q", q, 1)
    if block_tables.stride(1) != 1:
        raise v.KernelLayoutError(
            f"block_tables: column stride is {block_tables.stride(1)}, expected 1"
        )
    v.check_contiguous("seq_lens", seq_lens)
    if out is not None:
        v.check_tensor("out", out, ndim=3, dtypes=(q.dtype,))
        v.check_same_device(dev, out=out)
        if tuple(out.shape) != tuple(q.shape):
            raise v.KernelShapeError(
                f"out: shape is {tuple(out.shape)}, expected {tuple(q.shape)} (as q)"
            )
        v.check_inner_contiguous("out", out, 1)
    return num_blocks, block_size, kv_heads, head_dim


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    workspace: Optional[DecodeWorkspace] = None,
    num_splits: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    check_indices: bool = False,
    config: Optional[dict] = None,
) -> torch.Tensor:
    """Decode attention for `q` (one token per sequence) over the paged cache; returns `out`.

    `scale` defaults to `1/sqrt(head_dim)`. `max_seq_len` is a host-side upper bound on
    `seq_lens` used only by the split heuristic (default: the block table's width times the
    block size); `num_splits` overrides the heuristic. Split-K needs scratch: pass a
    `DecodeWorkspace` (and `out`) to keep the call allocation-free and graph-capturable; without
    one a temporary workspace is allocated. `check_indices=True` validates `seq_lens` and the
    used block-table entries on the host (synchronizes; debugging only) and raises
    `KernelIndexError` before launching; without it, bad values follow the bounds contract (no
    access outside the tensors; docs/kernels.md). `config` overrides the
    launch parameters of `decode_config` (keys `TILE_N`, `num_warps`, `num_stages`; for tuning).
    """
    num_blocks, block_size, kv_heads, head_dim = _check_decode_args(
        q, k_cache, v_cache, block_tables, seq_lens, out
    )
    sc = v.check_scale(scale, head_dim)
    num_seqs, q_heads, _ = q.shape
    group = q_heads // kv_heads
    table_cap = block_tables.shape[1] * block_size
    # The kernel clamps every length to this; the cap on it keeps token indices in int32.
    seq_cap = min(table_cap, MAX_SEQ_CAP)
    if max_seq_len is None:
        max_seq_len = table_cap
    v.check_int("max_seq_len", max_seq_len, 0)
    if check_indices:
        _check_indices(block_tables, seq_lens, num_seqs, num_blocks, block_size, seq_cap)
    if workspace is not None:
        if not isinstance(workspace, DecodeWorkspace):
            raise v.KernelDTypeError(
                f"workspace: expected a DecodeWorkspace, got {type(workspace).__name__}"
            )
        if (workspace.num_q_heads, workspace.head_dim) != (q_heads, head_dim):
            raise v.KernelShapeError(
                f"workspace: built for (q_heads, head_dim) = "
                f"{(workspace.num_q_heads, workspace.head_dim)}, expected {(q_heads, head_dim)}"
            )
        v.check_same_device(q.device, workspace=workspace.partial_out)
    if num_splits is None:
        max_splits = workspace.max_splits if workspace is not None else DEFAULT_MAX_SPLITS
        num_splits = choose_num_splits(
            num_seqs, kv_heads, max_seq_len, _num_sms(q.device), max_splits=max_splits
        )
    else:
        v.check_int("num_splits", num_splits, 1, 4096)
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    cfg = decode_config(head_dim, group, q.dtype)
    if config is not None:
        unknown = set(config) - set(cfg)
        if unknown:
            raise v.KernelArgumentError(
                f"config: unknown keys {sorted(unknown)}, expected some of {sorted(cfg)}"
            )
        cfg = {**cfg, **config}
    group_pad = max(16, triton.next_power_of_2(group))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if num_splits > 1:
        if workspace is None:
            workspace = DecodeWorkspace(
                num_seqs, q_heads, kv_heads, head_dim, device=q.device,
                max_splits=num_splits, capacity=num_seqs * num_splits,
            )
        po, pl = workspace.views(num_seqs, num_splits)
    else:
        po = pl = out  # unused by the kernel when it does not split
    grid = (num_seqs, kv_heads, num_splits)
    _decode_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, out, po, pl,
        sc * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_splits, num_blocks, seq_cap,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group, GROUP_PAD=group_pad,
        TILE_N=cfg["TILE_N"], SPLIT=num_splits > 1, PRECISION=precision,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if num_splits > 1:
        _merge_kernel[(num_seqs, q_heads)](
            po, pl, out, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=4 if head_dim * num_splits <= 8192 else 8,
        )
    return out


def _check_indices(block_tables, seq_lens, num_seqs, num_blocks, block_size, seq_cap):
    sl = seq_lens[:num_seqs].to("cpu")
    bad = ((sl < 0) | (sl > seq_cap)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise v.KernelIndexError(
            f"seq_lens[{i}]: is {int(sl[i])}, expected in [0, {seq_cap}] "
            f"(block table width * block_size)"
        )
    bt = block_tables[:num_seqs].to("cpu")
    for i in range(num_seqs):
        nb = -(-int(sl[i]) // block_size)
        row = bt[i, :nb]
        badb = ((row < 0) | (row >= num_blocks)).nonzero()
        if badb.numel():
            j = int(badb[0, 0])
            raise v.KernelIndexError(
                f"block_tables[{i}, {j}]: is {int(row[j])}, expected in [0, {num_blocks})"
            )
