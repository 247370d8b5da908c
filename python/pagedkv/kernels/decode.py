"""Paged decode attention: one query token per sequence against its paged K/V.

Owns `paged_decode`, `DecodeWorkspace`, the split heuristic `choose_num_splits` and
`DecodePlanBuffers`, the device side of the ragged planner (a host-built work list that balances
split-K over the batch's real lengths; the host side, `pagedkv.decode_plan.DecodePlan`, fills
it). This module holds the entry point (argument checks, launch preparation and its cache)
and re-exports the rest: the Triton kernels live in `_decode_kernels`, the heuristics, the
scratch and the plan buffers in `_decode_config`.

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
With a `DecodePlan` the grid is instead one program per (work item, kv head): each item is a
token range of one sequence, from the plan's buffers.

fp8 cache (float8_e4m3fn): entries are `x / scale` per kv head (`k_scale`, `v_scale`); the K
scale folds into the softmax scale, the V scale into the output, and tiles are widened to fp16
(or q's dtype) for the tensor-core products.

Local attention (`window`, `chunk`, `sinks`; docs/kernels.md): the key range starts at the
first key the query reaches (`seq_len - window`, or its chunk's start) and split-K, the split
heuristic and planned items all divide only that range, so a sliding layer's cost is bounded by
its window; sinks join the softmax denominator at the end (in the merge when split).

Invariants: only `ceil(seq_len / block_size)` block-table entries of a row are read, from the
block of the first reachable key on (stale columns past them, and released entries before a
window, never are); masked K/V lanes load zeros, so stale or NaN pool contents past a
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

from . import _launch as L
from . import _validate as v
from ._decode_config import DEFAULT_MAX_SPLITS as DEFAULT_MAX_SPLITS
from ._decode_config import MAX_SEQ_CAP as MAX_SEQ_CAP
from ._decode_config import MIN_TOKENS_PER_SPLIT as MIN_TOKENS_PER_SPLIT
from ._decode_config import TARGET_WAVES as TARGET_WAVES
from ._decode_config import _SM_COUNT as _SM_COUNT
from ._decode_config import DecodePlanBuffers as DecodePlanBuffers
from ._decode_config import DecodeWorkspace as DecodeWorkspace
from ._decode_config import choose_num_splits as choose_num_splits
from ._decode_config import decode_config as decode_config
from ._decode_config import local_first_key as local_first_key
from ._decode_config import num_sms as num_sms
from ._decode_kernels import _decode_kernel as _decode_kernel
from ._decode_kernels import _first_key as _first_key
from ._decode_kernels import _fold_pieces as _fold_pieces
from ._decode_kernels import _merge_kernel as _merge_kernel
from ._decode_kernels import _merge_planned_kernel as _merge_planned_kernel
from ._decode_kernels import _sink_den as _sink_den

__all__ = [
    "paged_decode",
    "DecodeWorkspace",
    "DecodePlanBuffers",
    "choose_num_splits",
    "decode_config",
    "num_sms",
]

_LOG2E = 1.4426950408889634


def _check_decode_args(q, k_cache, v_cache, block_tables, seq_lens, out):
    num_blocks, block_size, kv_heads, head_dim = v.check_cache_pair(k_cache, v_cache)
    dev = k_cache.device
    v.check_tensor("q", q, ndim=3, dtypes=v.act_dtypes(k_cache.dtype))
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


_CACHE = L.LaunchCache()


class _DecodeCall:
    """A validated `paged_decode` signature: the launches and the scratch views they use."""

    __slots__ = ("main", "merge", "grid", "merge_grid", "po", "pl", "plan", "workspace",
                 "num_seqs", "kv_heads", "cacheable", "plain", "ks", "vs")

    def __call__(self, q, k_cache, v_cache, block_tables, seq_lens, out, k_scale, v_scale,
                 sinks=None):
        if out is None:
            out = torch.empty_like(q)
        # Scales: a float's device tensor lives in the call (its value is in the signature), a
        # tensor comes per call; without fp8 seq_lens stands in (never read).
        ks = self.ks if self.ks is not None else (k_scale if k_scale is not None else seq_lens)
        vs = self.vs if self.vs is not None else (v_scale if v_scale is not None else seq_lens)
        sk = sinks if sinks is not None else seq_lens  # read only with sinks
        plan = self.plan
        if plan is not None:
            if plan.num_seqs != self.num_seqs:
                raise v.KernelShapeError(
                    f"plan: was built for {plan.num_seqs} sequences, expected {self.num_seqs} "
                    f"(q's batch; call plan.update with this batch's lengths)"
                )
            capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
            if not capturing and plan.num_items == self.num_seqs:
                # Nothing split: the plain one-program-per-(sequence, kv head) kernel, faster
                # than the work-list one at uniform lengths (measured, docs/performance.md).
                self.plain((self.num_seqs, self.kv_heads, 1), q, k_cache, v_cache,
                           block_tables, seq_lens, out, out, out, seq_lens, ks, vs, sk)
                return out
            n_items = plan.capacity if capturing else plan.num_items
            self.main((n_items * self.kv_heads,), q, k_cache, v_cache, block_tables, seq_lens,
                      out, self.po, self.pl, plan.meta, ks, vs, sk)
            if capturing or n_items > self.num_seqs:
                self.merge(self.merge_grid, self.po, self.pl, plan.meta, out, sk)
            return out
        po = out if self.po is None else self.po
        pl = out if self.pl is None else self.pl
        self.main(self.grid, q, k_cache, v_cache, block_tables, seq_lens, out, po, pl, seq_lens,
                  ks, vs, sk)
        if self.merge is not None:
            self.merge(self.merge_grid, po, pl, out, sk)
        return out


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
    plan: Optional[DecodePlanBuffers] = None,
    k_scale=None,
    v_scale=None,
    window: Optional[int] = None,
    chunk: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode attention for `q` (one token per sequence) over the paged cache; returns `out`.

    `scale` defaults to `1/sqrt(head_dim)`. `max_seq_len` is a host-side upper bound on
    `seq_lens` used only by the split heuristic (default: the block table's width times the
    block size); `num_splits` overrides the heuristic. Split-K needs scratch: pass a
    `DecodeWorkspace` (and `out`) to keep the call allocation-free and graph-capturable; without
    one a temporary workspace is allocated. `plan` (a `DecodePlan` updated with this batch's
    host lengths) replaces the heuristic by a work list balanced over the real lengths and
    brings its own scratch (then `workspace` and `num_splits` must be left out).
    `check_indices=True` validates `seq_lens` and the used block-table entries on the host
    (synchronizes; debugging only) and raises `KernelIndexError` before launching; without it,
    bad values follow the bounds contract (no access outside the tensors; docs/kernels.md).
    `config` overrides the launch parameters of `decode_config` (keys `TILE_N`, `num_warps`,
    `num_stages`; for tuning). An fp8 (`float8_e4m3fn`) cache is read as `k8 * k_scale`,
    `v8 * v_scale` (float, or float32 tensor `[kv_heads]`, as written by `scatter_kv`); `q` and
    `out` are then bf16, fp16 or fp32.

    Local attention (docs/kernels.md, "Sliding window, chunked attention and sinks"): with
    `window` W the query at position `p = seq_len - 1` attends keys `[p - W + 1, p]` (W counts
    the query itself, as transformers' `sliding_window`); with `chunk` C keys
    `[floor(p / C) * C, p]`. The key loop starts at that first key (split-K divides only the
    reachable range, and the heuristic sees at most W or C keys), so the step's cost does not
    grow with the context and no table entry before the first key's block is read (those may
    hold -1). With a `plan`, item ranges count from that first key: build it over the clipped
    lengths `min(seq_len, W)` for balance. `sinks` (float tensor `[q_heads]`, gpt-oss) adds
    `exp(sinks[h])` to head h's softmax denominator, with no value.

    Host cost: the checks and the launch configuration are computed once per call signature
    (shapes, strides, dtypes, devices and alignment of the tensors, and the host arguments) and
    cached; a repeated signature launches the compiled kernels directly (`_launch.py`).
    """
    key = None
    if not check_indices:
        try:
            key = (
                L.tensor_key(q), L.tensor_key(k_cache), L.tensor_key(v_cache),
                L.tensor_key(block_tables), L.tensor_key(seq_lens),
                None if out is None else L.tensor_key(out),
                scale, id(workspace), num_splits, id(plan),
                # The split heuristic reads max_seq_len only in steps of MIN_TOKENS_PER_SPLIT.
                max_seq_len // MIN_TOKENS_PER_SPLIT
                if type(max_seq_len) is int and max_seq_len >= 0 else ("raw", max_seq_len),
                None if config is None else tuple(sorted(config.items())),
                v.scale_key(k_scale), v.scale_key(v_scale),
                window, chunk, None if sinks is None else L.tensor_key(sinks),
            )
            call = _CACHE.get(key)
        except (AttributeError, TypeError):
            key = call = None
        if call is not None:
            return call(q, k_cache, v_cache, block_tables, seq_lens, out, k_scale, v_scale, sinks)
    call = _prepare(q, k_cache, v_cache, block_tables, seq_lens, scale, out, workspace,
                    num_splits, max_seq_len, check_indices, config, plan, k_scale, v_scale,
                    window, chunk, sinks)
    if call is None:  # an empty batch
        return torch.empty_like(q) if out is None else out
    if key is not None and call.cacheable:
        _CACHE.put(key, call)
    return call(q, k_cache, v_cache, block_tables, seq_lens, out, k_scale, v_scale, sinks)


