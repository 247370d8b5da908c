"""Paged decode attention: one query token per sequence against its paged K/V.

Owns `paged_decode`, `DecodeWorkspace`, the split heuristic `choose_num_splits` and
`DecodePlanBuffers`, the device side of the ragged planner (a host-built work list that balances
split-K over the batch's real lengths; the host side, `pagedkv.decode_plan.DecodePlan`, fills
it).

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
import triton.language as tl

from . import _launch as L
from . import _validate as v

__all__ = [
    "paged_decode",
    "DecodeWorkspace",
    "DecodePlanBuffers",
    "choose_num_splits",
    "decode_config",
    "num_sms",
]

_LOG2E = 1.4426950408889634

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


@triton.jit
def _first_key(seq_len, window, chunk, LIMITED: tl.constexpr):
    """First key position a decode query (at position `seq_len - 1`) attends: 0 for full
    attention; `seq_len - window` for a sliding window (keys `[p - window + 1, p]`); the start of
    the query's chunk, `floor(p / chunk) * chunk`, for chunked attention (both when both are
    set). `window` and `chunk` are 0 when unused."""
    lo = seq_len * 0
    if LIMITED:
        lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), lo)
        p = tl.maximum(seq_len - 1, 0)
        lo = tl.where(chunk > 0, tl.maximum(lo, (p // tl.maximum(chunk, 1)) * chunk), lo)
    return lo


@triton.jit(do_not_specialize=["num_blocks", "seq_cap", "num_seqs", "window", "chunk"])
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    po_ptr,
    pl_ptr,
    plan_ptr,
    ksc_ptr,
    vsc_ptr,
    sinks_ptr,
    qk_scale,
    stride_qs,
    stride_qh,
    stride_bts,
    stride_os,
    stride_oh,
    num_splits,
    num_blocks,
    seq_cap,
    num_seqs,
    items_off,
    max_rows,
    scale_stride,
    window,
    chunk,
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PLANNED: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    F16: tl.constexpr,
    SWAP_AB: tl.constexpr,
    LIMITED: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # The pool is contiguous (checked on the host): its strides follow from the constexprs, so
    # they are compile-time constants here.
    stride_kh: tl.constexpr = HEAD_DIM
    stride_kt: tl.constexpr = KV_HEADS * HEAD_DIM
    stride_kb: tl.constexpr = BLOCK_SIZE * KV_HEADS * HEAD_DIM
    if PLANNED:
        # One program per (work item, kv head); items are listed heaviest first and the kv heads
        # of one item are adjacent, so the long chunks start in the first wave. A program past
        # the plan's item count (a fixed CUDA-graph grid) or with an out-of-range sequence index
        # does nothing.
        pid = tl.program_id(0)
        item = pid // KV_HEADS
        kvh = pid % KV_HEADS
        n_items = tl.load(plan_ptr)
        live = item < n_items
        ip = plan_ptr + items_off + item * 4
        seq = tl.load(ip, mask=live, other=-1)
        t_lo = tl.load(ip + 1, mask=live, other=0)
        t_hi = tl.load(ip + 2, mask=live, other=0)
        row_raw = tl.load(ip + 3, mask=live, other=-1)
        live = live & (seq >= 0) & (seq < num_seqs)
        seq = tl.where(live, seq, 0)
        direct = row_raw < 0
        row = tl.minimum(tl.maximum(row_raw, 0), max_rows - 1)
        seq_len = tl.load(seq_lens_ptr + seq)
        seq_len = tl.minimum(tl.maximum(seq_len, 0), seq_cap)
        # Item ranges count from the first key the window reaches (0 without one), so a plan
        # built over the window-clipped lengths covers exactly the reachable keys.
        key_lo = _first_key(seq_len, window, chunk, LIMITED)
        start = key_lo + tl.maximum(t_lo, 0)
        end = tl.where(live, key_lo + tl.minimum(t_hi, seq_len - key_lo), 0)
    else:
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        # Bounds by construction: a length outside [0, seq_cap] (seq_cap = table width * block
        # size) is clamped, so no table column past the row's width is ever read.
        seq_len = tl.load(seq_lens_ptr + seq)
        seq_len = tl.minimum(tl.maximum(seq_len, 0), seq_cap)
        # Skip, not mask: the key loop starts at the first key the window or chunk reaches, so
        # no table entry before that key's block is read (they may be released, -1).
        key_lo = _first_key(seq_len, window, chunk, LIMITED)
        if SPLIT:
            per = tl.cdiv(tl.cdiv(seq_len - key_lo, num_splits), TILE_N) * TILE_N
            start = key_lo + split * per
            end = tl.minimum(start + per, seq_len)
        else:
            start = key_lo
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
    if F16:
        q = q.to(tl.float16)
    bt_row = bt_ptr + seq64 * stride_bts
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_kh

    if KV_FP8:
        # fp8 cache: K = k8 * k_scale and V = v8 * v_scale for the program's kv head, so the
        # K scale folds into the softmax scale and the V scale into the output; the tiles are
        # only widened to q's dtype for the tensor-core products.
        qk_scale = qk_scale * tl.load(ksc_ptr + kvh * scale_stride)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    bad = tl.zeros([TILE_N], dtype=tl.int32)
    if SWAP_AB:
        # Transposed products: the tile's tokens fill the MMA's M side (no padding of a small
        # query group to 16 rows there) and the K/V tiles are the register operand.
        q_t = tl.trans(q)
        acc_t = tl.zeros([HEAD_DIM, GROUP_PAD], dtype=tl.float32)
        for t0 in range(start, end, TILE_N):
            offs_t = t0 + offs_n
            t_ok = offs_t < end
            blk = tl.load(bt_row + offs_t // BLOCK_SIZE, mask=t_ok, other=0)
            bad = bad | ((blk < 0) | (blk >= num_blocks)).to(tl.int32)
            blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
            tok = blk * stride_kb + (offs_t % BLOCK_SIZE) * stride_kt
            k = tl.load(k_head + tok[:, None] + offs_d[None, :], mask=t_ok[:, None], other=0.0)
            if KV_FP8:
                k = k.to(q.dtype)
            s_t = tl.dot(k, q_t, input_precision=PRECISION) * qk_scale
            s_t = tl.where(t_ok[:, None], s_t, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s_t, 0))
            p_t = tl.math.exp2(s_t - m_new[None, :])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p_t, 0)
            v_t = tl.load(v_head + tok[None, :] + offs_d[:, None], mask=t_ok[None, :], other=0.0)
            if KV_FP8:
                v_t = v_t.to(q.dtype)
            acc_t = acc_t * alpha[None, :] + tl.dot(v_t, p_t.to(v_t.dtype),
                                                    input_precision=PRECISION)
            m_i = m_new
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
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
            if KV_FP8:
                k = k.to(q.dtype)  # fp16 when F16 (q was widened to it)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            s = tl.where(t_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            vv = tl.load(
                v_head + (blk * stride_kb + in_blk * stride_kt)[:, None] + offs_d[None, :],
                mask=t_ok[:, None],
                other=0.0,
            )
            if KV_FP8:
                vv = vv.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PRECISION)
            m_i = m_new

    seq_bad = tl.max(bad, 0) > 0
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = tl.where(seq_bad, 0.0, acc / l_safe[:, None])
    if KV_FP8:
        o = o * tl.load(vsc_ptr + kvh * scale_stride)
    if HAS_SINKS:
        # A sink joins the denominator with exp(sink) and adds no value. acc and l_i are
        # relative to m_i (log2 units); exp2(sink - m_i) may overflow to inf, which is the
        # right limit (the sink takes all the weight: zeros), also for an empty range.
        s2 = tl.load(sinks_ptr + qh, mask=g_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        o_final = tl.where(seq_bad, 0.0, acc / (l_i + tl.math.exp2(s2 - m_i))[:, None])
        if KV_FP8:
            o_final = o_final * tl.load(vsc_ptr + kvh * scale_stride)
    else:
        o_final = o
    lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
    # +inf marks a split that met an out-of-pool id: the merge then zeroes the sequence, so
    # the result does not depend on how the sequence was split.
    lse = tl.where(seq_bad, float("inf"), lse)
    if PLANNED:
        # A sequence with one item writes its output directly; the pieces of a split one go to
        # the partial rows the merge reads (layout [max_rows, q_heads, HEAD_DIM], packed). The
        # item is read again here (volatile: not merged with the first read) so its fields are
        # not kept live in registers across the key loop.
        live = item < n_items
        seq = tl.load(ip, mask=live, other=-1, volatile=True)
        row_raw = tl.load(ip + 3, mask=live, other=-1, volatile=True)
        live = live & (seq >= 0) & (seq < num_seqs)
        seq64 = tl.where(live, seq, 0).to(tl.int64)
        direct = row_raw < 0
        row = tl.minimum(tl.maximum(row_raw, 0), max_rows - 1)
        om = g_ok & live
        tl.store(
            out_ptr + seq64 * stride_os + qh[:, None] * stride_oh + offs_d[None, :],
            o_final.to(out_ptr.dtype.element_ty),
            mask=(om & direct)[:, None],
        )
        prow = row.to(tl.int64) * (KV_HEADS * GROUP) + qh
        pm = om & (row_raw >= 0)
        tl.store(po_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :], o, mask=pm[:, None])
        tl.store(pl_ptr + prow, lse, mask=pm)
    elif not SPLIT:
        tl.store(
            out_ptr + seq64 * stride_os + qh[:, None] * stride_oh + offs_d[None, :],
            o_final.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None],
        )
    else:
        # Partial layout [num_seqs, q_heads, num_splits, HEAD_DIM], packed.
        prow = (seq64 * (KV_HEADS * GROUP) + qh) * num_splits + split
        tl.store(po_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_ok[:, None])
        tl.store(pl_ptr + prow, lse, mask=g_ok)


@triton.jit
def _fold_pieces(po_ptr, prow, lse, m, den, num, poisoned, HEAD_DIM: tl.constexpr):
    """Folds pieces of one (sequence, q head) into a running log-sum-exp combine.

    `lse` [J]: the pieces' log-sum-exps (log2 units; -inf: empty, +inf: the piece met an
    out-of-pool block id, which makes the head's output zeros), `prow` [J]: their rows of the
    partial outputs `po_ptr` (each row normalized, HEAD_DIM floats). The state: `m`, `den`,
    `poisoned` [1], `num` [HEAD_DIM]. Empty pieces are not read at all."""
    offs_d = tl.arange(0, HEAD_DIM)
    poisoned = poisoned | tl.max(tl.where(lse == float("inf"), 1, 0), 0)
    lse = tl.where(lse == float("inf"), float("-inf"), lse)
    live = lse > float("-inf")
    m_new = tl.maximum(m, tl.max(lse, 0))
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    a = tl.math.exp2(m - m_use)
    w = tl.where(live, tl.math.exp2(lse - m_use), 0.0)
    o = tl.load(po_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :], mask=live[:, None],
                other=0.0)
    num = num * a + tl.sum(w[:, None] * o, 0)
    den = den * a + tl.sum(w, 0)
    return m_new, den, num, poisoned


@triton.jit
def _sink_den(den, m, sinks_ptr, h, HAS_SINKS: tl.constexpr):
    """The merged denominator with head `h`'s sink added (exp(sink), relative to the running
    max `m`, log2 units); an all-empty head (m = -inf) gets inf, so its output is zeros."""
    if HAS_SINKS:
        s2 = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        den = den + tl.math.exp2(s2 - m)
    return den


@triton.jit
def _merge_kernel(
    po_ptr,
    pl_ptr,
    out_ptr,
    sinks_ptr,
    stride_os,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # The heuristic's splits, layout [num_seqs, q_heads, num_splits, HEAD_DIM]: all folded at once.
    seq = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (seq.to(tl.int64) * tl.num_programs(1) + h) * num_splits + offs_s
    lse = tl.load(pl_ptr + rows, mask=offs_s < num_splits, other=float("-inf"))
    m, den, num, poisoned = _fold_pieces(
        po_ptr, rows, lse, tl.full([1], float("-inf"), dtype=tl.float32),
        tl.zeros([1], dtype=tl.float32), tl.zeros([HEAD_DIM], dtype=tl.float32),
        tl.zeros([1], dtype=tl.int32), HEAD_DIM,
    )
    den = _sink_den(den, m, sinks_ptr, h, HAS_SINKS)
    res = num / tl.where(den > 0.0, den, 1.0)
    res = tl.where(poisoned > 0, 0.0, res)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_os + h * stride_oh + offs_d,
        res.to(out_ptr.dtype.element_ty),
    )


@triton.jit
def _merge_planned_kernel(
    po_ptr,
    pl_ptr,
    plan_ptr,
    out_ptr,
    sinks_ptr,
    stride_os,
    stride_oh,
    max_rows,
    HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # Sequence `seq`'s partial rows are [indptr[seq], indptr[seq + 1]) (seq-major); a sequence
    # with fewer than two was written directly by the main kernel. Rows are folded in ROWS at a
    # time with a running max, so any number of pieces per sequence is served.
    seq = tl.program_id(0)
    h = tl.program_id(1)
    nh = tl.num_programs(1)
    r0 = tl.load(plan_ptr + 1 + seq)
    r1 = tl.load(plan_ptr + 2 + seq)
    r0 = tl.minimum(tl.maximum(r0, 0), max_rows)
    r1 = tl.minimum(tl.maximum(r1, r0), max_rows)
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    den = tl.zeros([1], dtype=tl.float32)
    num = tl.zeros([HEAD_DIM], dtype=tl.float32)
    poisoned = tl.zeros([1], dtype=tl.int32)
    hi = tl.where(r1 - r0 >= 2, r1, r0)
    for b in range(r0, hi, ROWS):
        r = b + offs_r
        rows = r.to(tl.int64) * nh + h
        lse = tl.load(pl_ptr + rows, mask=r < hi, other=float("-inf"))
        m, den, num, poisoned = _fold_pieces(po_ptr, rows, lse, m, den, num, poisoned, HEAD_DIM)
    den = _sink_den(den, m, sinks_ptr, h, HAS_SINKS)
    res = num / tl.where(den > 0.0, den, 1.0)
    res = tl.where(poisoned > 0, 0.0, res)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_os + h * stride_oh + offs_d,
        res.to(out_ptr.dtype.element_ty),
        mask=(offs_d < HEAD_DIM) & (r1 - r0 >= 2),
    )


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


def local_first_key(seq_len: int, window: int = 0, chunk: int = 0) -> int:
    """Host twin of the kernels' `_first_key`: the first key position the query at position
    `seq_len - 1` attends (0 without a window or chunk; `window`/`chunk` 0 mean unused)."""
    lo = 0
    if window:
        lo = max(lo, seq_len - window)
    if chunk and seq_len > 0:
        lo = max(lo, (seq_len - 1) // chunk * chunk)
    return lo


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
