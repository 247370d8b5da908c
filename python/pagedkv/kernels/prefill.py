"""Paged prefill/extend attention over a varlen batch.

Owns `paged_prefill`. Layouts: `q` `[total_new_tokens, q_heads, head_dim]`, sequence i's new
tokens being rows `query_start_loc[i] .. query_start_loc[i+1]`; `seq_lens[i]` is its total context
including those tokens, so the new tokens sit at positions `seq_lens[i] - q_len_i .. seq_lens[i]`
and their K/V must already be in the pool (scatter first). Pool, block tables and GQA mapping as
for decode. A batch may mix prefill chunks with decode rows (q_len 1): one launch serves both.

This module holds the entry point (argument checks, launch preparation and its cache) and
re-exports the rest: the Triton kernels live in `_prefill_kernels`, the tile configs and the
split count in `_prefill_config` (`_PrefillCall` looks the split count up here, where tests
substitute it).

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

from . import _launch as L
from . import _validate as v
from ._prefill_config import _MAX_GRID_Z as _MAX_GRID_Z
from ._prefill_config import MAX_ROWS as MAX_ROWS
from ._prefill_config import MAX_SEQ_CAP as MAX_SEQ_CAP
from ._prefill_config import MIN_CHUNK as MIN_CHUNK
from ._prefill_config import SPLIT_WAVES as SPLIT_WAVES
from ._prefill_config import _num_splits as _num_splits
from ._prefill_config import _split_chunk as _split_chunk
from ._prefill_config import _tile_config as _tile_config
from ._prefill_config import prefill_config as prefill_config
from ._prefill_kernels import _first_key_at as _first_key_at
from ._prefill_kernels import _prefill_combine_kernel as _prefill_combine_kernel
from ._prefill_kernels import _prefill_kernel as _prefill_kernel
from ._prefill_kernels import _tile_step as _tile_step
from .decode import local_first_key, num_sms

__all__ = ["paged_prefill", "prefill_config"]

_LOG2E = 1.4426950408889634


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
