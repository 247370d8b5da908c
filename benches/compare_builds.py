"""Single-thread binding costs of two builds of the extension, side by side in one run (alternating).

Run:  .venv/bin/python benches/compare_builds.py --a OLD_PKG_ROOT --b NEW_PKG_ROOT [--rounds 6]

Each ``*_PKG_ROOT`` is a directory holding a ``pagedkv`` package (with its ``_core.abi3.so``). The
driver runs one child process per build and round, alternating A, B, A, B, ..., so drift on a
shared machine hits both alike; each child times every case as the median over batches of the mean
per call (garbage collector paused while a batch runs), and the table shows, per case, the median
over rounds of those medians. Cases:

- ``hash_blocks_4096_{list,int64,uint32}``: ``_core.hash_blocks`` of a 4096-token prompt;
- ``admit_4096_{list,int64,uint32}``: ``_core.BlockManager.admit`` of a 4096-token prompt and its
  ``free`` (prefix caching on, no hit: the blocks are hashed, nothing is cached before a step);
- ``serve_decode_256_{lists,numpy,lists_csr}``: one decode step of the serving trace
  (``bench_manager.bench_serve``: 256 live sequences, churn, eviction), through the wrapper;
- ``keyed_step_256``: one vLLM-shaped step on ``_core.KeyedBlockPool`` (allocate 256 blocks, each
  evicting a cached one, insert a 36-byte key for each, release the previous step's 256),
  the binding twin of ``cargo bench -p pagedkv --bench keyed`` (``allocate_insert_release``);
- ``keyed_lookup_hit_miss``: one hit and one miss.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(batches: int) -> dict[str, float]:
    import gc
    import time

    import numpy as np

    sys.path.insert(0, str(HERE))
    import bench_manager  # noqa: E402  (imports pagedkv from the child's PYTHONPATH)
    from pagedkv import _core

    def timed(run, iters: int) -> float:
        per = []
        for _ in range(batches):
            gc.disable()
            t0 = time.perf_counter_ns()
            run(iters)
            t1 = time.perf_counter_ns()
            gc.enable()
            per.append((t1 - t0) / iters / 1e3)
        return statistics.median(per)

    out: dict[str, float] = {}
    rng = np.random.default_rng(0)
    base = rng.integers(0, 32000, size=4096, dtype=np.int64)
    prompts = {
        "list": base.tolist(),
        "int64": base,
        "uint32": base.astype(np.uint32),
    }
    for kind, p in prompts.items():

        def hb(n: int, p=p) -> None:
            h = _core.hash_blocks
            for _ in range(n):
                h(p, 16, hash_seed=1)

        out[f"hash_blocks_4096_{kind}"] = timed(hb, 50)
    m = _core.BlockManager(4096 // 16 * 2 + 64, 16, watermark_blocks=0)
    for kind, p in prompts.items():

        def ad(n: int, p=p) -> None:
            a, f = m.admit, m.free
            for _ in range(n):
                a(1, p)
                f(1)

        out[f"admit_4096_{kind}"] = timed(ad, 50)
    for r in bench_manager.bench_serve(batches):
        out[r["name"]] = r["median_us"]

    def key(i: int) -> bytes:
        return i.to_bytes(8, "little") * 4 + (0).to_bytes(4, "big")

    pool = _core.KeyedBlockPool(4096)
    all_blocks, _ = pool.allocate(4095)
    for i, b in enumerate(all_blocks):
        pool.insert(key(i), b)
    pool.release(all_blocks)
    keys = [key(i) for i in range(4096, 4096 + 256 * 64)]
    state = {"prev": [], "step": 0}

    def keyed_step(n: int) -> None:
        alloc, ins, rel = pool.allocate, pool.insert, pool.release
        for _ in range(n):
            blocks, _ev = alloc(256)
            s = (state["step"] % 64) * 256
            for j, b in enumerate(blocks):
                ins(keys[s + j], b)
            if state["prev"]:
                rel(state["prev"])
            state["prev"] = blocks
            state["step"] += 1

    out["keyed_step_256"] = timed(keyed_step, 20)
    hit, miss = key(4096 + 3), key(1 << 40)
    lp = _core.KeyedBlockPool(64)
    got, _ = lp.allocate(1)
    lp.insert(hit, got[0])

    def lookups(n: int) -> None:
        lk = lp.lookup
        for _ in range(n):
            lk(hit)
            lk(miss)

    out["keyed_lookup_hit_miss"] = timed(lookups, 2000)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", help="package root of build A (before)")
    ap.add_argument("--b", help="package root of build B (after)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batches", type=int, default=21)
    ap.add_argument("--json", help="write every round's figures here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.batches)))
        return 0
    runs: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for label, root in (("a", args.a), ("b", args.b)):
            env = dict(os.environ, PYTHONPATH=root)
            cmd = [sys.executable, __file__, "--child", "--batches", str(args.batches)]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[label].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{args.rounds} {label} done", file=sys.stderr)
    names = list(runs["a"][0])
    print(f"{'case':34} {'A (µs)':>10} {'B (µs)':>10} {'B/A':>7}")
    for n in names:
        a = statistics.median(x[n] for x in runs["a"])
        b = statistics.median(x[n] for x in runs["b"])
        print(f"{n:34} {a:10.2f} {b:10.2f} {b / a:7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
