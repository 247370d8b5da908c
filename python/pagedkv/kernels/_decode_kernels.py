"""The Triton kernels of paged decode: the main split-K kernel and the merges of its pieces.

Owns `_decode_kernel` (one program per (sequence, kv head, split), or per (work item, kv head)
with a plan), `_merge_kernel` and `_merge_planned_kernel` (fold the split pieces' normalized
partial outputs and log-sum-exps into `out`), and their device helpers `_first_key` (the first
key a local-attention query reaches), `_fold_pieces` and `_sink_den`. Layouts, the kernel shape
and the bounds contract are described in `pagedkv.kernels.decode`; the launches are prepared
there. Invariant: these are device code only; nothing here runs on the host or allocates.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
