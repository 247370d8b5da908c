"""The Triton kernels of paged prefill/extend attention.

Owns `_prefill_kernel` (one program per (row tile, head slot, sequence or sequence x split):
the unmasked and the causally masked key loops over the paged K/V), `_prefill_combine_kernel`
(merges the splits' normalised partial rows and log-sum-exps into `out`), and their device
helpers `_tile_step` (one online-softmax step over a key tile) and `_first_key_at` (the first
key a local-attention query reaches). Layouts, the split mode and the bounds contract are
described in `pagedkv.kernels.prefill`; the launches are prepared there. Invariant: these are
device code only; nothing here runs on the host or allocates.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_step(
    q, acc, m_i, l_i, first_bad, k_head, v_head, bt_row, n0, offs_n, offs_d, q_pos, seq_len,
    last_blk, blk0, qk_scale, stride_kb, stride_kt, stride_vb, stride_vt, row_lo,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr, LIMITED: tl.constexpr,
):
    offs_t = n0 + offs_n
    if MASKED:
        t_ok = offs_t < seq_len
        bu = tl.load(bt_row + offs_t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.uint32, bitcast=True)
    else:
        bu = tl.load(bt_row + offs_t // BLOCK_SIZE).to(tl.uint32, bitcast=True)
    # Out-of-pool ids: note the position, read the row's first block instead (see the kernel).
    oob = bu > last_blk
    first_bad = tl.minimum(first_bad, tl.where(oob, offs_t, 0x7FFFFFFF))
    blk = tl.where(oob, blk0, bu).to(tl.int64)
    in_blk = offs_t % BLOCK_SIZE
    k_ptrs = k_head + (blk * stride_kb + in_blk * stride_kt)[:, None] + offs_d[None, :]
    v_ptrs = v_head + (blk * stride_vb + in_blk * stride_vt)[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=t_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
    if KV_FP8:
        k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        allowed = (offs_t[None, :] <= q_pos[:, None]) & t_ok[None, :]
        if LIMITED:
            allowed = allowed & (offs_t[None, :] >= row_lo[:, None])
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Padding rows past q_len can be fully masked in a tile; keep their arithmetic finite.
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        vv = tl.load(v_ptrs, mask=t_ok[:, None], other=0.0)
    else:
        vv = tl.load(v_ptrs)
    if KV_FP8:
        vv = vv.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PRECISION)
    return acc, m_new, l_i, first_bad


@triton.jit
def _first_key_at(pos, window, attn_chunk):
    """First key position a query at position `pos` attends (`window`, `attn_chunk`: 0 when
    unused): `pos - window + 1` for a sliding window, `floor(pos / C) * C` for chunks."""
    lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    p = tl.maximum(pos, 0)
    return tl.where(attn_chunk > 0, tl.maximum(lo, (p // tl.maximum(attn_chunk, 1)) * attn_chunk),
                    lo)


@triton.jit(do_not_specialize=["total", "num_blocks", "seq_cap", "max_q_len", "num_splits",
                              "chunk", "window", "attn_chunk"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    max_q_len,
    ksc_ptr,
    vsc_ptr,
    ws_ptr,
    sinks_ptr,
    num_splits,
    chunk,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
    stride_ot,
    stride_oh,
    total,
    num_blocks,
    seq_cap,
    scale_stride,
    window,
    attn_chunk,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS_PER_ROW_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    ZERO_T: tl.constexpr,
    KV_FP8: tl.constexpr,
    F16: tl.constexpr,
    SPLIT: tl.constexpr,
    LIMITED: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # A tile has BLOCK_M rows = (token, head) pairs: HEADS_PER_ROW_TILE consecutive query heads
    # of one kv group for each of BLOCK_T tokens. With 1 head per tile it is the classic layout;
    # with the whole group packed, every K/V tile is fetched once for all heads that share it.
    BLOCK_T: tl.constexpr = BLOCK_M // HEADS_PER_ROW_TILE
    # Heavy tiles (late positions see more keys) first, so the short ones fill the tail.
    m_blk = tl.num_programs(0) - 1 - tl.program_id(0)
    head0 = tl.program_id(1) * HEADS_PER_ROW_TILE
    if SPLIT:
        seq = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits
    else:
        seq = tl.program_id(2)
    # Bounds by construction. The row range is clamped to [0, total) (q's and out's rows), so
    # no row outside them is read or written; a decreasing pair gives no rows. The length is
    # clamped to [0, seq_cap] (the table row's width times the block size), so no column past
    # the row is read. A sequence with fewer tokens than new rows has no valid positions: its
    # rows are written as zeros.
    q_start = tl.minimum(tl.maximum(tl.load(qsl_ptr + seq), 0), total)
    q_end = tl.minimum(tl.maximum(tl.load(qsl_ptr + seq + 1), q_start), total)
    q_len = q_end - q_start
    seq_len = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + seq), 0), seq_cap)
    ctx = seq_len - q_len
    # The grid covers max_q_len tokens per sequence: rows past it are zero-filled below.
    q_run = tl.minimum(q_len, max_q_len)
    first = m_blk * BLOCK_T
    offs_r = tl.arange(0, BLOCK_M)
    tok = first + offs_r // HEADS_PER_ROW_TILE
    head = head0 + offs_r % HEADS_PER_ROW_TILE
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    r_ok = (tok < q_run) & (offs_r < BLOCK_T * HEADS_PER_ROW_TILE)
    q_pos = ctx + tok
    kvh = head0 // GROUP
    # int32 sums (an int64 row vector live across the key loops costs spills): the host keeps
    # total below 2^30 and the grid within total + BLOCK_T rows, so they cannot overflow.
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=r_ok[:, None],
        other=0.0,
    )
    if F16:
        # fp8 cache: the tiles widen to q's dtype in the key loop, so q goes to fp16 first.
        q = q.to(tl.float16)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh

    # Rows past max_q_len (a host bound the caller got wrong) get zeros, never stale memory.
    # Each row tile takes every grid-th stripe of BLOCK_T tokens; with a right bound the loop is
    # empty. It runs before the key loops and in its own layout: after them, or sharing the
    # row tile's index vectors, its operands stay live across the loops and the 256x128 config
    # spills more (seen in the SASS).
    offs_zt = tl.arange(0, ZERO_T)
    zero = tl.zeros([ZERO_T, HEAD_DIM], dtype=out_ptr.dtype.element_ty)
    z_end = q_len
    if SPLIT:
        z_end = tl.where(split == 0, q_len, 0)  # one split writes them
    for z0 in range(max_q_len + first, z_end, tl.num_programs(0) * BLOCK_T):
        zt = z0 + offs_zt
        z_ok = (zt < q_len) & (offs_zt < BLOCK_T)
        zp = out_ptr + (q_start + zt).to(tl.int64)[:, None] * stride_ot + offs_d[None, :]
        for hh in tl.static_range(HEADS_PER_ROW_TILE):
            tl.store(zp + (head0 + hh) * stride_oh, zero, mask=z_ok[:, None])

    # Tiles before `full_end` lie at or before every row's position: no mask. `hi` ends at the
    # last row's position; a tile past q_len gets hi = 0 and does nothing.
    active = (first < q_run) & (ctx >= 0)
    # Block ids outside [0, num_blocks) (negative ones read as huge unsigned values) are never
    # followed: the key loops redirect them to the row's first block (clamped into the pool),
    # so every load stays inside the pool, and keep the first key position that had one
    # (`first_bad`, per lane). A query row that may see that position gets zeros at the end;
    # rows before it see only redirected lanes they mask anyway, and the first block's
    # contents are finite whenever a later column is used (it is then full), so they are
    # exact. One compare, one min and one select per id lane: the loops keep their registers,
    # where masking the K/V loads on each loaded id would not (more spills, measured in SASS).
    first_bad = tl.full([BLOCK_N], 0x7FFFFFFF, dtype=tl.int32)
    last_blk = (num_blocks - 1).to(tl.uint32)
    last_pos = tl.minimum(ctx + first + BLOCK_T, seq_len)
    hi = tl.where(active, last_pos, 0)
    full_end = tl.where(active, ((ctx + first + 1) // BLOCK_N) * BLOCK_N, 0)
    # Local attention (sliding window / chunks). Skip, not mask: the keys start at `base`, the
    # first key the tile's first row reaches, so no table entry before its block is read (they
    # may be released, -1). Key tiles step from `base`; `u0` (the first tile boundary at or past
    # the last row's first key) and `full_end` bound the tiles every row sees whole, which run
    # unmasked; the tiles before u0 and from full_end on are masked per row.
    base = 0
    u0 = 0
    row_lo = q_pos
    if LIMITED:
        base = _first_key_at(ctx + first, window, attn_chunk)
        row_lo = _first_key_at(q_pos, window, attn_chunk)
        lo_max = _first_key_at(ctx + first + BLOCK_T - 1, window, attn_chunk)
        u0 = base + tl.cdiv(tl.maximum(lo_max - base, 0), BLOCK_N) * BLOCK_N
        fe = base + (tl.maximum(ctx + first + 1 - base, 0) // BLOCK_N) * BLOCK_N
        full_end = tl.where(active, tl.maximum(fe, u0), u0)
    blk0 = tl.load(bt_row + base // BLOCK_SIZE, mask=seq_cap > 0, other=0).to(
        tl.uint32, bitcast=True)
    blk0 = tl.minimum(blk0, last_blk)

    if KV_FP8:
        # fp8 cache: the kv head's K scale folds into the softmax scale, its V scale into the
        # output (K = k8 * k_scale, V = v8 * v_scale).
        qk_scale = qk_scale * tl.load(ksc_ptr + kvh * scale_stride)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo = base
    full_lo = u0
    full_stop = full_end
    mask_lo = full_end
    if SPLIT:
        # This split's keys: [lo, hi) within the tile's [base, hi). lo and chunk are whole key
        # tiles from base, so the loops below cut the unsplit kernel's tiles, never a tile; the
        # last split runs to hi, so a host bound below the real lengths still covers every key.
        lo = base + split * chunk
        hi = tl.where(split == num_splits - 1, hi, tl.minimum(hi, lo + chunk))
        full_lo = tl.maximum(u0, lo)
        full_stop = tl.minimum(full_end, hi)
        mask_lo = tl.maximum(full_end, lo)
    if LIMITED:
        # Tiles some rows see only in part (their window starts inside): masked.
        for n0 in range(lo, tl.minimum(u0, hi), BLOCK_N):
            acc, m_i, l_i, first_bad = _tile_step(
                q, acc, m_i, l_i, first_bad, k_head, v_head, bt_row, n0, offs_n, offs_d, q_pos,
                seq_len, last_blk, blk0, qk_scale, stride_kb, stride_kt, stride_vb, stride_vt,
                row_lo, BLOCK_SIZE, True, PRECISION, KV_FP8, LIMITED,
            )
    for n0 in range(full_lo, full_stop, BLOCK_N):
        acc, m_i, l_i, first_bad = _tile_step(
            q, acc, m_i, l_i, first_bad, k_head, v_head, bt_row, n0, offs_n, offs_d, q_pos, seq_len,
            last_blk, blk0, qk_scale, stride_kb, stride_kt, stride_vb, stride_vt, row_lo,
            BLOCK_SIZE, False, PRECISION, KV_FP8, LIMITED,
        )
    for n0 in range(mask_lo, hi, BLOCK_N):
        acc, m_i, l_i, first_bad = _tile_step(
            q, acc, m_i, l_i, first_bad, k_head, v_head, bt_row, n0, offs_n, offs_d, q_pos, seq_len,
            last_blk, blk0, qk_scale, stride_kb, stride_kt, stride_vb, stride_vt, row_lo,
            BLOCK_SIZE, True, PRECISION, KV_FP8, LIMITED,
        )
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if HAS_SINKS and not SPLIT:
        # A sink joins the denominator with exp(sink), no value (log2 units, relative to m_i;
        # an overflow to inf gives the right limit, zeros). Split runs add it in the merge.
        s2 = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        o = acc / (l_i + tl.math.exp2(s2 - m_i))[:, None]
    else:
        o = acc / l_safe[:, None]
    if KV_FP8:
        o = o * tl.load(vsc_ptr + kvh * scale_stride)
    bad = q_pos >= tl.min(first_bad, 0)
    # A select, not a product: a row that saw a redirected id may hold NaN from stale slots.
    o = tl.where(bad[:, None], 0.0, o)
    if SPLIT:
        # Workspace rows (split, seq, token, head), token < max_q_len: the grid's own slots,
        # whatever the row offsets say, so no two programs share one. The partial rows come
        # first, then one log-sum-exp per row; the host sized it for this grid.
        heads = tl.num_programs(1) * HEADS_PER_ROW_TILE
        seq_slots = (tl.num_programs(2) // num_splits).to(tl.int64) * max_q_len * heads
        slot = ((split * seq_slots + seq.to(tl.int64) * max_q_len * heads)
                + tok.to(tl.int64) * heads + head)
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        lse = tl.where(bad, float("inf"), lse)
        tl.store(ws_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], o, mask=r_ok[:, None])
        tl.store(ws_ptr + num_splits * seq_slots * HEAD_DIM + slot, lse, mask=r_ok)
    else:
        tl.store(
            out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=r_ok[:, None],
        )


@triton.jit(do_not_specialize=["total", "max_q_len", "num_splits"])
def _prefill_combine_kernel(
    ws_ptr,
    qsl_ptr,
    out_ptr,
    sinks_ptr,
    max_q_len,
    num_splits,
    stride_ot,
    stride_oh,
    total,
    HEAD_DIM: tl.constexpr,
    HEADS_PER_ROW_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SUB_M: tl.constexpr,
    SPLIT_B: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # Program (row tile * sub-tiles + sub-tile, head slot, sequence): the split kernel's row tile
    # cut into SUB_M-row pieces (a whole tile's fp32 rows per split would not fit in registers,
    # and the pieces spread the merge over more SMs), with its row clamping, so exactly the
    # rows it would have written are written here.
    BLOCK_T: tl.constexpr = BLOCK_M // HEADS_PER_ROW_TILE
    SUBS: tl.constexpr = BLOCK_M // SUB_M
    m_blk = tl.program_id(0) // SUBS
    sub = tl.program_id(0) % SUBS
    head0 = tl.program_id(1) * HEADS_PER_ROW_TILE
    seq = tl.program_id(2)
    q_start = tl.minimum(tl.maximum(tl.load(qsl_ptr + seq), 0), total)
    q_end = tl.minimum(tl.maximum(tl.load(qsl_ptr + seq + 1), q_start), total)
    q_len = q_end - q_start
    q_run = tl.minimum(q_len, max_q_len)
    first = m_blk * BLOCK_T
    offs_r = sub * SUB_M + tl.arange(0, SUB_M)
    tok = first + offs_r // HEADS_PER_ROW_TILE
    head = head0 + offs_r % HEADS_PER_ROW_TILE
    offs_d = tl.arange(0, HEAD_DIM)
    r_ok = (tok < q_run) & (offs_r < BLOCK_T * HEADS_PER_ROW_TILE)
    # Splits that saw no key of a row (lse -inf) get no weight; one that saw an out-of-pool
    # position at or before the row (+inf) zeroes it, as the unsplit kernel would.
    heads = tl.num_programs(1) * HEADS_PER_ROW_TILE
    seq_slots = tl.num_programs(2).to(tl.int64) * max_q_len * heads
    slot = seq.to(tl.int64) * max_q_len * heads + tok.to(tl.int64) * heads + head
    lse_ptr = ws_ptr + num_splits * seq_slots * HEAD_DIM
    offs_s = tl.arange(0, SPLIT_B)
    m = tl.full([SUB_M], float("-inf"), dtype=tl.float32)
    den = tl.zeros([SUB_M], dtype=tl.float32)
    num = tl.zeros([SUB_M, HEAD_DIM], dtype=tl.float32)
    bad = tl.zeros([SUB_M], dtype=tl.int1)
    # Tiles and sub-tiles past q_run have nothing to merge.
    n_s = tl.where((first < q_run) & (sub * SUB_M < BLOCK_T * HEADS_PER_ROW_TILE), num_splits, 0)
    # SPLIT_B splits per step, loaded as one tile: the loop is not software-pipelined, so one
    # split per step would wait out a memory latency per split.
    for s0 in range(0, n_s, SPLIT_B):
        sp = s0 + offs_s
        ok = (sp < n_s)[:, None] & r_ok[None, :]
        at = sp.to(tl.int64)[:, None] * seq_slots + slot[None, :]
        lse = tl.load(lse_ptr + at, mask=ok, other=float("-inf"))
        part = tl.load(ws_ptr + at[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                       mask=ok[:, :, None], other=0.0)
        flag = lse == float("inf")
        bad = bad | (tl.max(flag.to(tl.int32), 0) > 0)
        lse = tl.where(flag, float("-inf"), lse)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.math.exp2(m - m_use)
        w = tl.math.exp2(lse - m_use[None, :])
        den = den * alpha + tl.sum(w, 0)
        num = num * alpha[:, None] + tl.sum(w[:, :, None] * part, 0)
        m = m_new
    if HAS_SINKS:
        # The sink joins the merged denominator (relative to m; all-empty rows get inf: zeros).
        s2 = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        den = den + tl.math.exp2(s2 - m)
    o = num / tl.where(den > 0.0, den, 1.0)[:, None]
    o = tl.where(bad[:, None], 0.0, o)
    rows = (q_start + tok).to(tl.int64)
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=r_ok[:, None],
    )
