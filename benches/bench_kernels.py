"""GPU benchmark of the pagedkv Triton kernels against dense PyTorch baselines.

Prints a table and writes JSON (`--json PATH`). Every kernel is timed eagerly with
`triton.testing.do_bench` (median, L2 flushed before each call) and as CUDA-graph replays of a
rotation over several input copies (so the L2 cannot serve a copy from the previous call); the
graph figure is the anchor. Data is random (never zeros), block tables randomly permuted.

Usage (on a CUDA machine, from the repository root):
    PYTHONPATH=python python benches/bench_kernels.py --json out.json [--tune] [--quick]

Chosen sections (`--only ragged,anchor,host,scatter2,fp8`; benches/gpu_kernel_sections.sh runs them):
the ragged batch (heuristic, forced splits, `DecodePlan`), the anchor shapes heuristic vs plan,
host time per eager call (cached vs uncached), scatter variants, fp8 vs bf16 decode; each timed
as the targets are stated (do_bench with its L2 flush, eager and over a graph replay), as a rotation graph,
and after a read-only L2 flush (do_bench's flush leaves dirty lines to write back).

`--compare-old DIR` instead times the current decode, prefill and scatter kernels against an
older copy of the `pagedkv.kernels` package in DIR (benches/gpu_kernel_safety.sh makes one from
git), side by side in one process: each variant as a CUDA-graph replay and eagerly, through
`triton.testing.do_bench` (median, L2 flushed before every call), in rounds that alternate
the order (ABBA), after checking that both give the same output on valid inputs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import triton
import triton.testing

from pagedkv import kernels as K
from pagedkv.decode_plan import DecodePlan
from pagedkv.kernels import decode as D

DT = torch.bfloat16
RESULTS: list = []


def graph_time_us(fns, inner=None, reps=30):
    """Median per-call time (µs) of `fns` (a rotation) captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if inner is None:
        inner = max(1, 12 // len(fns))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / (inner * len(fns)))
    del g
    return statistics.median(times)


def eager_time_us(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1000.0


def dobench_graph_us(fn):
    """do_bench median (µs) over a CUDA-graph replay of one call, L2 flushed before each."""
    g = _graphed(fn)
    t = triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median") * 1000.0
    del g
    return t


def record(kind, name, **kw):
    row = {"kind": kind, "name": name, **kw}
    RESULTS.append(row)
    return row


# ---------------------------------------------------------------------------------------------
# Decode


def make_decode(batch, ctx, q_heads=32, kv_heads=8, hd=128, bs=16, copies=3, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    nb_seq = triton.cdiv(ctx, bs)
    num_blocks = batch * nb_seq
    sets = []
    for _ in range(copies):
        kc = torch.randn(num_blocks, bs, kv_heads, hd, device="cuda", dtype=DT, generator=gen)
        vc = torch.randn(num_blocks, bs, kv_heads, hd, device="cuda", dtype=DT, generator=gen)
        perm = torch.randperm(num_blocks, device="cuda", generator=gen).int()
        bt = perm.view(batch, nb_seq).contiguous()
        q = torch.randn(batch, q_heads, hd, device="cuda", dtype=DT, generator=gen)
        sets.append((q, kc, vc, bt))
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return sets, sl


def decode_batch(batch, ctx, copies=1, **kw):
    """(lens, sets, seq_lens) of a decode batch: `batch` sequences of `ctx` tokens, or the
    log-normal ragged batch of `lognormal_lens` (its own size) when `ctx` is None."""
    if ctx is None:
        lens = lognormal_lens()
        sets, sl = make_ragged(lens, copies=copies, **kw)
    else:
        lens = [ctx] * batch
        sets, sl = make_decode(batch, ctx, copies=copies, **kw)
    return lens, sets, sl


def make_prefill(nseq, q_len, prefix, q_heads=32, kv_heads=8, hd=128, bs=16, seed=1):
    """(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc) for `nseq` sequences of
    `q_len` new tokens over `prefix` cached ones each, tables randomly permuted."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    nb = triton.cdiv(prefix + q_len, bs)
    kc = torch.randn(nseq * nb, bs, kv_heads, hd, device="cuda", dtype=DT, generator=gen)
    vc = torch.randn(nseq * nb, bs, kv_heads, hd, device="cuda", dtype=DT, generator=gen)
    bt = torch.randperm(nseq * nb, device="cuda", generator=gen).int().view(nseq, nb).contiguous()
    q = torch.randn(nseq * q_len, q_heads, hd, device="cuda", dtype=DT, generator=gen)
    sl = torch.full((nseq,), prefix + q_len, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, nseq + 1, dtype=torch.int32, device="cuda") * q_len
    return q, kc, vc, bt, sl, qsl


def dense_from_paged(q, kc, vc, bt, ctx):
    """Contiguous [batch, heads, ctx, hd] K/V holding the same tokens (for SDPA)."""
    batch = q.shape[0]
    k = kc[bt.long()].reshape(batch, -1, kc.shape[2], kc.shape[3])[:, :ctx].transpose(1, 2).contiguous()
    v = vc[bt.long()].reshape(batch, -1, vc.shape[2], vc.shape[3])[:, :ctx].transpose(1, 2).contiguous()
    return q.unsqueeze(2).contiguous(), k, v


def sdpa_decode(qd, kd, vd):
    return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)


def bench_decode(shapes, tune):
    for batch, ctx in shapes:
        sets, sl = make_decode(batch, ctx)
        q0, kc0, vc0, bt0 = sets[0]
        kv_bytes = 2 * batch * ctx * kc0.shape[2] * kc0.shape[3] * kc0.element_size()
        ws = K.DecodeWorkspace(batch, q0.shape[1], kc0.shape[2], q0.shape[2], device="cuda")
        outs = [torch.empty_like(s[0]) for s in sets]

        def mk(i, **kw):
            q, kc, vc, bt = sets[i]
            return lambda: K.paged_decode(q, kc, vc, bt, sl, out=outs[i], workspace=ws, **kw)

        splits = D.choose_num_splits(batch, kc0.shape[2], bt0.shape[1] * kc0.shape[1], D.num_sms(q0.device))
        # correctness spot check against dense SDPA on the same tokens
        qd, kd, vd = dense_from_paged(q0, kc0, vc0, bt0, ctx)
        ref = sdpa_decode(qd, kd, vd).squeeze(2)
        mk(0)()
        err = ((outs[0].float() - ref.float()).norm() / ref.float().norm()).item()
        g = graph_time_us([mk(i) for i in range(len(sets))])
        e = eager_time_us(mk(0))
        row = record("decode", f"paged_decode b={batch} ctx={ctx}", batch=batch, ctx=ctx,
                     num_splits=splits, graph_us=g, eager_us=e, bytes=kv_bytes,
                     graph_tbps=kv_bytes / g / 1e6, eager_tbps=kv_bytes / e / 1e6, rel_err_vs_sdpa=err)
        del qd, kd, vd
        # dense baseline, rotated copies
        dense = [dense_from_paged(*s, ctx) for s in sets[:2]]
        gd = graph_time_us([lambda d=d: sdpa_decode(*d) for d in dense])
        ed = eager_time_us(lambda: sdpa_decode(*dense[0]))
        record("decode", f"sdpa dense b={batch} ctx={ctx}", batch=batch, ctx=ctx, graph_us=gd,
               eager_us=ed, bytes=kv_bytes, graph_tbps=kv_bytes / gd / 1e6, eager_tbps=kv_bytes / ed / 1e6)
        del dense
        print(f"decode b={batch:4d} ctx={ctx:6d} splits={splits:3d}: graph {g:8.1f} us "
              f"{kv_bytes / g / 1e6:5.2f} TB/s | eager {e:8.1f} us | sdpa graph {gd:8.1f} us "
              f"{kv_bytes / gd / 1e6:5.2f} TB/s | err {err:.2e}", flush=True)
        if tune:
            tune_decode(batch, ctx, sets, sl, ws, outs, kv_bytes, splits)
        del sets, ws, outs
        torch.cuda.empty_cache()


def tune_decode(batch, ctx, sets, sl, ws, outs, kv_bytes, heuristic):
    best = None
    cands = sorted({1, 2, 4, 8, 16, 32, 64, heuristic})
    cands = [s for s in cands if s <= max(4, 4 * heuristic) and (s == 1 or batch * s <= ws.max_seq_splits)]
    # A first sweep (TILE_N 32/64/128, 4/8 warps, 2-4 stages) found TILE_N 64 with 4 warps best
    # at every shape; keep its neighbourhood.
    cfgs = [{"TILE_N": 64, "num_warps": 4, "num_stages": st} for st in (2, 3, 4)] + [
        {"TILE_N": 128, "num_warps": 4, "num_stages": 2}
    ]
    for cfg in cfgs:
        for s in cands:
            try:
                fns = [
                    (lambda i=i: K.paged_decode(sets[i][0], sets[i][1], sets[i][2], sets[i][3], sl,
                                                out=outs[i], workspace=ws, num_splits=s, config=cfg))
                    for i in range(len(sets))
                ]
                g = graph_time_us(fns, reps=10)
            except Exception as exc:  # a config the compiler rejects (e.g. shared memory)
                print(f"  tune {cfg} splits={s}: failed {type(exc).__name__}: {str(exc)[:80]}")
                continue
            record("decode_tune", f"b={batch} ctx={ctx}", batch=batch, ctx=ctx, num_splits=s,
                   config=cfg, graph_us=g, graph_tbps=kv_bytes / g / 1e6)
            if best is None or g < best[0]:
                best = (g, cfg, s)
    if best:
        print(f"  best b={batch} ctx={ctx}: {best[0]:.1f} us {kv_bytes / best[0] / 1e6:.2f} TB/s "
              f"cfg={best[1]} splits={best[2]}", flush=True)


# ---------------------------------------------------------------------------------------------
# Prefill


def causal_pairs(q_len, ctx):
    # query i (0-based among the new tokens) sees ctx + i + 1 keys
    return q_len * ctx + q_len * (q_len + 1) // 2


def bench_prefill(tune, nseq=8, q_len=2048, prefix=2048, q_heads=32, kv_heads=8, hd=128, bs=16):
    q, kc, vc, bt, sl, qsl = make_prefill(nseq, q_len, prefix, q_heads, kv_heads, hd, bs)
    ctx = prefix + q_len
    out = torch.empty_like(q)
    flops = 4 * hd * q_heads * nseq * causal_pairs(q_len, prefix)

    def run(cfg=None):
        return K.paged_prefill(q, kc, vc, bt, sl, qsl, q_len, out=out, config=cfg)

    # Dense: same tokens, contiguous; lower-right causal alignment (query i at position prefix+i).
    kd = kc[bt.long()].reshape(nseq, -1, kv_heads, hd)[:, :ctx].transpose(1, 2).contiguous()
    vd = vc[bt.long()].reshape(nseq, -1, kv_heads, hd)[:, :ctx].transpose(1, 2).contiguous()
    qd = q.view(nseq, q_len, q_heads, hd).transpose(1, 2).contiguous()
    from torch.nn.attention.bias import causal_lower_right

    F = torch.nn.functional
    g_ = q_heads // kv_heads
    kde = kd.repeat_interleave(g_, dim=1)
    vde = vd.repeat_interleave(g_, dim=1)
    bias = causal_lower_right(q_len, ctx)

    def dense_lr():
        return F.scaled_dot_product_attention(qd, kde, vde, attn_mask=bias)

    # Square causal over the whole sequence (FlashAttention path): more work, counted as such.
    gen = torch.Generator(device="cuda").manual_seed(2)
    qsq = torch.randn(nseq, q_heads, ctx, hd, device="cuda", dtype=DT, generator=gen)
    flops_sq = 4 * hd * q_heads * nseq * causal_pairs(ctx, 0)

    def dense_sq():
        return F.scaled_dot_product_attention(qsq, kd, vd, is_causal=True, enable_gqa=True)

    run()
    ref = dense_lr().transpose(1, 2).reshape(nseq * q_len, q_heads, hd)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    for name, fn, fl in (("paged_prefill", run, flops), ("sdpa lower-right causal", dense_lr, flops),
                         ("sdpa square causal (FA)", dense_sq, flops_sq)):
        g = graph_time_us([fn], inner=5, reps=15)
        e = eager_time_us(fn)
        record("prefill", name, graph_us=g, eager_us=e, flops=fl, graph_tflops=fl / g / 1e6,
               eager_tflops=fl / e / 1e6, **({"rel_err_vs_sdpa": err} if fn is run else {}))
        print(f"prefill {name:26s}: graph {g:9.1f} us {fl / g / 1e6:6.1f} TFLOP/s | eager {e:9.1f} us "
              f"{fl / e / 1e6:6.1f} TFLOP/s" + (f" | err {err:.2e}" if fn is run else ""), flush=True)
    if tune:
        best = None
        # Earlier sweeps (docs/kernels.md) settled on packed 256x128, 8 warps, 2 stages; recheck
        # its neighbourhood.
        for pack, bm, bn, w, st in [
            (True, 256, 64, 8, 3), (True, 256, 64, 8, 2), (True, 256, 32, 8, 3),
            (True, 256, 128, 8, 2), (True, 128, 128, 8, 3), (False, 256, 64, 8, 3),
        ]:
            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st, "PACK_GQA": pack}
            try:
                g = graph_time_us([lambda cfg=cfg: run(cfg)], inner=3, reps=8)
            except Exception as exc:
                print(f"  tune {cfg}: failed {type(exc).__name__}: {str(exc)[:80]}")
                continue
            record("prefill_tune", "paged_prefill", config=cfg, graph_us=g, graph_tflops=flops / g / 1e6)
            print(f"  tune {cfg}: {g:.1f} us {flops / g / 1e6:.1f} TFLOP/s", flush=True)
            if best is None or g < best[0]:
                best = (g, cfg)
        print(f"  best prefill: {best}", flush=True)


# ---------------------------------------------------------------------------------------------
# Scatter, copy, swap


def bench_scatter(kv_heads=8, hd=128, bs=16, num_blocks=8192):
    gen = torch.Generator(device="cuda").manual_seed(2)
    kc = torch.randn(num_blocks, bs, kv_heads, hd, device="cuda", dtype=DT, generator=gen)
    vc = torch.randn_like(kc)
    for n in (256, 8192):
        sets = []
        for _ in range(4):
            key = torch.randn(n, kv_heads, hd, device="cuda", dtype=DT, generator=gen)
            val = torch.randn(n, kv_heads, hd, device="cuda", dtype=DT, generator=gen)
            slots = torch.randperm(num_blocks * bs, device="cuda", generator=gen)[:n]
            sets.append((key, val, slots))
        nbytes = 2 * 2 * n * kv_heads * hd * 2 + n * 8  # K and V read + written, slots read
        fns = [lambda s=s: K.scatter_kv(s[0], s[1], kc, vc, s[2]) for s in sets]
        g = graph_time_us(fns, reps=30)
        e = eager_time_us(fns[0])
        record("scatter", f"scatter_kv n={n}", tokens=n, graph_us=g, eager_us=e, bytes=nbytes,
               graph_tbps=nbytes / g / 1e6, eager_tbps=nbytes / e / 1e6)
        print(f"scatter n={n:5d}: graph {g:7.2f} us {nbytes / g / 1e6:5.2f} TB/s | eager {e:7.2f} us "
              f"{nbytes / e / 1e6:5.2f} TB/s", flush=True)


def bench_copy(layers=32, kv_heads=8, hd=128, bs=16, num_blocks=2304, npairs=1024):
    gen = torch.Generator(device="cuda").manual_seed(3)
    kv = torch.randn(layers, 2, num_blocks, bs, kv_heads, hd, device="cuda", dtype=DT, generator=gen)
    caches = [kv[l, i] for l in range(layers) for i in range(2)]
    copier = K.BlockCopier(caches)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen)
    pairs = torch.stack([perm[:npairs], perm[npairs : 2 * npairs]], dim=1).contiguous()
    nbytes = 2 * npairs * 2 * layers * bs * kv_heads * hd * 2
    raw = kv.view(torch.uint8)
    src, dst = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()

    def torch_index():
        raw[:, :, dst] = raw[:, :, src]

    copier(pairs)
    ref = kv.clone()
    torch_index()
    assert torch.equal(kv, ref)
    for name, fn in (("BlockCopier (triton)", lambda: copier(pairs)), ("torch advanced indexing", torch_index)):
        g = graph_time_us([fn], inner=3, reps=15)
        e = eager_time_us(fn)
        record("copy", name, pairs=npairs, layers=layers, graph_us=g, eager_us=e, bytes=nbytes,
               graph_tbps=nbytes / g / 1e6, eager_tbps=nbytes / e / 1e6)
        print(f"copy {npairs} blocks x {layers} layers {name:24s}: graph {g:8.1f} us "
              f"{nbytes / g / 1e6:5.2f} TB/s | eager {e:8.1f} us", flush=True)
    # device copy ceiling: one large contiguous copy, bytes read + written
    a = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    e = eager_time_us(lambda: b.copy_(a))
    record("ceiling", "device copy 2 GiB", eager_us=e, eager_tbps=2 * a.numel() / e / 1e6)
    print(f"device copy 2 GiB: {e:.1f} us {2 * a.numel() / e / 1e6:.2f} TB/s", flush=True)
    del a, b
    # swap out and in of 256 blocks of every layer to a pinned host pool
    n = 256
    host = [torch.empty(n, bs, kv_heads, hd, dtype=DT, pin_memory=True) for _ in caches]
    staging = torch.empty(n * bs * kv_heads * hd * 2, dtype=torch.uint8, pin_memory=True)
    out_map = torch.stack([perm[:n].cpu(), torch.arange(n)], dim=1).contiguous()
    in_map = torch.stack([torch.arange(n), perm[n : 2 * n].cpu()], dim=1).contiguous()
    sbytes = n * len(caches) * bs * kv_heads * hd * 2
    import time

    for method in ("kernel", "torch"):
        for name, args in (("swap out (D2H)", (caches, host, out_map)), ("swap in (H2D)", (host, caches, in_map))):
            name = f"{name} {method}"
            try:
                K.swap_blocks(*args, staging=staging, method=method)
            except Exception as exc:
                print(f"{name}: failed {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                K.swap_blocks(*args, staging=staging, method=method)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            t = statistics.median(ts)
            record("swap", name, blocks=n, layers=layers, wall_s=t, bytes=sbytes, gbps=sbytes / t / 1e9)
            print(f"{name} {n} blocks x {len(caches)} tensors ({sbytes / 1e6:.0f} MB): {t * 1e3:.2f} ms "
                  f"{sbytes / t / 1e9:.1f} GB/s", flush=True)
    # the swap round trip must restore the bytes
    back = [torch.empty_like(c) for c in caches[:2]]
    K.swap_blocks(caches[:2], host[:2], out_map)
    K.swap_blocks(host[:2], back, torch.stack([torch.arange(n), perm[:n].cpu()], dim=1).contiguous())
    idx = perm[:n]
    assert all(torch.equal(b[idx], c[idx]) for b, c in zip(back, caches[:2])), "swap round trip"
    a = torch.empty(sbytes, dtype=torch.uint8, device="cuda")
    h = torch.empty(sbytes, dtype=torch.uint8, pin_memory=True)
    for name, fn in (("plain D2H copy", lambda: h.copy_(a)), ("plain H2D copy", lambda: a.copy_(h))):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        t = statistics.median(ts)
        record("swap", name, wall_s=t, bytes=sbytes, gbps=sbytes / t / 1e9)
        print(f"{name} ({sbytes / 1e6:.0f} MB): {t * 1e3:.2f} ms {sbytes / t / 1e9:.1f} GB/s", flush=True)


# ---------------------------------------------------------------------------------------------
# Round 2: the issue's method (do_bench with the L2 flush, eager and graph replay), the ragged
# planner, host cost per eager call, scatter variants, and what the flush itself costs.


def flushed_us(fn, flush="write", reps=60):
    """Median µs of `fn` with the L2 flushed before every call, timed with events around the call
    only. flush="write" zeroes a 256 MB buffer (triton.testing.do_bench's flush: it leaves the
    L2 full of dirty lines that the next kernel must write back); "read" reads the same buffer
    (a sum), which evicts the L2 but leaves clean lines."""
    buf = _FLUSH.setdefault("buf", torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32,
                                               device="cuda"))
    fl = buf.zero_ if flush == "write" else (lambda: buf.sum(dtype=torch.int64))
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    st = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        fl()
        st[i].record()
        fn()
        en[i].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1000.0 for a, b in zip(st, en))


_FLUSH: dict = {}


def issue_times(fn, rotation=None):
    """The issue's figures for one callable: do_bench eager and do_bench over a graph replay (both
    with do_bench's L2 flush), plus the rotation-graph anchor figure and a read-flush figure."""
    g = _graphed(fn)
    row = {
        "dobench_eager_us": eager_time_us(fn),
        "dobench_graph_us": triton.testing.do_bench(g.replay, warmup=25, rep=100,
                                                    return_mode="median") * 1000.0,
        "readflush_graph_us": flushed_us(g.replay, "read"),
    }
    if rotation is not None:
        row["graph_us"] = graph_time_us(rotation)
    del g
    return row


def lognormal_lens(n=128, seed=0, lo=31, hi=15380, mu=6.7, sigma=1.25):
    import numpy as np

    rng = np.random.default_rng(seed)
    lens = np.clip(rng.lognormal(mu, sigma, n).astype(np.int64), lo, hi)
    lens[0], lens[1] = lo, hi  # pin the range the issue quotes: 31 to 15,380 tokens
    return [int(x) for x in lens]


def make_ragged(lens, q_heads=32, kv_heads=8, hd=128, bs=16, copies=3, seed=0, dtype=DT):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    nblk = [triton.cdiv(n, bs) for n in lens]
    width = max(nblk)
    num_blocks = sum(nblk)
    sets = []
    for _ in range(copies):
        kc = torch.randn(num_blocks, bs, kv_heads, hd, device="cuda", dtype=torch.bfloat16,
                         generator=gen).to(dtype)
        vc = torch.randn(num_blocks, bs, kv_heads, hd, device="cuda", dtype=torch.bfloat16,
                         generator=gen).to(dtype)
        perm = torch.randperm(num_blocks, device="cuda", generator=gen).int()
        bt = torch.zeros(len(lens), width, dtype=torch.int32, device="cuda")
        pos = 0
        for i, nb in enumerate(nblk):
            bt[i, :nb] = perm[pos:pos + nb]
            pos += nb
        q = torch.randn(len(lens), q_heads, hd, device="cuda", dtype=torch.bfloat16,
                        generator=gen)
        sets.append((q, kc, vc, bt))
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return sets, sl


def sdpa_ref_ragged(q, kc, vc, bt, lens):
    """Per-sequence dense SDPA on the same tokens (correctness reference, not timed)."""
    outs = []
    bs = kc.shape[1]
    for i, n in enumerate(lens):
        nb = triton.cdiv(n, bs)
        ids = bt[i, :nb].long()
        k = kc[ids].reshape(-1, kc.shape[2], kc.shape[3])[:n].transpose(0, 1)[None]
        v = vc[ids].reshape(-1, vc.shape[2], vc.shape[3])[:n].transpose(0, 1)[None]
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[i:i + 1, :, None].float(), k.float(), v.float(), enable_gqa=True)[0, :, 0])
    return torch.stack(outs)


def bench_ragged(programs_per_sm=(2, 4, 8, 16)):  # noqa: C901
    import time

    import numpy as np

    lens = lognormal_lens()
    sets, sl = make_ragged(lens)
    q0, kc0, vc0, bt0 = sets[0]
    H = kc0.shape[2]
    total = sum(lens)
    kv_bytes = 2 * total * H * kc0.shape[3] * kc0.element_size()
    sms = D.num_sms(q0.device)
    print(f"ragged batch: {len(lens)} seqs, lens {min(lens)}..{max(lens)}, total {total}, "
          f"median {int(np.median(lens))}, KV {kv_bytes / 1e6:.0f} MB", flush=True)
    ref = sdpa_ref_ragged(q0, kc0, vc0, bt0, lens)
    outs = [torch.empty_like(s[0]) for s in sets]
    ws = K.DecodeWorkspace(len(lens), q0.shape[1], H, q0.shape[2], device="cuda")
    variants = [("heuristic", {}), ("8 splits", {"num_splits": 8})]
    plans = {}
    for pps in programs_per_sm:
        pl = DecodePlan(len(lens), q0.shape[1], H, q0.shape[2], device="cuda",
                          programs=pps * sms)
        pl.update(lens)
        plans[pps] = pl
        variants.append((f"plan {pps}/SM", {"plan": pl}))
    for name, kw in variants:
        extra = {} if "plan" in kw else {"workspace": ws}
        if kw.get("num_splits"):
            extra = {"workspace": K.DecodeWorkspace(len(lens), q0.shape[1], H, q0.shape[2],
                                                    device="cuda", capacity=len(lens) * 8)}

        def mk(i, kw=kw, extra=extra):
            q, kc, vc, bt = sets[i]
            return lambda: K.paged_decode(q, kc, vc, bt, sl, out=outs[i], **kw, **extra)

        mk(0)()
        err = ((outs[0].float() - ref).norm() / ref.norm()).item()
        t = issue_times(mk(0), [mk(i) for i in range(len(sets))])
        info = {}
        if "plan" in kw:
            pl = kw["plan"]
            info = {"chunk": pl.chunk, "items": pl.num_items, "capacity": pl.capacity}
        record("ragged", f"paged_decode {name}", lens_min=min(lens), lens_max=max(lens),
               total_tokens=total, bytes=kv_bytes, rel_err_vs_sdpa=err, **info, **t,
               dobench_graph_tbps=kv_bytes / t["dobench_graph_us"] / 1e6)
        print(f"ragged {name:14s}: do_bench graph {t['dobench_graph_us']:7.1f} us "
              f"({kv_bytes / t['dobench_graph_us'] / 1e6:4.2f} TB/s) eager "
              f"{t['dobench_eager_us']:7.1f} | rotation graph {t['graph_us']:7.1f} | read-flush "
              f"{t['readflush_graph_us']:7.1f} | err {err:.1e} {info}", flush=True)
    # Host cost of planning one step (numpy + one H2D copy).
    pl = plans[4 if 4 in plans else programs_per_sm[0]]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        pl.update(lens)
    dt = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    record("host", "DecodePlan.update (128 seqs)", host_us=dt)
    print(f"DecodePlan.update 128 seqs: {dt:.1f} us host", flush=True)
    del sets, ws, outs, plans
    torch.cuda.empty_cache()


def bench_anchor_plan(shapes, pps=4):
    """The anchor decode shapes: heuristic vs planner, the issue's measure."""
    for batch, ctx in shapes:
        sets, sl = make_decode(batch, ctx)
        q0, kc0, vc0, bt0 = sets[0]
        kv_bytes = 2 * batch * ctx * kc0.shape[2] * kc0.shape[3] * kc0.element_size()
        ws = K.DecodeWorkspace(batch, q0.shape[1], kc0.shape[2], q0.shape[2], device="cuda")
        pl = DecodePlan(batch, q0.shape[1], kc0.shape[2], q0.shape[2], device="cuda",
                          programs=pps * D.num_sms(q0.device))
        pl.update([ctx] * batch)
        outs = [torch.empty_like(s[0]) for s in sets]
        for name, kw in (("heuristic", {"workspace": ws}), (f"plan {pps}/SM", {"plan": pl})):
            def mk(i, kw=kw):
                q, kc, vc, bt = sets[i]
                return lambda: K.paged_decode(q, kc, vc, bt, sl, out=outs[i], **kw)

            t = issue_times(mk(0), [mk(i) for i in range(len(sets))])
            record("decode_r2", f"paged_decode {name} b={batch} ctx={ctx}", batch=batch, ctx=ctx,
                   bytes=kv_bytes, chunk=pl.chunk, items=pl.num_items, **t)
            print(f"decode b={batch:4d} ctx={ctx:6d} {name:10s}: do_bench graph "
                  f"{t['dobench_graph_us']:7.1f} us ({kv_bytes / t['dobench_graph_us'] / 1e6:4.2f} "
                  f"TB/s) eager {t['dobench_eager_us']:7.1f} | rotation {t['graph_us']:7.1f} | "
                  f"read-flush {t['readflush_graph_us']:7.1f}", flush=True)
        del sets, ws, outs, pl
        torch.cuda.empty_cache()


def host_us(fn, n=300, clear=None):
    """Host time per call (µs): perf_counter around n calls, no synchronization inside, the GPU
    drained first so the launch queue never fills. `clear` runs before each call (untimed
    work is not possible without a sync, so it is timed separately and subtracted)."""
    import time

    fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            if clear is not None:
                clear()
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        c = 0.0
        if clear is not None:
            t2 = time.perf_counter()
            for _ in range(n):
                clear()
            c = time.perf_counter() - t2
        best.append((t1 - t0 - c) / n * 1e6)
    return statistics.median(best)


def bench_host():
    from pagedkv.kernels import prefill as P
    from pagedkv.kernels import scatter as S

    cases = []
    for batch, ctx in ((1, 32768), (64, 4096)):
        sets, sl = make_decode(batch, ctx, copies=1)
        q, kc, vc, bt = sets[0]
        ws = K.DecodeWorkspace(batch, q.shape[1], kc.shape[2], q.shape[2], device="cuda")
        out = torch.empty_like(q)
        cases.append((f"paged_decode b={batch} ctx={ctx} (workspace, out)", D._CACHE,
                      lambda q=q, kc=kc, vc=vc, bt=bt, sl=sl, ws=ws, out=out:
                      K.paged_decode(q, kc, vc, bt, sl, out=out, workspace=ws)))
        cases.append((f"paged_decode b={batch} ctx={ctx} (no out)", D._CACHE,
                      lambda q=q, kc=kc, vc=vc, bt=bt, sl=sl, ws=ws:
                      K.paged_decode(q, kc, vc, bt, sl, workspace=ws, max_seq_len=ctx)))
    lens = lognormal_lens()
    rs, rsl = make_ragged(lens, copies=1)
    q, kc, vc, bt = rs[0]
    pl = DecodePlan(len(lens), q.shape[1], kc.shape[2], q.shape[2], device="cuda").update(lens)
    rout = torch.empty_like(q)
    cases.append(("paged_decode ragged 128 (plan, out)", D._CACHE,
                  lambda q=q, kc=kc, vc=vc, bt=bt: K.paged_decode(q, kc, vc, bt, rsl, out=rout,
                                                                  plan=pl)))
    gen = torch.Generator(device="cuda").manual_seed(2)
    skc = torch.randn(8192, 16, 8, 128, device="cuda", dtype=DT, generator=gen)
    svc = torch.randn_like(skc)
    for n in (256, 8192):
        key = torch.randn(n, 8, 128, device="cuda", dtype=DT, generator=gen)
        val = torch.randn_like(key)
        slots = torch.randperm(8192 * 16, device="cuda", generator=gen)[:n]
        cases.append((f"scatter_kv n={n}", S._CACHE,
                      lambda key=key, val=val, slots=slots: K.scatter_kv(key, val, skc, svc, slots)))
    ql = 512
    pq, pkc, pvc, pbt, psl, pqsl = make_prefill(4, ql, 1024)
    pout = torch.empty_like(pq)
    cases.append(("paged_prefill 4x512 on 1024 (out)", P._CACHE,
                  lambda: K.paged_prefill(pq, pkc, pvc, pbt, psl, pqsl, ql, out=pout)))
    # Floors on this host: a one-element torch kernel launch, and the cached decode launch
    # alone (no signature key), for the 64 x 4096 call above.
    small = torch.zeros(1, device="cuda")
    floor = host_us(lambda: small.add_(1.0))
    record("host", "torch small.add_ (launch floor)", host_us=floor)
    print(f"host torch small.add_(1) launch floor: {floor:6.1f} us", flush=True)
    sets, sl = make_decode(64, 4096, copies=1)
    q, kc, vc, bt = sets[0]
    out = torch.empty_like(q)
    K.paged_decode(q, kc, vc, bt, sl, out=out)
    call = next(c for c in D._CACHE._d.values() if c.num_seqs == 64)
    raw = host_us(lambda: call.main(call.grid, q, kc, vc, bt, sl, out, out, out, sl, sl, sl))
    record("host", "cached decode launch without the key (64 x 4096)", host_us=raw)
    print(f"host cached decode launch alone (no key): {raw:6.1f} us", flush=True)
    for name, cache, fn in cases:
        cached = host_us(fn)
        uncached = host_us(fn, clear=cache.clear)
        record("host", name, host_us=cached, host_us_uncached=uncached)
        print(f"host {name:44s}: cached {cached:6.1f} us | uncached (checks + JIT launch, as "
              f"before) {uncached:6.1f} us", flush=True)


def bench_scatter_variants(kv_heads=8, hd=128, bs=16, num_blocks=8192):
    gen = torch.Generator(device="cuda").manual_seed(2)
    kc = torch.randn(num_blocks, bs, kv_heads, hd, device="cuda", dtype=DT, generator=gen)
    vc = torch.randn_like(kc)
    n = 8192
    sets = []
    for _ in range(4):
        key = torch.randn(n, kv_heads, hd, device="cuda", dtype=DT, generator=gen)
        val = torch.randn(n, kv_heads, hd, device="cuda", dtype=DT, generator=gen)
        slots = torch.randperm(num_blocks * bs, device="cuda", generator=gen)[:n]
        sets.append((key, val, slots))
    nbytes = 2 * 2 * n * kv_heads * hd * 2 + n * 8
    cfgs = [None, {"ELEMS": 2048}, {"ELEMS": 8192, "num_warps": 8}, {"ELEMS": 8192},
            {"ELEMS": 16384, "num_warps": 8}, {"STREAM": True},
            {"ELEMS": 8192, "num_warps": 8, "STREAM": True}]
    for cfg in cfgs:
        fns = [lambda s=s, cfg=cfg: K.scatter_kv(s[0], s[1], kc, vc, s[2], config=cfg)
               for s in sets]
        t = issue_times(fns[0], fns)
        t["writeflush_graph_us"] = t["dobench_graph_us"]
        record("scatter_r2", f"scatter_kv n={n} {cfg}", tokens=n, bytes=nbytes, config=cfg, **t)
        print(f"scatter {str(cfg):44s}: do_bench graph {t['dobench_graph_us']:6.2f} us "
              f"({nbytes / t['dobench_graph_us'] / 1e6:4.2f} TB/s) eager {t['dobench_eager_us']:6.2f}"
              f" | rotation {t['graph_us']:6.2f} ({nbytes / t['graph_us'] / 1e6:4.2f}) | "
              f"read-flush {t['readflush_graph_us']:6.2f} ({nbytes / t['readflush_graph_us'] / 1e6:4.2f})",
              flush=True)
    # The ceiling under the same method: a 67 MB device copy after each flush.
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = issue_times(lambda: b.copy_(a))
    record("scatter_r2", "device copy, same bytes", bytes=nbytes, **t)
    print(f"copy of the same bytes: do_bench graph {t['dobench_graph_us']:6.2f} us "
          f"({nbytes / t['dobench_graph_us'] / 1e6:4.2f} TB/s) | read-flush "
          f"{t['readflush_graph_us']:6.2f} ({nbytes / t['readflush_graph_us'] / 1e6:4.2f})",
          flush=True)


def bench_fp8(shapes, pps=4):
    """bf16 against fp8 (e4m3, per-kv-head scales) decode on the same tokens (issue's measure)."""
    FP8 = torch.float8_e4m3fn
    for batch, ctx in shapes:
        sets, sl = make_decode(batch, ctx, copies=3)
        q0, kc0, vc0, bt0 = sets[0]
        H = kc0.shape[2]
        # K and V bytes of the context at one byte per element (fp8); bf16 moves twice that.
        fp8_bytes = 2 * batch * ctx * H * kc0.shape[3]
        ws = K.DecodeWorkspace(batch, q0.shape[1], H, q0.shape[2], device="cuda")
        q8 = []
        for q, kc, vc, bt in sets:
            ks = (kc.float().abs().amax(dim=(0, 1, 3)) / 448.0).contiguous()
            vs = (vc.float().abs().amax(dim=(0, 1, 3)) / 448.0).contiguous()
            k8 = (kc.float() / ks.view(1, 1, H, 1)).clamp(-448, 448).to(FP8)
            v8 = (vc.float() / vs.view(1, 1, H, 1)).clamp(-448, 448).to(FP8)
            q8.append((q, k8, v8, bt, ks, vs))
        outs = [torch.empty_like(s[0]) for s in sets]
        outs8 = [torch.empty_like(s[0]) for s in sets]

        def mk(i):
            q, kc, vc, bt = sets[i]
            return lambda: K.paged_decode(q, kc, vc, bt, sl, out=outs[i], workspace=ws)

        def mk8(i):
            q, k8, v8, bt, ks, vs = q8[i]
            return lambda: K.paged_decode(q, k8, v8, bt, sl, out=outs8[i], workspace=ws,
                                          k_scale=ks, v_scale=vs)

        mk(0)()
        mk8(0)()
        err = ((outs8[0].float() - outs[0].float()).norm() / outs[0].float().norm()).item()
        t16 = issue_times(mk(0), [mk(i) for i in range(3)])
        t8 = issue_times(mk8(0), [mk8(i) for i in range(3)])
        for name, t, nb in (("bf16", t16, 2 * fp8_bytes), ("fp8", t8, fp8_bytes)):
            record("fp8", f"paged_decode {name} b={batch} ctx={ctx}", batch=batch, ctx=ctx,
                   bytes=nb, **t, **({"rel_err_vs_bf16": err} if name == "fp8" else {}))
        print(f"fp8 decode b={batch:4d} ctx={ctx:6d}: bf16 {t16['dobench_graph_us']:7.1f} us | fp8 "
              f"{t8['dobench_graph_us']:7.1f} us | speedup {t16['dobench_graph_us'] / t8['dobench_graph_us']:4.2f}x"
              f" (rotation {t16['graph_us'] / t8['graph_us']:4.2f}x, fp8 {fp8_bytes / t8['graph_us'] / 1e6:4.2f} TB/s)"
              f" | fp8 vs bf16 rel err {err:.2e}", flush=True)
        if batch == 128:
            # fp8 tiles carry half the bytes: does a longer tile or a deeper pipeline pay?
            for cfg in ({"FP8_COMPUTE": "q"}, {"TILE_N": 64, "num_stages": 3},
                        {"TILE_N": 64, "num_stages": 3, "FP8_COMPUTE": "q"},
                        {"TILE_N": 128, "num_stages": 3},
                        {"SWAP_AB": True}, {"SWAP_AB": True, "num_stages": 3},
                        {"SWAP_AB": True, "TILE_N": 64, "num_stages": 3},
                        {"SWAP_AB": True, "TILE_N": 256, "num_warps": 8}):
                q, k8, v8, bt, ks, vs = q8[0]
                try:
                    fn = (lambda cfg=cfg: K.paged_decode(q, k8, v8, bt, sl, out=outs8[1],
                                                         workspace=ws, k_scale=ks, v_scale=vs,
                                                         config=cfg))
                    fn()
                    e2 = ((outs8[1].float() - outs[0].float()).norm()
                          / outs[0].float().norm()).item()
                    tt = dobench_graph_us(fn)
                except Exception as exc:
                    print(f"  fp8 tune {cfg}: failed {type(exc).__name__}: {str(exc)[:80]}")
                    continue
                record("fp8_tune", f"b={batch} ctx={ctx}", config=cfg, dobench_graph_us=tt,
                       rel_err_vs_bf16=e2)
                print(f"  fp8 tune {cfg}: do_bench graph {tt:7.1f} us, err {e2:.2e}", flush=True)
            # The transposed products on the 16-bit cache, for comparison.
            q, kc, vc, bt = sets[0]
            for cfg in ({"SWAP_AB": True}, {"SWAP_AB": True, "TILE_N": 128, "num_stages": 2}):
                fn = (lambda cfg=cfg: K.paged_decode(q, kc, vc, bt, sl, out=outs[1],
                                                     workspace=ws, config=cfg))
                fn()
                e2 = ((outs[1].float() - outs[0].float()).norm() / outs[0].float().norm()).item()
                tt = dobench_graph_us(fn)
                record("bf16_tune", f"b={batch} ctx={ctx}", config=cfg, dobench_graph_us=tt,
                       rel_err_vs_default=e2)
                print(f"  bf16 tune {cfg}: do_bench graph {tt:7.1f} us, err {e2:.2e}", flush=True)
        del sets, q8, outs, outs8, ws
        torch.cuda.empty_cache()
    # Quantizing scatter: 8192 tokens into an fp8 pool (reads 2 B, writes 1 B per element).
    gen = torch.Generator(device="cuda").manual_seed(2)
    kc = torch.zeros(8192, 16, 8, 128, device="cuda", dtype=FP8)
    vc = torch.zeros_like(kc)
    ks = torch.full((8,), 0.02, device="cuda")
    sets = []
    for _ in range(4):
        key = torch.randn(8192, 8, 128, device="cuda", dtype=DT, generator=gen)
        val = torch.randn_like(key)
        slots = torch.randperm(8192 * 16, device="cuda", generator=gen)[:8192]
        sets.append((key, val, slots))
    nbytes = 2 * 8192 * 8 * 128 * (2 + 1) + 8192 * 8
    fns = [lambda s=s: K.scatter_kv(s[0], s[1], kc, vc, s[2], k_scale=ks, v_scale=ks) for s in sets]
    t = issue_times(fns[0], fns)
    record("fp8", "scatter_kv fp8 n=8192", bytes=nbytes, **t)
    print(f"fp8 scatter n=8192: do_bench graph {t['dobench_graph_us']:6.2f} us "
          f"({nbytes / t['dobench_graph_us'] / 1e6:4.2f} TB/s) | rotation {t['graph_us']:6.2f}", flush=True)


# ---------------------------------------------------------------------------------------------
# Old kernels against current ones (bounds checks), side by side


def load_old_kernels(path):
    """Imports the kernel package copy in `path` under the name `_old_kernels`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_old_kernels", os.path.join(path, "__init__.py"), submodule_search_locations=[path]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_old_kernels"] = mod
    spec.loader.exec_module(mod)
    return mod


def _graphed(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def _bench_ms(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def ab_time(kind, name, old_fn, new_fn, rounds=4, **meta):
    """Medians (µs) of old and new, graph-replayed and eager, alternating ABBA over `rounds`."""
    graphs = {"old": _graphed(old_fn), "new": _graphed(new_fn)}
    eager = {"old": old_fn, "new": new_fn}
    t = {(v, m): [] for v in ("old", "new") for m in ("graph", "eager")}
    for r in range(rounds):
        for v in (("old", "new") if r % 2 == 0 else ("new", "old")):
            t[(v, "graph")].append(_bench_ms(graphs[v].replay) * 1e3)
            t[(v, "eager")].append(_bench_ms(eager[v]) * 1e3)
    row = {"rounds": rounds, **meta}
    for m in ("graph", "eager"):
        o = statistics.median(t[("old", m)])
        n = statistics.median(t[("new", m)])
        per_round = [b / a for a, b in zip(t[("old", m)], t[("new", m)])]
        row.update({f"{m}_old_us": o, f"{m}_new_us": n, f"{m}_ratio": n / o,
                    f"{m}_ratio_min": min(per_round), f"{m}_ratio_max": max(per_round),
                    f"{m}_old_all": t[("old", m)], f"{m}_new_all": t[("new", m)]})
    del graphs
    rec = record(kind, name, **row)
    print(f"{kind:7s} {name:34s} graph {row['graph_old_us']:9.2f} -> {row['graph_new_us']:9.2f} us "
          f"x{row['graph_ratio']:.4f} [{row['graph_ratio_min']:.3f}, {row['graph_ratio_max']:.3f}] | "
          f"eager {row['eager_old_us']:9.2f} -> {row['eager_new_us']:9.2f} us x{row['eager_ratio']:.4f}",
          flush=True)
    return rec


def compare_old(old, what=("decode", "prefill", "scatter")):
    # Decode: the five benchmark shapes.
    for batch, ctx in [(1, 32768), (8, 8192), (64, 4096), (128, 2048), (256, 1024)] * ("decode" in what):
        sets, sl = make_decode(batch, ctx, copies=1)
        q, kc, vc, bt = sets[0]
        ws_new = K.DecodeWorkspace(batch, q.shape[1], kc.shape[2], q.shape[2], device="cuda")
        ws_old = old.DecodeWorkspace(batch, q.shape[1], kc.shape[2], q.shape[2], device="cuda")
        o_new, o_old = torch.empty_like(q), torch.empty_like(q)
        new_fn = lambda: K.paged_decode(q, kc, vc, bt, sl, out=o_new, workspace=ws_new)  # noqa: E731
        old_fn = lambda: old.paged_decode(q, kc, vc, bt, sl, out=o_old, workspace=ws_old)  # noqa: E731
        new_fn()
        old_fn()
        same = bool(torch.equal(o_new, o_old))
        splits = D.choose_num_splits(batch, kc.shape[2], bt.shape[1] * kc.shape[1], D.num_sms(q.device))
        if not same:
            print(f"  decode b={batch} ctx={ctx}: outputs differ, max |diff| "
                  f"{(o_new.float() - o_old.float()).abs().max().item():.3e}", flush=True)
        ab_time("decode", f"paged_decode b={batch} ctx={ctx}", old_fn, new_fn,
                batch=batch, ctx=ctx, num_splits=splits, identical_output=same)
        del sets, ws_new, ws_old
        torch.cuda.empty_cache()
    # Prefill: the benchmark shape, and a short chunk on a long cached prefix (mostly the
    # unmasked key loop; its programs also scan the longest block-table rows for bad ids).
    for nseq, q_len, prefix in [(8, 2048, 2048), (2, 512, 15872)] * ("prefill" in what):
        q, kc, vc, bt, sl, qsl = make_prefill(nseq, q_len, prefix)
        o_new, o_old = torch.empty_like(q), torch.empty_like(q)
        new_fn = lambda: K.paged_prefill(q, kc, vc, bt, sl, qsl, q_len, out=o_new)  # noqa: E731
        old_fn = lambda: old.paged_prefill(q, kc, vc, bt, sl, qsl, q_len, out=o_old)  # noqa: E731
        new_fn()
        old_fn()
        same = bool(torch.equal(o_new, o_old))
        if not same:
            print(f"  prefill {nseq}x{q_len}+{prefix}: outputs differ, max |diff| "
                  f"{(o_new.float() - o_old.float()).abs().max().item():.3e}", flush=True)
        ab_time("prefill", f"paged_prefill {nseq}x{q_len} on {prefix}", old_fn, new_fn, rounds=4,
                nseq=nseq, q_len=q_len, prefix=prefix, identical_output=same)
        del kc, vc, q, o_new, o_old
        torch.cuda.empty_cache()
    # Scatter (the kernel is unchanged: the pair measures the noise floor of the method).
    gen = torch.Generator(device="cuda").manual_seed(2)
    kc = torch.randn(8192, 16, 8, 128, device="cuda", dtype=DT, generator=gen)
    vc = torch.randn_like(kc)
    for n in (256, 8192) * ("scatter" in what):
        key = torch.randn(n, 8, 128, device="cuda", dtype=DT, generator=gen)
        val = torch.randn_like(key)
        slots = torch.randperm(8192 * 16, device="cuda", generator=gen)[:n]
        ab_time("scatter", f"scatter_kv n={n}",
                lambda: old.scatter_kv(key, val, kc, vc, slots),
                lambda: K.scatter_kv(key, val, kc, vc, slots), tokens=n)
    print()
    print(f"{'kind':8s} {'name':34s} {'graph old':>10s} {'graph new':>10s} {'ratio':>7s} "
          f"{'eager old':>10s} {'eager new':>10s} {'ratio':>7s}")
    for r in RESULTS:
        print(f"{r['kind']:8s} {r['name']:34s} {r['graph_old_us']:10.2f} {r['graph_new_us']:10.2f} "
              f"{r['graph_ratio']:7.4f} {r['eager_old_us']:10.2f} {r['eager_new_us']:10.2f} "
              f"{r['eager_ratio']:7.4f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--plan-pps", default="2,4,8,16",
                    help="planner programs per SM the ragged section compares")
    ap.add_argument("--tune", action="store_true", help="also sweep decode/prefill launch configs")
    ap.add_argument("--tune-what", default="decode,prefill", help="which sweeps --tune runs")
    ap.add_argument("--only", default="decode,prefill,scatter,copy",
                    help="any of decode,prefill,scatter,copy and the round-2 sections "
                         "ragged,anchor,host,scatter2,fp8")
    ap.add_argument("--compare-old", default=None, metavar="DIR",
                    help="time the kernels against an older copy of the package in DIR")
    ap.add_argument("--compare-what", default="decode,prefill,scatter",
                    help="which kernels --compare-old times")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    meta = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "argv": sys.argv}
    print(meta, flush=True)
    if args.compare_old:
        compare_old(load_old_kernels(args.compare_old), args.compare_what.split(","))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "results": RESULTS}, f, indent=1)
        return 0
    only = set(args.only.split(","))
    if "decode" in only:
        bench_decode([(1, 32768), (8, 8192), (64, 4096), (128, 2048), (256, 1024)],
                     args.tune and "decode" in args.tune_what)
    if "prefill" in only:
        bench_prefill(args.tune and "prefill" in args.tune_what)
    if "scatter" in only:
        bench_scatter()
    if "copy" in only:
        bench_copy()
    if "fp8" in only:
        bench_fp8([(64, 4096), (128, 2048), (256, 1024), (8, 8192), (1, 32768)])
    if "ragged" in only:
        bench_ragged(tuple(int(x) for x in args.plan_pps.split(",")))
    if "host" in only:
        bench_host()
    if "anchor" in only:
        bench_anchor_plan([(1, 32768), (8, 8192), (64, 4096), (128, 2048), (256, 1024)])
    if "scatter2" in only:
        bench_scatter_variants()
    print()
    print(f"{'kind':8s} {'name':40s} {'graph':>10s} {'eager':>10s} {'rate(graph)':>14s}")
    for r in RESULTS:
        if r["kind"].endswith("_tune") or r["kind"] in ("ragged", "decode_r2", "host",
                                                          "scatter_r2", "fp8"):
            continue
        if "graph_tbps" in r:
            rate = f"{r['graph_tbps']:.2f} TB/s"
        elif "graph_tflops" in r:
            rate = f"{r['graph_tflops']:.1f} TFLOP/s"
        elif "gbps" in r:
            rate = f"{r['gbps']:.1f} GB/s"
        elif "eager_tbps" in r:
            rate = f"{r['eager_tbps']:.2f} TB/s (eager)"
        else:
            rate = ""
        gus = f"{r['graph_us']:.1f}us" if "graph_us" in r else "-"
        eus = f"{r['eager_us']:.1f}us" if "eager_us" in r else (f"{r['wall_s'] * 1e3:.2f}ms" if "wall_s" in r else "-")
        print(f"{r['kind']:8s} {r['name']:40s} {gus:>10s} {eus:>10s} {rate:>14s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": RESULTS}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
