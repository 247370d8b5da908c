"""Host cost of planning a decode step (`DecodePlan.update`): numpy reference vs the Rust core.

CPU only (no GPU needed; the plan's device is the CPU, so `update`'s copy is a host copy where
on a GPU it is one non-blocking H2D copy plus an event record). For each batch size it times,
call by call with `perf_counter_ns`, the median over `--calls` calls of:

- `update` as it was (numpy: `plan_host`, then its arrays written into the host buffer) and as
  it is (`_core.plan_decode` into the host buffer), each with the double-buffer wait and copy;
- the planning alone: `plan_host` vs `_core.plan_decode`;
- the copy alone (`meta[:used].copy_(host[:used])`, what `update` does after planning), so the
  rest of `update` (argument checks) is the difference.

Lengths: log-normal (the GPU bench's `lognormal_lens`: mu 6.7, sigma 1.25, clipped to
[31, 15380]); plan parameters as on the H200 (132 SMs x 4 programs, 32 q / 8 kv heads, head_dim
128). Both paths are checked to write the same bytes first.

Usage: PYTHONPATH=python python benches/bench_decode_plan.py [--calls 3000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from pagedkv import _core
from pagedkv import decode_plan as D


def lognormal_lens(n, seed=0, lo=31, hi=15380, mu=6.7, sigma=1.25):
    rng = np.random.default_rng(seed)
    lens = np.clip(rng.lognormal(mu, sigma, n).astype(np.int64), lo, hi)
    if n >= 2:
        lens[0], lens[1] = lo, hi
    return lens


def update_numpy(plan: D.DecodePlan, lens: np.ndarray):
    """`DecodePlan.update` before the core planned it (same checks skipped: lens is valid)."""
    n = lens.shape[0]
    chunk, items, indptr = plan.plan_host(lens)
    m = items.shape[0]
    t = plan._turn
    ev = plan._events[t]
    if ev is not None:
        ev.synchronize()
    h = plan._host_np[t]
    h[0] = m
    h[1 : 2 + n] = indptr
    h[plan.items_off : plan.items_off + 4 * m] = items.reshape(-1)
    used = plan.items_off + 4 * m
    plan.meta[:used].copy_(plan._host[t][:used])
    plan._turn = 1 - t
    plan.num_seqs, plan.num_items, plan.chunk = n, m, chunk
    return plan


def median_us(fn, calls):
    for _ in range(min(200, calls)):
        fn()
    ts = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        t0 = clock()
        fn()
        ts.append(clock() - t0)
    return statistics.median(ts) / 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--sizes", default="1,8,128,256")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print(f"{'n':>5} {'items':>6} | {'update numpy':>12} {'update rust':>12} {'x':>6} | "
          f"{'plan_host':>10} {'plan_decode':>11} {'x':>6} | {'copy':>6}   (us, median of "
          f"{args.calls})")
    for n in (int(s) for s in args.sizes.split(",")):
        plan = D.DecodePlan(max(n, 1), 32, 8, 128, device="cpu", programs=4 * 132)
        lens = lognormal_lens(n)
        # Same bytes from both paths.
        update_numpy(plan, lens)
        ref = plan.meta.clone()
        plan.update(lens)
        assert torch.equal(plan.meta, ref)
        h = plan._host_np[0]
        p = (plan.num_kv_heads, plan.programs, plan.min_chunk, plan.granule, plan.items_off,
             plan.capacity)
        row = dict(
            n=n,
            items=plan.num_items,
            update_numpy_us=median_us(lambda: update_numpy(plan, lens), args.calls),
            update_rust_us=median_us(lambda: plan.update(lens), args.calls),
            plan_host_us=median_us(lambda: plan.plan_host(lens), args.calls),
            plan_decode_us=median_us(lambda: _core.plan_decode(lens, h, *p), args.calls),
        )
        used = plan.items_off + 4 * plan.num_items
        row["copy_us"] = median_us(lambda: plan.meta[:used].copy_(plan._host[0][:used]),
                                   args.calls)
        rows.append(row)
        print(f"{n:5d} {row['items']:6d} | {row['update_numpy_us']:12.2f} "
              f"{row['update_rust_us']:12.2f} "
              f"{row['update_numpy_us'] / row['update_rust_us']:5.1f}x | "
              f"{row['plan_host_us']:10.2f} {row['plan_decode_us']:11.2f} "
              f"{row['plan_host_us'] / row['plan_decode_us']:5.1f}x | {row['copy_us']:6.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
