"""The engine's CPU attention path with local attention: sliding window, chunks and sinks.

`pagedkv_attention` reads `sliding_window` and `s_aux` from the attention module's call (as
Mistral, Qwen2, Gemma 3 and gpt-oss pass them) and the chunk size from a `"chunked_attention"`
layer's config (Llama 4). Its CPU path is compared with the float64 reference on a mixed batch
(prefills, extends, decode rows) whose blocks wholly before each window are released (-1 in the
table, NaN in the pool): they must be neither gathered nor seen.
"""

from types import SimpleNamespace

import pytest
import torch

from pagedkv.engine.attention import build_cpu_metadata, pagedkv_attention
from pagedkv.engine.forward_context import AttentionMetadata, _CURRENT
from pagedkv.kernels import reference as R

BS = 4


def _batch(seqs, kv_heads, group, d, window, chunk, gen):
    lens = [c for c, _ in seqs]
    nblk = [-(-c // BS) for c in lens]
    nb = sum(nblk) + 2
    perm = torch.randperm(nb, generator=gen)
    k = torch.full((nb, BS, kv_heads, d), float("nan"))
    v = torch.full_like(k, float("nan"))
    width = max(nblk)
    bt = torch.full((len(seqs), width), -1, dtype=torch.int32)
    pos = 0
    for i, (c, n) in enumerate(seqs):
        ids = perm[pos: pos + nblk[i]]
        pos += nblk[i]
        bt[i, : nblk[i]] = ids.int()
        for j, b in enumerate(ids.tolist()):
            cnt = min(BS, c - j * BS)
            k[b, :cnt] = torch.randn(cnt, kv_heads, d, generator=gen)
            v[b, :cnt] = torch.randn(cnt, kv_heads, d, generator=gen)
    # New tokens' K/V are written by the call: take them from the pool, then release the blocks
    # wholly before each sequence's first reachable key.
    slots, nk, nv = [], [], []
    for i, (c, n) in enumerate(seqs):
        for p in range(c - n, c):
            b = int(bt[i, p // BS])
            slots.append(b * BS + p % BS)
            nk.append(k[b, p % BS])
            nv.append(v[b, p % BS])
    for i, (c, n) in enumerate(seqs):
        lo = R.first_key(c - n, window, chunk)
        for j in range(lo // BS):
            b = int(bt[i, j])
            k[b] = float("nan")
            v[b] = float("nan")
            bt[i, j] = -1
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    return k, v, bt, lens, qsl, torch.tensor(slots), torch.stack(nk), torch.stack(nv)


@pytest.mark.parametrize("window,chunk,use_sinks", [
    (5, None, False), (5, None, True), (None, 8, False), (None, None, True), (1, None, False),
])
def test_cpu_attention_local(window, chunk, use_sinks):
    gen = torch.Generator().manual_seed(3)
    seqs = [(1, 1), (7, 7), (23, 6), (30, 1), (13, 13)]
    kvh, group, d = 2, 2, 16
    k, v, bt, lens, qsl, slots, nk, nv = _batch(seqs, kvh, group, d, window, chunk, gen)
    q = torch.randn(qsl[-1], kvh * group, d, generator=gen)
    sinks = torch.randn(kvh * group, generator=gen) if use_sinks else None
    sl = torch.tensor(lens, dtype=torch.int32)
    qs = torch.tensor(qsl, dtype=torch.int32)
    ref = R.ref_paged_prefill(q, k, v, bt, sl, qs, window=window, chunk=chunk, sinks=sinks)
    meta = AttentionMetadata(mode="cpu", k_caches=[k], v_caches=[v], slot_mapping=slots,
                             block_tables=bt, seq_lens=sl, query_start_loc=qs)
    build_cpu_metadata(meta, BS, torch.tensor([n for _, n in seqs]),
                       torch.tensor(lens, dtype=torch.int64))
    cfg = None
    if chunk:
        cfg = SimpleNamespace(layer_types=["chunked_attention"], attention_chunk_size=chunk)
    module = SimpleNamespace(layer_idx=0, config=cfg)
    kw = {}
    if window:
        kw["sliding_window"] = window
    if sinks is not None:
        kw["s_aux"] = sinks
    prev = _CURRENT.meta
    _CURRENT.meta = meta
    try:
        out, _ = pagedkv_attention(module, q.transpose(0, 1)[None], nk.transpose(0, 1)[None],
                                   nv.transpose(0, 1)[None], None, **kw)
    finally:
        _CURRENT.meta = prev
    out = out[0]
    assert torch.isfinite(out).all()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-5, err
