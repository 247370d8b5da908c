"""GPU benchmark of `linear_small_m` (pagedkv.kernels.gemv) against F.linear at decode shapes.

Times the five projections of a Llama-family decoder (Llama-3-8B by default, `_dims` flags) at
M = 1, 2, 4, 8, 16 rows, bf16: fused QKV, O, fused gate|up, down, LM head. Each figure is the
median over CUDA-graph replays of a rotation over several copies of the weight, at least
`ROTATE_BYTES` of them, so every call streams its weight from HBM (the L2 cannot keep a copy
between its uses) and kernels run back to back as in a captured decode step; the graph's own
launch is spread over enough calls to stay a few percent. GB/s counts the bytes each call must
move (weight + x + out), and is also given as a share of the device-to-device copy rate measured
at the start (read + write bytes over the copy time). Errors are max |out - fp32 reference|.

Then the step total: the 129 GEMMs of one decode step at M = 1 (layers x {QKV, O, gate|up,
down} + LM head, every weight its own tensor, ~15 GB at Llama-3-8B) captured as one graph, for
F.linear and for `linear_small_m`. `--sweep` times a grid of launch configurations per shape (M
in `--sweep-m`), then split-K for the best few, and prints the best per shape with its gain over
the heuristic (`gemv_config`) and the step time the best per-shape configs would give.

Usage (on a CUDA machine, from the repository root):
    PYTHONPATH=python python benches/bench_gemv.py --json out.json [--sweep]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from _dims import add_model_args, model_dims
from pagedkv.kernels import gemv as G
from triton.errors import TritonError

DT = torch.bfloat16
DEV = "cuda"
#: Weight bytes a rotation spans (and a graph replay streams, at least): 5x the H200's L2.
ROTATE_BYTES = 256 << 20
REPLAY_BYTES = 512 << 20
MS = (1, 2, 4, 8, 16)

# Sweep grid. FMA (M = 1 only): (BLOCK_N, BLOCK_K, num_warps), each with num_stages 1 and 3;
# BLOCK_K = 256 x num_warps puts every warp along K (no exchange of x through shared memory),
# (16, 512, 4) is there to measure the exchange.
FMA_GRID = [(8, 1024, 4), (4, 1024, 4), (2, 1024, 4), (16, 1024, 4), (8, 2048, 8), (4, 2048, 8),
            (4, 512, 2), (16, 512, 4)]
FMA_STAGES = (1, 3)
# DOT: (BLOCK_N, BLOCK_K, num_warps, num_stages); mostly BLOCK_N / 16 warps (no weight tile read
# twice from shared memory), a few with more to measure that.
DOT_GRID = [(16, 256, 1, 4), (16, 512, 1, 3), (16, 128, 1, 6), (16, 256, 2, 4), (32, 128, 2, 4),
            (32, 256, 2, 3), (32, 128, 4, 4), (64, 64, 4, 4), (64, 64, 4, 6), (64, 128, 4, 3),
            (64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 3)]
# Split-K, tried on the best two tiles and the heuristic's where N gives few programs.
SPLITS = (2, 4, 8)


def shapes(d):
    """(name, N, K, count per step) of the decode step's GEMMs."""
    hd = d["hidden"] // d["heads"]
    return [
        ("qkv", (d["heads"] + 2 * d["kv_heads"]) * hd, d["hidden"], d["layers"]),
        ("o", d["hidden"], d["heads"] * hd, d["layers"]),
        ("gate_up", 2 * d["mlp"], d["hidden"], d["layers"]),
        ("down", d["hidden"], d["mlp"], d["layers"]),
        ("lm_head", d["vocab"], d["hidden"], 1),
    ]


