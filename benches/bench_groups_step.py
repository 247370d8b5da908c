"""Time the decode step's bookkeeping with KV cache groups, through Python, on the CPU.

Run:  PYTHONPATH=python .venv/bin/python benches/bench_groups_step.py [--json out.json]
          [--rounds N] [--quick]

The trace is the serving decode trace of ``benches/bench_manager.py`` and of the core's
``decode_groups_256`` criterion bench: 256 running sequences with contexts starting at a random
500–2000 tokens; one decode step is ``append_batch`` of one token per sequence, then ``step`` of
the whole batch into attached host step buffers (every group's slot mapping and block-table rows,
the shared lengths, offsets, CSR page table and copy list). Every 64 steps, outside the timed
region, a sequence past 2100 tokens is freed and re-admitted with a fresh prompt (its prefill step
built, so windowed groups release what they no longer need).

Variants (the same seeds, hence the same lengths and re-admissions):

- ``one_group``: a manager without groups;
- ``full_sliding_128``: a full group and a sliding group of window 128 (gpt-oss's pattern);
- ``gemma3_27b_31``: Gemma-3-27B's grouping by :func:`pagedkv.layer_groups.group_layers` at 8K
  (2 layers a page: 5 full groups and 26 sliding groups of window 1024, 31 in all).

Variants run round-robin, one timed batch of 64 steps each per round, so a load spike on a shared
machine hits all of them alike; the figure is the median per-step time over rounds (p10/p90
beside), and each variant's ratio to ``one_group`` is the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from pagedkv import BlockManager, StepBuffers
from pagedkv.groups import KVCacheGroup
from pagedkv.layer_groups import group_layers

B = 16
N = 256
MAX_CTX = 2100
STEPS = 64


def _gemma3_27b_groups() -> List[KVCacheGroup]:
    kinds = [KVCacheGroup.full() if (i + 1) % 6 == 0 else KVCacheGroup.sliding(1024)
             for i in range(62)]
    return list(group_layers(kinds, 8192, B).groups)


VARIANTS: Dict[str, Optional[List[KVCacheGroup]]] = {
    "one_group": None,
    "full_sliding_128": [KVCacheGroup.full(), KVCacheGroup.sliding(128)],
    "gemma3_27b_31": _gemma3_27b_groups(),
}


class Trace:
    """One variant's manager, buffers and random stream."""

    def __init__(self, groups: Optional[Sequence[KVCacheGroup]]) -> None:
        ng = 1 if groups is None else len(groups)
        per_seq = (MAX_CTX + 64 + B) // B + 1
        # Every group may hold every block of every sequence (a window larger than the context).
        self.mgr = BlockManager(ng * N * per_seq + 64, B, groups=groups,
                                max_blocks_per_seq=per_seq + 8)
        self.rng = np.random.default_rng(0x9E3779B9)
        self.seqs = np.arange(N, dtype=np.int64)
        self.buf = StepBuffers(N, 2048, per_seq + 8, device="cpu", backend="numpy",
                               num_groups=ng)
        self.mgr.attach_buffers(self.buf)
        for s in range(N):
            self._admit(s)
        self.tokens = np.zeros(N, dtype=np.int64)

    def _admit(self, s: int) -> None:
        n = int(self.rng.integers(500, 2000))
        self.mgr.admit(s, self.rng.integers(0, 128_000, n))
        self.mgr.step([s], [n])

    def run(self, steps: int) -> float:
        """Seconds for ``steps`` decode steps (append + step), then untimed churn."""
        self.tokens[:] = self.rng.integers(0, 128_000, N)
        mgr, seqs, toks = self.mgr, self.seqs, self.tokens
        gc.disable()
        t0 = time.perf_counter_ns()
        for _ in range(steps):
            mgr.append_batch(seqs, toks)
            mgr.step(seqs, 1)
        t1 = time.perf_counter_ns()
        gc.enable()
        for s in range(N):
            if mgr.seq_len(s) > MAX_CTX:
                mgr.free(s)
                self._admit(s)
        return (t1 - t0) / 1e9


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30, help="timed batches per variant")
    ap.add_argument("--quick", action="store_true", help="5 rounds (a smoke run)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args(argv)
    rounds = 5 if args.quick else args.rounds
    traces = {name: Trace(g) for name, g in VARIANTS.items()}
    for t in traces.values():  # warm-up
        t.run(8)
    per_step: Dict[str, List[float]] = {name: [] for name in traces}
    for _ in range(rounds):
        for name, t in traces.items():
            per_step[name].append(t.run(STEPS) / STEPS * 1e6)
    rows: List[Dict[str, Any]] = []
    base = per_step["one_group"]
    for name, xs in per_step.items():
        q = statistics.quantiles(xs, n=10) if len(xs) >= 2 else xs * 9
        ratios = [x / b for x, b in zip(xs, base)]
        rows.append({"name": name, "groups": traces[name].mgr.num_groups,
                     "median_us": statistics.median(xs), "p10_us": q[0], "p90_us": q[-1],
                     "ratio_to_one_group": statistics.median(ratios)})
    print(f"decode step of {N} sequences (append_batch + step), block size {B}, "
          f"{rounds} rounds of {STEPS} steps")
    print(f"{'variant':<18} {'groups':>6} {'median us':>10} {'p10':>9} {'p90':>9} {'x one':>6}")
    for r in rows:
        print(f"{r['name']:<18} {r['groups']:>6} {r['median_us']:>10.1f} {r['p10_us']:>9.1f} "
              f"{r['p90_us']:>9.1f} {r['ratio_to_one_group']:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "groups_step", "python": sys.version.split()[0],
                       "machine": platform.machine(), "rounds": rounds, "steps": STEPS,
                       "seqs": N, "block_size": B, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
