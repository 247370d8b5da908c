"""Paged prefill/extend attention over a varlen batch.

Owns `paged_prefill`. Layouts: `q` `[total_new_tokens, q_heads, head_dim]`, sequence i's new
tokens being rows `query_start_loc[i] .. query_start_loc[i+1]`; `seq_lens[i]` is its total context
including those tokens, so the new tokens sit at positions `seq_lens[i] - q_len_i .. seq_lens[i]`
and their K/V must already be in the pool (scatter first). Pool, block tables and GQA mapping as
for decode. A batch may mix prefill chunks with decode rows (q_len 1): one launch serves both.

Kernel shape. One program per (row tile, head slot, sequence). A row tile has `BLOCK_M` rows; with
GQA packing (the default when a kv group has 2 to BLOCK_M/16 query heads) a row is a
(token, query head) pair, so a tile holds BLOCK_M/group tokens times all heads of one kv group
and each K/V tile is fetched once for the whole group; otherwise a tile is BLOCK_M tokens of one
query head. The program streams the sequence's K/V through the block table in tiles of `BLOCK_N`
tokens with an online softmax, and the heaviest tiles (latest positions) are launched first. Key
tiles wholly at or before the tile's first query position need no causal mask and run in a first
loop; the remaining tiles up to the tile's last position run in a second, masked loop, so only
the diagonal pays for masking. Query tiles past a sequence's q_len do no work.

Split mode (split-K, as flash-decoding). A few new tokens over a long context make a grid of a
handful of programs, each walking the whole context alone. Given `max_seq_len` (a host bound on
seq_lens) and a grid below the SM count, or `config={"SPLITS": s}`, the key range is cut into
`S` chunks of `chunk` keys (a multiple of BLOCK_N): program axis 2 becomes `seq * S + split`,
split `s` runs the same two loops over its tiles of `[s * chunk, (s + 1) * chunk)` (the last
split runs to the tile's end, so a `max_seq_len` below the real lengths costs balance, never
keys) and writes its normalised partial rows and their base-2 log-sum-exp to an fp32 workspace
indexed by (split, sequence, token < max_q_len, head), so its size follows the grid, not q's
rows; a second kernel over the same row tiles (in 8-row pieces) and the same row clamping merges
the splits into `out`. A split that sees no key of a row writes -inf (no
weight); one whose keys include an out-of-pool position at or before the row writes +inf, which
makes the merge write zeros, so the `first_bad` rule holds across splits. Split 0 alone
zero-fills the rows past `max_q_len`. S = 1 is the single-kernel path, no workspace.

Local attention (`window`, `chunk`, `sinks`; docs/kernels.md): a row tile's key loops start at
the first key its first row reaches; tiles some rows see only in part are masked per row, the
ones all rows see whole run unmasked; splits cut the range from that first key.

Invariants: a query at position p sees exactly the keys at positions 0..p of its own sequence
(within its window or chunk when given); only `ceil(seq_len / block_size)` block-table entries
are read, none wholly before the first key the row tile reaches; masked K/V lanes load zeros so
stale pool contents cannot leak into the output; every output row of a valid query token is
written, rows no sequence claims are untouched. Bounds by construction (docs/kernels.md,
"Bounds contract"): whatever the index tensors and `max_q_len` say, no access leaves the pool,
the table rows, `q` or `out`: row ranges are clamped to `q`'s rows, lengths to the table row;
a row that would see a token of an out-of-pool block id, a sequence with fewer tokens than new
rows, and rows past `max_q_len` are written as zeros.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _launch as L
from . import _validate as v
from .decode import local_first_key, num_sms

__all__ = ["paged_prefill", "prefill_config"]

_LOG2E = 1.4426950408889634

#: Longest context the kernels serve (as in decode: token indices stay in int32).
MAX_SEQ_CAP = 1 << 30

#: Rows of q (new tokens in one call) the kernel indexes in int32.
MAX_ROWS = 1 << 30

#: Fewest keys the automatic split count gives a split: a shorter one pays its q load and its
#: partial rows' traffic for too few key tiles.
MIN_CHUNK = 512

#: Programs per SM the automatic split count aims for.
SPLIT_WAVES = 2

#: CUDA's limit on grid axis 2, which holds num_seqs * splits.
_MAX_GRID_Z = 65535


def _split_chunk(max_seq_len: int, splits: int, block_n: int) -> int:
    """Keys per split: `splits` equal shares of `max_seq_len`, rounded up to whole key tiles."""
    per = -(-max_seq_len // splits)
    return max(block_n, -(-per // block_n) * block_n)


def _num_splits(programs: int, max_seq_len: int, block_n: int, sms: int) -> int:
    """Automatic split count for an unsplit grid of `programs` over contexts of at most
    `max_seq_len` keys: 1 when the grid already fills the `sms` SMs; otherwise enough splits for
    about SPLIT_WAVES programs per SM, each at least MIN_CHUNK keys, then as few as cover
    `max_seq_len` with the tile-rounded chunk (no split left empty by the rounding)."""
    if programs >= sms:
        return 1
    s = min(max_seq_len // MIN_CHUNK, -(-SPLIT_WAVES * sms // max(1, programs)))
    if s <= 1:
        return 1
    return -(-max_seq_len // _split_chunk(max_seq_len, s, block_n))


def prefill_config(head_dim: int, dtype: torch.dtype, interpret: bool,
                   cache_dtype: Optional[torch.dtype] = None) -> dict:
    """Launch parameters for `q`'s `dtype` (and the cache's, default the same). `PACK_GQA`
    packs a kv group's query heads into one row tile (used when the group has 2 to BLOCK_M/16
    heads); `FP8_COMPUTE` is read for fp8 caches only. `SPLITS` None chooses the split count
    from `max_seq_len` (`_num_splits`); an int forces it (1: never split)."""
    cfg = _tile_config(head_dim, dtype, interpret)
    cfg["SPLITS"] = None
    # fp8 caches: "fp16" widens the e4m3 tiles (and q, p) to fp16 for the tensor-core products,
    # the native conversion; "q" widens them to q's dtype (bf16 has no direct e4m3 conversion).
    cfg["FP8_COMPUTE"] = "fp16"
    if cache_dtype == v.FP8 and not interpret and dtype != torch.float32 and head_dim == 128:
        # The widening sits between the loads and the products: 64-key tiles with 3 stages
        # hide it best (H200, 8 x 2048 over 2048: 2572 us against 3597 for 128-key tiles with
        # 2 stages; 4 stages tie, 32-key tiles and 128-row tiles lose; docs/performance.md).
        cfg.update(BLOCK_N=64, num_stages=3)
    return cfg


def _tile_config(head_dim: int, dtype: torch.dtype, interpret: bool) -> dict:
    if interpret:
        return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "PACK_GQA": True}
    if dtype == torch.float32:
        # fp32 tiles are twice the bytes: smaller tiles keep the pipeline within shared memory.
        if head_dim <= 128:
            return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "PACK_GQA": True}
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "PACK_GQA": True}
    if head_dim <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PACK_GQA": True}
    if head_dim <= 128:
        # Best of the H200 sweeps (docs/kernels.md): 256 rows = 64 tokens x 4 heads at GQA 4.
        return {"BLOCK_M": 256, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "PACK_GQA": True}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "PACK_GQA": True}


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


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_q_len: int,
    *,
    scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    check_indices: bool = False,
    config: Optional[dict] = None,
    k_scale=None,
    v_scale=None,
    max_seq_len: Optional[int] = None,
    window: Optional[int] = None,
    chunk: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and themselves.

    `max_q_len` is a host-side upper bound on the per-sequence new-token counts (it sizes the
    grid; passing it avoids a device-to-host sync); rows past it are written as zeros, so a
    wrong bound shows up as zero rows, never as stale memory. `scale` defaults to
    `1/sqrt(head_dim)`.
    `max_seq_len` (optional) is a host-side upper bound on `seq_lens`: with it, a grid smaller
    than the SM count over long contexts is split along the keys (module docstring, "Split
    mode"); without it the kernel never splits unless `config` says so. A bound below the real
    lengths only unbalances the splits (the last one runs to each sequence's end): the output
    stays exact. It is taken as at most the table row's width times the block size.
    `check_indices=True` validates the index tensors on the host (synchronizes; debugging only).
    `config` overrides the launch parameters of `prefill_config` (keys `BLOCK_M`, `BLOCK_N`,
    `num_warps`, `num_stages`, `PACK_GQA`, `FP8_COMPUTE`, `SPLITS`; for tuning and tests).
    Returns `out` (allocated like `q` when not given).
    The checks and launch configuration are cached per call signature (`_launch.py`).
    An fp8 cache is read as `k8 * k_scale`, `v8 * v_scale` (as for `paged_decode`).
    `window`, `chunk` and `sinks` as for `paged_decode`, per query row: the row at position p
    attends keys `[p - window + 1, p]`, or `[floor(p / chunk) * chunk, p]`; each row tile's key
    loop starts at the first key its first row reaches (the split count sees at most the window
    or chunk plus `max_q_len` keys), and no table entry before that key's block is read.
    """
    key = None
    if not check_indices:
        try:
            key = (L.tensor_key(q), L.tensor_key(k_cache), L.tensor_key(v_cache),
                   L.tensor_key(block_tables), L.tensor_key(seq_lens),
                   L.tensor_key(query_start_loc), None if out is None else L.tensor_key(out),
                   scale, None if config is None else tuple(sorted(config.items())),
                   type(max_q_len) is int and max_q_len >= 0,
                   max_seq_len is None or (type(max_seq_len) is int and max_seq_len >= 0),
                   v.scale_key(k_scale), v.scale_key(v_scale),
                   window, chunk, None if sinks is None else L.tensor_key(sinks))
            call = _CACHE.get(key)
        except (AttributeError, TypeError):
            key = call = None
        if call is not None:
            return call(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
                        max_q_len, max_seq_len, k_scale, v_scale, sinks)
    call = _prepare(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_q_len,
                    max_seq_len, scale, out, check_indices, config, k_scale, v_scale,
                    window, chunk, sinks)
    if call is None:
        return torch.empty_like(q) if out is None else out
    if key is not None:
        _CACHE.put(key, call)
    return call(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, max_q_len,
                max_seq_len, k_scale, v_scale, sinks)