def _prepare(q, k_cache, v_cache, block_tables, seq_lens, scale, out, workspace, num_splits,
             max_seq_len, check_indices, config, plan, k_scale, v_scale, window=None, chunk=None,
             sinks=None) -> Optional[_DecodeCall]:
    num_blocks, block_size, kv_heads, head_dim = _check_decode_args(
        q, k_cache, v_cache, block_tables, seq_lens, out
    )
    win, chk = v.check_local(window, chunk)
    v.check_sinks(sinks, q.shape[1], k_cache.device)
    fp8 = k_cache.dtype == v.FP8
    ks, vs, k_stride = v.kv_scales(k_scale, v_scale, kv_heads, k_cache.device, fp8)
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
        _check_indices(block_tables, seq_lens, num_seqs, num_blocks, block_size, seq_cap,
                       win, chk)
    if plan is not None:
        if not isinstance(plan, DecodePlanBuffers):
            raise v.KernelDTypeError(f"plan: expected a DecodePlan, got {type(plan).__name__}")
        if workspace is not None or num_splits is not None:
            raise v.KernelArgumentError(
                "plan: given with workspace or num_splits, expected either a plan or those"
            )
        if (plan.num_q_heads, plan.num_kv_heads, plan.head_dim) != (q_heads, kv_heads, head_dim):
            raise v.KernelShapeError(
                f"plan: built for (q_heads, kv_heads, head_dim) = "
                f"{(plan.num_q_heads, plan.num_kv_heads, plan.head_dim)}, expected "
                f"{(q_heads, kv_heads, head_dim)}"
            )
        if num_seqs > plan.max_num_seqs:
            raise v.KernelShapeError(
                f"q: has {num_seqs} sequences, expected at most {plan.max_num_seqs} (the plan's "
                f"max_num_seqs)"
            )
        v.check_same_device(q.device, plan=plan.meta)
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
    if plan is None:
        if num_splits is None:
            max_splits = workspace.max_splits if workspace is not None else DEFAULT_MAX_SPLITS
            # A window or chunk bounds the keys a query reaches: split only that range.
            reach = max_seq_len
            if win:
                reach = min(reach, win)
            if chk:
                reach = min(reach, chk)
            num_splits = choose_num_splits(
                num_seqs, kv_heads, reach, num_sms(q.device), max_splits=max_splits
            )
        else:
            v.check_int("num_splits", num_splits, 1, 4096)
    if num_seqs == 0:
        return None
    cfg = decode_config(head_dim, group, k_cache.dtype)
    cfg = v.merge_config(cfg, config)
    group_pad = max(16, triton.next_power_of_2(group))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if cfg["FP8_COMPUTE"] not in ("fp16", "q"):
        raise v.KernelArgumentError(
            f"config: FP8_COMPUTE is {cfg['FP8_COMPUTE']!r}, expected 'fp16' or 'q'"
        )
    f16 = fp8 and q.dtype != torch.float32 and cfg["FP8_COMPUTE"] == "fp16"
    # The out strides the kernels are specialized on: `out`'s, or those empty_like(q) gives.
    o_ref = out if out is not None else torch.empty_like(q)
    limited = bool(win or chk)
    has_sinks = sinks is not None
    call = _DecodeCall()
    call.plan, call.workspace, call.num_seqs, call.kv_heads = plan, workspace, num_seqs, kv_heads
    call.po = call.pl = call.merge = None
    call.cacheable = True
    call.ks = ks if fp8 and not isinstance(k_scale, torch.Tensor) else None
    call.vs = vs if fp8 and not isinstance(v_scale, torch.Tensor) else None
    split = plan is None and num_splits > 1
    if plan is not None:
        call.po = plan.partial_out.view(plan.capacity, q_heads, head_dim)
        call.pl = plan.partial_lse.view(plan.capacity, q_heads)
        items_off, max_rows, ns = plan.items_off, plan.capacity, 1
    else:
        items_off, max_rows, ns = 0, 1, num_splits
        if split:
            if workspace is None:
                workspace = DecodeWorkspace(
                    num_seqs, q_heads, kv_heads, head_dim, device=q.device,
                    max_splits=num_splits, capacity=num_seqs * num_splits,
                )
                call.workspace = workspace
                # Scratch of its own per call (calls on other streams must not share it).
                call.cacheable = False
            call.po, call.pl = workspace.views(num_seqs, num_splits)
    call.grid = (num_seqs, kv_heads, ns)
    call.main = L.Launch(
        _decode_kernel,
        (sc * _LOG2E, q.stride(0), q.stride(1), block_tables.stride(0),
         o_ref.stride(0), o_ref.stride(1), ns, num_blocks, seq_cap, num_seqs, items_off,
         max_rows, k_stride, win, chk),
        dict(BLOCK_SIZE=block_size, KV_HEADS=kv_heads, HEAD_DIM=head_dim, GROUP=group,
             GROUP_PAD=group_pad, TILE_N=cfg["TILE_N"], SPLIT=split, PLANNED=plan is not None,
             PRECISION=precision, KV_FP8=fp8, F16=f16, SWAP_AB=bool(cfg["SWAP_AB"]),
             LIMITED=limited, HAS_SINKS=has_sinks,
             num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
    )
    call.merge_grid = (num_seqs, q_heads)
    call.plain = None
    if plan is not None:
        call.plain = L.Launch(
            _decode_kernel,
            (sc * _LOG2E, q.stride(0), q.stride(1), block_tables.stride(0),
             o_ref.stride(0), o_ref.stride(1), 1, num_blocks, seq_cap, num_seqs, 0, 1, k_stride,
             win, chk),
            dict(BLOCK_SIZE=block_size, KV_HEADS=kv_heads, HEAD_DIM=head_dim, GROUP=group,
                 GROUP_PAD=group_pad, TILE_N=cfg["TILE_N"], SPLIT=False, PLANNED=False,
                 PRECISION=precision, KV_FP8=fp8, F16=f16, SWAP_AB=bool(cfg["SWAP_AB"]),
                 LIMITED=limited, HAS_SINKS=has_sinks,
                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        )
        call.merge = L.Launch(
            _merge_planned_kernel, (o_ref.stride(0), o_ref.stride(1), max_rows),
            dict(HEAD_DIM=head_dim, ROWS=16, HAS_SINKS=has_sinks, num_warps=4),
        )
    elif split:
        call.merge = L.Launch(
            _merge_kernel, (o_ref.stride(0), o_ref.stride(1), num_splits),
            dict(HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(num_splits),
                 HAS_SINKS=has_sinks, num_warps=4 if head_dim * num_splits <= 8192 else 8),
        )
    return call


def _check_indices(block_tables, seq_lens, num_seqs, num_blocks, block_size, seq_cap, window=0,
                   chunk=0):
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
        n = int(sl[i])
        nb = -(-n // block_size)
        # Entries before the first key the window or chunk reaches are never read.
        b0 = local_first_key(n, window, chunk) // block_size
        row = bt[i, b0:nb]
        badb = ((row < 0) | (row >= num_blocks)).nonzero()
        if badb.numel():
            j = b0 + int(badb[0, 0])
            raise v.KernelIndexError(
                f"block_tables[{i}, {j}]: is {int(row[j])}, expected in [0, {num_blocks})"
            )
