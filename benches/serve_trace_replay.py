"""The serving trace of bench_manager.bench_serve, N decode steps, for instruction counts.

Run:  valgrind --tool=callgrind --toggle-collect=functools_reduce \\
          .venv/bin/python benches/serve_trace_replay.py 300 [lists|numpy]

Each decode step (append_batch + step, through the Python wrapper, ids as the engine holds them)
runs inside one functools.reduce call, so toggling collection on that C function counts exactly
the decode steps, Python wrapper included, and not the untimed churn (admissions, prefill steps).
Divide the collected Ir by N. Native twin: rust/core/examples/serve_trace.rs.
"""
import sys, gc
import numpy as np
from pagedkv import BlockManager, StepBuffers
steps = int(sys.argv[1]); kind = sys.argv[2] if len(sys.argv) > 2 else "lists"
BLOCK = 16; n_seqs = 256; max_blocks = 2048 // BLOCK
rng = np.random.default_rng(7)
system = rng.integers(0, 32000, size=512).tolist()
def new_prompt():
    n = int(rng.integers(300, 1500))
    return system + rng.integers(0, 32000, size=max(n - 512, 1)).tolist()
m = BlockManager(24000, BLOCK, max_blocks_per_seq=max_blocks)
bufs = StepBuffers(n_seqs, 4096, max_blocks, device="cpu", csr=False)
m.attach_buffers(bufs)
live = []; next_id = [0]
def admit_one():
    sid = next_id[0]; next_id[0] += 1
    p = new_prompt()
    while not m.can_admit(p):
        m.free(live.pop(0))
    r = m.admit(sid, p); m.step([sid], len(p) - r.cached_tokens); live.append(sid)
while m.stats().free_blocks > 0 or len(live) < n_seqs:
    if len(live) >= n_seqs or not m.can_admit(1500):
        m.free(live.pop(int(rng.integers(0, len(live)))))
    admit_one()
step_no = [0]
def churn():
    step_no[0] += 1
    if step_no[0] % 8 == 0:
        m.free(live.pop(int(rng.integers(0, len(live))))); admit_one()
    for sid in [s for s in live if m.seq_len(s) > 1900]:
        live.remove(sid); m.free(sid); admit_one()
ab, st = m.append_batch, m.step
import functools
def decode(ids, toks):
    ab(ids, toks); st(ids, 1)
for _ in range(steps):
    churn()
    if kind == "lists":
        ids = list(live); toks = rng.integers(0, 32000, size=len(ids)).tolist()
    else:
        ids = np.array(live, dtype=np.int64); toks = rng.integers(0, 32000, size=len(ids), dtype=np.int64)
    functools.reduce(lambda a, b: decode(ids, toks), (0, 0))
m.check_invariants()
print("ok", m.stats().evictions)