class _PrefillCall:
    """A validated `paged_prefill` signature. Per call, from two host ints, it sizes the grid
    (max_q_len) and picks the split count (max_seq_len); neither changes a compiled kernel (the
    split count and chunk are unspecialized arguments), so the signature need not hold them."""

    __slots__ = ("launch", "split_launch", "combine_launch", "block_t", "block_n", "g1", "g2",
                 "total", "heads", "head_dim", "subs", "seq_cap", "sms", "splits", "ks", "vs",
                 "reach")

    def __call__(self, q, k_cache, v_cache, block_tables, seq_lens, qsl, out, max_q_len,
                 max_seq_len, k_scale, v_scale, sinks=None):
        if out is None:
            out = torch.empty_like(q)
        # A float scale's tensor lives in the call, a tensor comes per call; without fp8
        # seq_lens stands in (never read).
        ks = self.ks if self.ks is not None else (k_scale if k_scale is not None else seq_lens)
        vs = self.vs if self.vs is not None else (v_scale if v_scale is not None else seq_lens)
        sk = sinks if sinks is not None else seq_lens  # read only with sinks
        # No sequence has more rows than q, so a larger bound only sizes an idle grid: cap it.
        # At least one row tile, so rows a wrong max_q_len of 0 leaves out are still zeroed.
        mq = min(max_q_len, self.total)
        tiles = max(1, -(-mq // self.block_t))
        splits = 1
        msl = self.seq_cap if max_seq_len is None else min(max_seq_len, self.seq_cap)
        if self.reach:
            # A row tile's keys start at its first row's first key: at most the window (or
            # chunk) plus the tile's other rows.
            msl = min(msl, self.reach + mq)
        if mq > 0 and (self.splits is not None or max_seq_len is not None):
            splits = self.splits
            if splits is None:
                splits = _num_splits(tiles * self.g1 * self.g2, msl, self.block_n, self.sms)
            splits = min(splits, _MAX_GRID_Z // self.g2)
        if splits <= 1:
            # out stands in for the workspace (never read).
            self.launch((tiles, self.g1, self.g2), q, k_cache, v_cache, block_tables, seq_lens,
                        qsl, out, mq, ks, vs, out, sk, 1, 0)
            return out
        chunk = _split_chunk(msl, splits, self.block_n)
        ws = torch.empty(splits * self.g2 * mq * self.heads * (self.head_dim + 1),
                         dtype=torch.float32, device=q.device)
        self.split_launch((tiles, self.g1, self.g2 * splits), q, k_cache, v_cache, block_tables,
                          seq_lens, qsl, out, mq, ks, vs, ws, sk, splits, chunk)
        self.combine_launch((tiles * self.subs, self.g1, self.g2), ws, qsl, out, sk, mq, splits)
        return out


_CACHE = L.LaunchCache()


def _prepare(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_q_len,
             max_seq_len, scale, out, check_indices, config, k_scale, v_scale, window=None,
             chunk=None, sinks=None):
    num_blocks, block_size, kv_heads, head_dim = v.check_cache_pair(k_cache, v_cache)
    win, chk = v.check_local(window, chunk)
    dev = k_cache.device
    fp8 = k_cache.dtype == v.FP8
    v.check_tensor("q", q, ndim=3, dtypes=v.act_dtypes(k_cache.dtype))
    ks, vs, k_stride = v.kv_scales(k_scale, v_scale, kv_heads, dev, fp8)
    v.check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    v.check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,))
    v.check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,))
    v.check_same_device(
        dev, q=q, block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc
    )
    v.ensure_launchable(dev)
    total, q_heads, _ = q.shape
    if total >= MAX_ROWS:
        # Row indices are int32 sums in the kernel (see there); 2^30 rows is far past any batch.
        raise v.KernelShapeError(f"q: has {total} rows (dim 0), expected fewer than {MAX_ROWS}")
    v.check_dim("q", q, 2, head_dim, "head_dim of the pool")
    if q_heads % kv_heads:
        raise v.KernelShapeError(
            f"q: has {q_heads} heads (dim 1), expected a multiple of the pool's kv_heads ({kv_heads})"
        )
    num_seqs = seq_lens.shape[0]
    v.check_dim("query_start_loc", query_start_loc, 0, num_seqs + 1, "num_seqs + 1 offsets")
    v.check_min_dim("block_tables", block_tables, 0, num_seqs, "one row per sequence")
    v.check_inner_contiguous("q", q, 1)
    if block_tables.stride(1) != 1:
        raise v.KernelLayoutError(
            f"block_tables: column stride is {block_tables.stride(1)}, expected 1"
        )
    v.check_contiguous("seq_lens", seq_lens)
    v.check_contiguous("query_start_loc", query_start_loc)
    v.check_int("max_q_len", max_q_len, 0)
    if max_seq_len is not None:
        v.check_int("max_seq_len", max_seq_len, 0)
    if out is not None:
        v.check_tensor("out", out, ndim=3, dtypes=(q.dtype,))
        v.check_same_device(dev, out=out)
        if tuple(out.shape) != tuple(q.shape):
            raise v.KernelShapeError(
                f"out: shape is {tuple(out.shape)}, expected {tuple(q.shape)} (as q)"
            )
        v.check_inner_contiguous("out", out, 1)
    v.check_sinks(sinks, q_heads, dev)
    sc = v.check_scale(scale, head_dim)
    seq_cap = min(block_tables.shape[1] * block_size, MAX_SEQ_CAP)
    if check_indices:
        _check_indices(block_tables, seq_lens, query_start_loc, total, max_q_len, num_blocks,
                       block_size, seq_cap if max_seq_len is None else min(seq_cap, max_seq_len),
                       win, chk)
    if num_seqs == 0 or total == 0:
        return None
    interpret = L.interpreting()
    cfg = prefill_config(head_dim, q.dtype, interpret, k_cache.dtype)
    cfg = v.merge_config(cfg, config)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if cfg["FP8_COMPUTE"] not in ("fp16", "q"):
        raise v.KernelArgumentError(
            f"config: FP8_COMPUTE is {cfg['FP8_COMPUTE']!r}, expected 'fp16' or 'q'"
        )
    splits = cfg["SPLITS"]
    if splits is not None:
        v.check_int("config: SPLITS", splits, 1)
    f16 = fp8 and q.dtype != torch.float32 and cfg["FP8_COMPUTE"] == "fp16"
    group = q_heads // kv_heads
    pack = cfg["PACK_GQA"] and 1 < group <= cfg["BLOCK_M"] // 16
    per_tile = group if pack else 1
    block_t = cfg["BLOCK_M"] // per_tile
    o_ref = out if out is not None else torch.empty_like(q)
    call = _PrefillCall()
    call.block_t, call.g1, call.g2, call.total = block_t, q_heads // per_tile, num_seqs, total
    call.block_n, call.heads, call.head_dim = cfg["BLOCK_N"], q_heads, head_dim
    call.seq_cap, call.sms, call.splits = seq_cap, num_sms(dev), splits
    call.reach = min(x for x in (win, chk, 1 << 62) if x) if (win or chk) else 0
    call.ks = ks if fp8 and not isinstance(k_scale, torch.Tensor) else None
    call.vs = vs if fp8 and not isinstance(v_scale, torch.Tensor) else None
    tail = (sc * _LOG2E,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0),
            o_ref.stride(0), o_ref.stride(1),
            total, num_blocks, seq_cap, k_stride, win, chk)
    consts = dict(BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group,
                  HEADS_PER_ROW_TILE=per_tile, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                  PRECISION=precision, ZERO_T=triton.next_power_of_2(block_t), KV_FP8=fp8,
                  F16=f16, LIMITED=bool(win or chk), HAS_SINKS=sinks is not None,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    call.launch = L.Launch(_prefill_kernel, tail, dict(consts, SPLIT=False))
    call.split_launch = L.Launch(_prefill_kernel, tail, dict(consts, SPLIT=True))
    # Merge steps of 4 splits x 8 rows: no spills at head_dim 64 to 256 in the sm_90 build
    # (16 rows spill at 128 and 256; the 64-bit addresses of the 3-d tile cost the registers).
    sub_m = min(cfg["BLOCK_M"], 8)
    call.subs = cfg["BLOCK_M"] // sub_m
    call.combine_launch = L.Launch(
        _prefill_combine_kernel,
        (o_ref.stride(0), o_ref.stride(1), total),
        dict(HEAD_DIM=head_dim, HEADS_PER_ROW_TILE=per_tile, BLOCK_M=cfg["BLOCK_M"], SUB_M=sub_m,
             SPLIT_B=4, HAS_SINKS=sinks is not None, num_warps=4,
             num_stages=1 if interpret else 2),
    )
    return call


def _check_indices(block_tables, seq_lens, qsl, total, max_q_len, num_blocks, block_size, seq_cap,
                   window=0, chunk=0):
    sl = seq_lens.to("cpu").tolist()
    qs = qsl.to("cpu").tolist()
    if qs[0] != 0 or qs[-1] > total:
        raise v.KernelIndexError(
            f"query_start_loc: runs from {qs[0]} to {qs[-1]}, expected from 0 to at most {total}"
        )
    bt = block_tables.to("cpu")
    for i, n in enumerate(sl):
        ql = qs[i + 1] - qs[i]
        if ql < 0 or ql > max_q_len:
            raise v.KernelIndexError(
                f"query_start_loc: sequence {i} has {ql} new tokens, expected in [0, {max_q_len}]"
            )
        if n < ql or n > seq_cap:
            raise v.KernelIndexError(f"seq_lens[{i}]: is {n}, expected in [{ql}, {seq_cap}]")
        nb = -(-n // block_size)
        # Entries before the first key the first new row reaches are never read.
        b0 = local_first_key(n - ql + 1, window, chunk) // block_size
        row = bt[i, b0:nb]
        bad = ((row < 0) | (row >= num_blocks)).nonzero()
        if bad.numel():
            j = b0 + int(bad[0, 0])
            raise v.KernelIndexError(
                f"block_tables[{i}, {j}]: is {int(row[j])}, expected in [0, {num_blocks})"
            )