def make_weights(n, k, copies, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    # std 1/sqrt(K), as a trained layer: outputs O(1), so the errors read as output ulps.
    return [torch.empty(n, k, device=DEV, dtype=DT).normal_(0.0, k ** -0.5, generator=gen)
            for _ in range(copies)]


def graph_us(fns, reps):
    """Median time (µs) per call of `fns`, captured back to back in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()  # compiles, and warms cuBLAS's heuristics, outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    times = []
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / len(fns))
    del g
    return statistics.median(times)


def copy_tbps():
    """Device-to-device copy rate (read + write bytes / time) of 1 GiB, median of 10."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    ts = []
    for _ in range(10):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    del src, dst
    return 2 * (1 << 30) / statistics.median(ts) / 1e12


def cfg_str(c):
    path = "dot" if c["DOT"] else "fma"
    return (f"{path} n{c['BLOCK_N']} k{c['BLOCK_K']} s{c['SPLIT_K']} w{c['num_warps']} "
            f"st{c['num_stages']}")


class Shape:
    """One projection: its weight copies, an x per M, and the timing of any callable on them."""

    def __init__(self, name, n, k, count, seed, ms):
        self.name, self.n, self.k, self.count = name, n, k, count
        wbytes = n * k * 2
        copies = max(2, math.ceil(ROTATE_BYTES / wbytes))
        self.w = make_weights(n, k, copies, seed)
        self.calls = max(copies, math.ceil(REPLAY_BYTES / wbytes))
        gen = torch.Generator(device=DEV).manual_seed(seed + 1)
        self.x = {m: torch.randn(m, k, device=DEV, generator=gen).to(DT) for m in ms}

    def bytes(self, m):
        return (self.n * self.k + m * self.k + m * self.n) * 2

    def time(self, m, fn, reps):
        x, ws = self.x[m], self.w
        return graph_us([lambda i=i: fn(x, ws[i % len(ws)]) for i in range(self.calls)], reps)

    def ours(self, config=None):
        return lambda x, w: G.linear_small_m(x, w, config=config)


def bench_shapes(dims, ms, copy_rate, results, reps):
    print(f"\n{'shape':8s} {'N':>6s} {'K':>6s} {'M':>2s} {'torch us':>9s} {'ours us':>9s} "
          f"{'torch GB/s':>10s} {'ours GB/s':>10s} {'ours/copy':>9s} {'speedup':>7s} "
          f"{'err torch':>9s} {'err ours':>9s}  config")
    for i, (name, n, k, count) in enumerate(shapes(dims)):
        sh = Shape(name, n, k, count, 100 + i, ms)
        for m in ms:
            x = sh.x[m]
            ref = x.float() @ sh.w[0].float().t()
            e_t = (F.linear(x, sh.w[0]).float() - ref).abs().max().item()
            e_o = (G.linear_small_m(x, sh.w[0]).float() - ref).abs().max().item()
            del ref
            t_t = sh.time(m, F.linear, reps)
            t_o = sh.time(m, sh.ours(), reps)
            nbytes = sh.bytes(m)
            cfg = G.gemv_config(m, n, k, dtype=DT, num_sms=_sms())
            row = {"kind": "shape", "shape": name, "N": n, "K": k, "M": m, "count": count,
                   "bytes": nbytes, "torch_us": t_t, "ours_us": t_o,
                   "torch_gbps": nbytes / t_t / 1e3, "ours_gbps": nbytes / t_o / 1e3,
                   "ours_of_copy": nbytes / t_o / 1e6 / copy_rate, "speedup": t_t / t_o,
                   "err_torch": e_t, "err_ours": e_o, "config": cfg}
            results.append(row)
            print(f"{name:8s} {n:6d} {k:6d} {m:2d} {t_t:9.1f} {t_o:9.1f} "
                  f"{row['torch_gbps']:10.0f} {row['ours_gbps']:10.0f} "
                  f"{row['ours_of_copy'] * 100:8.1f}% {row['speedup']:6.2f}x "
                  f"{e_t:9.2e} {e_o:9.2e}  {cfg_str(cfg)}", flush=True)
        del sh
        torch.cuda.empty_cache()


def bench_host(dims, results):
    """Host time per eager call (µs) at the O projection's shape, the GPU kept busy."""
    n = k = dims["hidden"]
    w = make_weights(n, k, 1, 7)[0]
    x = torch.randn(1, k, device=DEV).to(DT)
    row = {"kind": "host", "N": n, "K": k, "M": 1}
    for label, fn in (("torch", lambda: F.linear(x, w)), ("ours", lambda: G.linear_small_m(x, w))):
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # keeps the GPU busy: the loop below is host time only
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        row[label + "_host_us"] = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
    results.append(row)
    print(f"\nhost time per eager call (M=1, {n}x{k}): torch {row['torch_host_us']:.1f} us, "
          f"ours {row['ours_host_us']:.1f} us")


def bench_step(dims, step_ms, copy_rate, results, reps):
    """The decode step's GEMMs, every weight its own tensor, as one graph per implementation."""
    plan = []
    for i, (name, n, k, count) in enumerate(shapes(dims)):
        for j in range(count):
            plan.append((name, n, k, 1000 * i + j))
    ws = [make_weights(n, k, 1, seed)[0] for _, n, k, seed in plan]
    total_w = sum(w.numel() * 2 for w in ws)
    for m in step_ms:
        xs = {k: torch.randn(m, k, device=DEV).to(DT) for _, _, k, _ in plan}
        nbytes = total_w + sum((m * k + m * n) * 2 for _, n, k, _ in plan)
        row = {"kind": "step", "M": m, "gemms": len(plan), "bytes": nbytes}
        for label, fn in (("torch", F.linear), ("ours", G.linear_small_m)):
            fns = [lambda w=w, x=xs[w.shape[1]], fn=fn: fn(x, w) for w in ws]
            t = graph_us(fns, reps) * len(fns)
            row[label + "_us"] = t
            row[label + "_tbps"] = nbytes / t / 1e6
        row["copy_floor_us"] = nbytes / copy_rate / 1e6
        row["saved_us"] = row["torch_us"] - row["ours_us"]
        results.append(row)
        print(f"\nstep M={m} ({len(plan)} GEMMs, {nbytes / 1e9:.2f} GB): "
              f"torch {row['torch_us'] / 1e3:.3f} ms ({row['torch_tbps']:.2f} TB/s), "
              f"ours {row['ours_us'] / 1e3:.3f} ms ({row['ours_tbps']:.2f} TB/s, "
              f"{row['ours_tbps'] / copy_rate * 100:.1f}% of copy), "
              f"saved {row['saved_us'] / 1e3:.3f} ms; copy-rate floor "
              f"{row['copy_floor_us'] / 1e3:.3f} ms", flush=True)
        del xs
    del ws
    torch.cuda.empty_cache()


def sweep_configs(m):
    cfgs = []
    if m == 1:
        for bn, bk, nw in FMA_GRID:
            for st in FMA_STAGES:
                cfgs.append({"DOT": False, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1,
                             "num_warps": nw, "num_stages": st})
    for bn, bk, nw, st in DOT_GRID:
        cfgs.append({"DOT": True, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "num_warps": nw,
                     "num_stages": st})
    return cfgs


def _try_time(sh, m, cfg, reps):
    """`sh.time` of `cfg`, or None (printed) where the compiler rejects it (shared memory, ...):
    the compile runs in graph_us's warm-up, before any capture. MLIR pass failures surface as
    RuntimeError, not TritonError."""
    try:
        return sh.time(m, sh.ours(cfg), reps)
    except (TritonError, RuntimeError) as e:
        print(f"  {sh.name} M={m} {cfg_str(cfg)}: {type(e).__name__}: {str(e)[:80]}", flush=True)
        return None


def bench_sweep(dims, ms, copy_rate, results, reps, save=lambda: None):
    print(f"\nsweep (M in {list(ms)}): best config per shape")
    best_rows = []
    t0 = time.perf_counter()
    for i, (name, n, k, count) in enumerate(shapes(dims)):
        sh = Shape(name, n, k, count, 100 + i, ms)
        for m in ms:
            heur = G.gemv_config(m, n, k, dtype=DT, num_sms=_sms())
            t_h = sh.time(m, sh.ours(), reps)
            timed = [(t_h, heur)]
            for cfg in sweep_configs(m):
                if cfg["BLOCK_K"] > triton.next_power_of_2(k):
                    continue
                t = _try_time(sh, m, cfg, reps)
                if t is None:
                    continue
                timed.append((t, cfg))
                results.append({"kind": "sweep", "shape": name, "N": n, "K": k, "M": m,
                                "config": cfg, "us": t})
            timed.sort(key=lambda r: r[0])
            # Split-K for the two best, and for the heuristic's own tile.
            for cfg in [c for _, c in timed[:2] if c is not heur] + [heur]:
                for s in SPLITS:
                    if k // s < cfg["BLOCK_K"] or triton.cdiv(n, cfg["BLOCK_N"]) >= 4 * _sms():
                        continue
                    c = {**cfg, "SPLIT_K": s}
                    t = _try_time(sh, m, c, reps)
                    if t is None:
                        continue
                    timed.append((t, c))
                    results.append({"kind": "sweep", "shape": name, "N": n, "K": k, "M": m,
                                    "config": c, "us": t})
            timed.sort(key=lambda r: r[0])
            t_b, c_b = timed[0]
            nbytes = sh.bytes(m)
            row = {"kind": "sweep_best", "shape": name, "N": n, "K": k, "M": m, "count": count,
                   "heuristic": heur, "heuristic_us": t_h, "best": c_b, "best_us": t_b,
                   "best_of_copy": nbytes / t_b / 1e6 / copy_rate,
                   "heuristic_of_copy": nbytes / t_h / 1e6 / copy_rate,
                   "top5": [{"us": t, "config": c} for t, c in timed[:5]]}
            results.append(row)
            best_rows.append(row)
            print(f"{name:8s} M={m:2d}: heuristic {t_h:8.1f} us "
                  f"({row['heuristic_of_copy'] * 100:5.1f}%) [{cfg_str(heur)}]  "
                  f"best {t_b:8.1f} us ({row['best_of_copy'] * 100:5.1f}%)"
                  f" [{cfg_str(c_b)}]  gain {t_h / t_b:5.3f}x", flush=True)
        del sh
        torch.cuda.empty_cache()
        save()
    for m in ms:
        rows = [r for r in best_rows if r["M"] == m]
        if len(rows) == len(shapes(dims)):
            h = sum(r["heuristic_us"] * r["count"] for r in rows)
            b = sum(r["best_us"] * r["count"] for r in rows)
            print(f"step estimate M={m} from per-shape times: heuristic {h / 1e3:.3f} ms, "
                  f"best configs {b / 1e3:.3f} ms")
    print("best configs (shape, M) -> config:")
    print(json.dumps({f"{r['shape']},{r['M']}": r["best"] for r in best_rows}))
    print(f"sweep took {time.perf_counter() - t0:.0f} s")


_SMS = None


def _sms():
    global _SMS
    if _SMS is None:
        _SMS = torch.cuda.get_device_properties(0).multi_processor_count
    return _SMS


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--json", default=None)
    ap.add_argument("--m", default=",".join(map(str, MS)), help="rows of x the table times")
    ap.add_argument("--reps", type=int, default=50, help="graph replays per figure")
    ap.add_argument("--step-m", default="1", help="rows of x for the whole-step figure")
    ap.add_argument("--no-step", action="store_true", help="skip the whole-step graphs")
    ap.add_argument("--sweep", action="store_true", help="also sweep launch configurations")
    ap.add_argument("--sweep-m", default="1,4,16", help="rows of x the sweep covers")
    ap.add_argument("--sweep-reps", type=int, default=15)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    props = torch.cuda.get_device_properties(0)
    dims = model_dims(args)
    meta = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "argv": sys.argv,
            "dims": dims, "dtype": str(DT)}
    print(meta, flush=True)
    t0 = time.perf_counter()
    rate = copy_tbps()
    meta["copy_tbps"] = rate
    print(f"device-to-device copy: {rate:.3f} TB/s (read + write)", flush=True)
    results: list = []
    ms = tuple(int(v) for v in args.m.split(","))
    sweep_ms = tuple(int(v) for v in args.sweep_m.split(","))
    for m in set(ms) | set(sweep_ms):
        if not 1 <= m <= G.MAX_M:
            ap.error(f"M = {m}: expected 1 to {G.MAX_M}")

    def save():
        # After every section (and every sweep shape): a run cut short by a time limit keeps
        # what it measured.
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=1)

    bench_shapes(dims, ms, rate, results, args.reps)
    save()
    bench_host(dims, results)
    save()
    if not args.no_step:
        bench_step(dims, tuple(int(v) for v in args.step_m.split(",")), rate, results,
                   max(5, args.reps // 5))
        save()
    if args.sweep:
        bench_sweep(dims, sweep_ms, rate, results, args.sweep_reps, save)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    meta["total_s"] = time.perf_counter() - t0
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
