"""Plain PyTorch references for the kernels, computed in float64 by default.

Owns the slow, obviously-correct versions the tests compare against: they walk each sequence's
block table on the host side of the math (index_select of the used blocks, then dense attention),
never touch a block-table column past `ceil(seq_len / block_size)`, and return new tensors
instead of writing in place (except `ref_scatter_kv`/`ref_copy_blocks`, which return updated
copies of the pool). They are for testing only and make no attempt at speed.

They also define what the kernels return for index tensors that break the layout contract (the
bounds contract in docs/kernels.md): a length is clamped to `[0, table width * block_size]`; a
query row that would attend to a token whose block-table entry lies outside `[0, num_blocks)`
gives zeros (a decode query sees its whole sequence, so any such entry among the used ones
zeroes it; a prefill row at position p only when the entry's block starts at or before p); a
query row range is clamped to the rows of `q`; a sequence with fewer tokens than new rows, and
rows past `max_q_len`, give zeros. For valid inputs these rules change nothing.

Local attention: `window` W lets the query at position p see keys `[p - W + 1, p]` (W counts the
query, as transformers' `sliding_window`), `chunk` C keys `[floor(p / C) * C, p]`; `sinks`
`[q_heads]` adds `exp(sinks[h])` to head h's softmax denominator (gpt-oss), with no value. Only
the blocks a sequence's queries can reach are gathered, and only their entries count for the
bounds rule (entries before them may be -1, as the block manager leaves them).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = [
    "ref_scatter_kv",
    "gather_sequence",
    "bounded_length",
    "ref_paged_decode",
    "ref_paged_prefill",
    "ref_copy_blocks",
    "first_key",
]


def ref_scatter_kv(key, value, k_cache, v_cache, slot_mapping):
    """Returns (k_cache', v_cache'): copies with each non-padding token written to its slot."""
    kc = k_cache.clone()
    vc = v_cache.clone()
    nb, bs = kc.shape[:2]
    flat_k = kc.view(nb * bs, *kc.shape[2:])
    flat_v = vc.view(nb * bs, *vc.shape[2:])
    for i, slot in enumerate(slot_mapping.tolist()):
        if 0 <= slot < nb * bs:
            flat_k[slot] = key[i]
            flat_v[slot] = value[i]
    return kc, vc


def gather_sequence(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence as a dense `[seq_len, kv_heads, head_dim]`.

    Every used entry of `block_row` must name a block of `cache`."""
    bs = cache.shape[1]
    nblk = -(-seq_len // bs)
    ids = block_row[:nblk].long().to(cache.device)
    return cache.index_select(0, ids).reshape(nblk * bs, *cache.shape[2:])[:seq_len]


def bounded_length(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int,
                   first_key: Optional[int] = None):
    """`(length, first_bad)` as the kernels see a sequence (bounds contract): `seq_len` clamped to
    the row's width times the block size, and the first token position whose block id (among the
    entries that length uses, from the block of `first_key` on when given: the earliest key any
    query reaches) lies outside the pool, or None."""
    nb, bs = cache.shape[:2]
    seq_len = max(0, min(seq_len, block_row.shape[0] * bs))
    b0 = 0 if first_key is None else max(0, first_key) // bs
    ids = block_row[b0: -(-seq_len // bs)].long()
    bad = ((ids < 0) | (ids >= nb)).nonzero()
    return seq_len, ((b0 + int(bad[0, 0])) * bs if bad.numel() else None)


def first_key(pos: int, window: Optional[int] = None, chunk: Optional[int] = None) -> int:
    """The first key position a query at position `pos` attends."""
    lo = 0
    if window:
        lo = max(lo, pos - window + 1)
    if chunk:
        lo = max(lo, max(pos, 0) // chunk * chunk)
    return lo


def _gather_from(cache, block_row, base_block: int, seq_len: int):
    """Tokens `[base_block * block_size, seq_len)` of one sequence, dense."""
    bs = cache.shape[1]
    nblk = -(-seq_len // bs)
    if nblk <= base_block:
        return cache.new_zeros((0, *cache.shape[2:]))
    ids = block_row[base_block:nblk].long().to(cache.device)
    dense = cache.index_select(0, ids).reshape((nblk - base_block) * bs, *cache.shape[2:])
    return dense[: seq_len - base_block * bs]


def _attend(q, k, v, scale, q_pos, dtype, base=0, window=None, chunk=None, sinks=None):
    """q [n, Hq, D]; k, v [L, Hkv, D] holding key positions `base ..`; query i sees keys at
    positions <= q_pos[i] (and within its window / chunk); `sinks` [Hq] join the denominator."""
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    q = q.to(dtype)
    k = k.to(dtype).repeat_interleave(g, dim=1)
    v = v.to(dtype).repeat_interleave(g, dim=1)
    if k.shape[0] == 0:
        return torch.zeros(q.shape, dtype=dtype, device=q.device)
    s = torch.einsum("nhd,lhd->hnl", q, k) * scale
    pos = base + torch.arange(k.shape[0], device=q.device)
    qp = q_pos.to(q.device)
    allowed = pos[None, :] <= qp[:, None]
    if window:
        allowed &= pos[None, :] > qp[:, None] - window
    if chunk:
        allowed &= pos[None, :] >= (qp[:, None] // chunk) * chunk
    s = s.masked_fill(~allowed[None], float("-inf"))
    if sinks is not None:
        # The sink is one more logit per head (no value): softmax over [s, sink], drop the sink.
        sk = sinks.to(dtype).to(q.device)[:, None, None].expand(hq, s.shape[1], 1)
        p = torch.softmax(torch.cat([s, sk], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
        p = torch.nan_to_num(p, nan=0.0)  # a row with no allowed key (cannot happen unwindowed)
    return torch.einsum("hnl,lhd->nhd", p, v)


def ref_paged_decode(
    q, k_cache, v_cache, block_tables, seq_lens, scale: Optional[float] = None,
    dtype=torch.float64, window: Optional[int] = None, chunk: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
):
    """`[num_seqs, q_heads, head_dim]` in `dtype`; a zero-length sequence gives zeros. Index
    values outside the layout contract follow the bounds contract (module docstring)."""
    d = q.shape[-1]
    scale = 1.0 / d ** 0.5 if scale is None else scale
    outs = []
    lens = seq_lens.tolist()
    bs = k_cache.shape[1]
    for i, n in enumerate(lens):
        n = max(0, min(n, block_tables.shape[1] * bs))
        lo = first_key(n - 1, window, chunk)
        n, bad = bounded_length(k_cache, block_tables[i], n, lo)
        if bad is not None:  # the query (position n - 1) sees an out-of-pool block: zeros
            outs.append(torch.zeros(q.shape[1:], dtype=dtype, device=q.device))
            continue
        b0 = lo // bs
        k = _gather_from(k_cache, block_tables[i], b0, n)
        vv = _gather_from(v_cache, block_tables[i], b0, n)
        outs.append(_attend(q[i : i + 1], k, vv, scale, torch.tensor([n - 1]), dtype,
                            b0 * bs, window, chunk, sinks)[0])
    if not outs:
        return torch.empty(q.shape, dtype=dtype, device=q.device)
    return torch.stack(outs)


def ref_paged_prefill(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
    scale: Optional[float] = None, dtype=torch.float64, max_q_len: Optional[int] = None,
    window: Optional[int] = None, chunk: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
):
    """`[total_tokens, q_heads, head_dim]`: sequence i's new tokens are its last q_len positions
    and attend causally to everything up to and including themselves. Rows no sequence claims
    are zero here (the kernel leaves them untouched). Index values outside the layout contract
    follow the bounds contract (module docstring), `max_q_len` included when given."""
    d = q.shape[-1]
    scale = 1.0 / d ** 0.5 if scale is None else scale
    total = q.shape[0]
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    qsl = query_start_loc.tolist()
    bs = k_cache.shape[1]
    for i, n in enumerate(seq_lens.tolist()):
        a = max(0, min(qsl[i], total))
        b = max(a, min(qsl[i + 1], total))
        n = max(0, min(n, block_tables.shape[1] * bs))
        lo = first_key(n - (b - a), window, chunk)  # the first new row reaches least far back
        n, bad = bounded_length(k_cache, block_tables[i], n, lo)
        if b == a or n < b - a:  # no rows, or fewer tokens than new rows: zeros
            continue
        pos = torch.arange(n - (b - a), n)
        run = b - a if max_q_len is None else min(b - a, max_q_len)
        if bad is not None:  # rows at or past the first out-of-pool block's start: zeros
            run = min(run, max(0, bad - (n - (b - a))))
            n = min(n, bad)
        if run == 0:
            continue
        b0 = lo // bs
        k = _gather_from(k_cache, block_tables[i], b0, n)
        vv = _gather_from(v_cache, block_tables[i], b0, n)
        out[a : a + run] = _attend(q[a : a + run], k, vv, scale, pos[:run], dtype, b0 * bs,
                                   window, chunk, sinks)
    return out


def ref_copy_blocks(caches: Sequence[torch.Tensor], block_mapping: torch.Tensor):
    """Returns copies of `caches` with `dst <- src` applied in order (pairs with an id outside
    `[0, num_blocks)` are skipped)."""
    outs = [c.clone() for c in caches]
    nb = caches[0].shape[0]
    for src, dst in block_mapping.tolist():
        if not (0 <= src < nb and 0 <= dst < nb):
            continue
        for o, c in zip(outs, caches):
            o[dst] = c[src]
    return outs
