"""Time the block manager through Python: the per-step hot path and admissions.

Run:  .venv/bin/python benches/bench_manager.py [--json out.json] [--batches N] [--quick]

Each case runs a batch of calls timed as a whole with ``time.perf_counter_ns`` and reports the mean
per call within a batch; the figure printed is the median over batches (p10/p90 alongside), so a
batch disturbed by other work on the machine does not move it. Untimed set-up between batches keeps
the state comparable (sequences freed and re-admitted so lengths stay bounded). The garbage
collector is paused while a batch runs.

Cases:
- ``decode_step_256``: one decode step of 256 sequences — ``append_batch`` of 256 tokens followed
  by ``step`` into registered host buffers (slot mapping, block tables, CSR page table).
- ``append_batch_256`` / ``step_256``: the two halves of that step on their own.
- ``decode_step_256_nocsr``: the decode step with buffers that skip the FlashInfer CSR page table
  (``StepBuffers(..., csr=False)``); ``core_decode_step_256_nocsr``: the same on the extension
  object, without the Python wrapper.
- ``admit_4096``: admission of a 4096-token prompt (int64 numpy array) and its ``free``; no prefix
  hit (blocks enter the prefix cache only at step time, and none runs here).
- ``admit_4096_uint32``: the same with a uint32 array (read in place, no conversion).
- ``admit_4096_nocache``: the same (int64 ids) with prefix caching off: allocation only, no
  hashing — the admission as the block manager alone defines it.
- ``admit_4096_cached``: admission of a 4096-token prompt whose blocks are all cached (255 of 256
  blocks shared from the prefix cache, revived from the cached-free LRU) and its ``free``.
- ``to_device_256`` (only with CUDA): ``StepBuffers.to_device`` after a 256-sequence decode step —
  the used prefix of each pinned host tensor copied asynchronously into its device mirror; a
  batch ends with one ``torch.cuda.synchronize()``.
- ``serve_decode_256_{lists,numpy,lists_csr}``: the serving trace (see ``bench_serve``): 256
  live sequences with churn and eviction, one decode step (``append_batch`` + ``step``) with the
  ids as an engine holds them.
- ``admit_4096_{list,bigint_list,uint32}_nocache``: list conversion, see ``bench_convert``.
- ``seq_len``: a trivial query through the Python wrapper (per-call overhead);
  ``core_seq_len``: the same call on the extension object directly.
- ``append_batch_0`` / ``core_append_batch_0``: ``append_batch`` with two empty int64 arrays, through
  the wrapper and on the extension object: the fixed cost of a batch call (argument dispatch, two
  array borrows, the core call) with no work in it.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from typing import Callable, Optional

import numpy as np

from pagedkv import BlockManager, StepBuffers

BLOCK = 16
BATCH_SEQS = 256
PROMPT = 512
DECODE_ITERS = 128  # per timed batch; 8 block boundaries crossed per sequence


def timed(
    name: str,
    run: Callable[[int], None],
    iters: int,
    batches: int,
    reset: Optional[Callable[[], None]] = None,
) -> dict:
    per_call = []
    for _ in range(batches):
        if reset is not None:
            reset()
        gc.disable()
        t0 = time.perf_counter_ns()
        run(iters)
        t1 = time.perf_counter_ns()
        gc.enable()
        per_call.append((t1 - t0) / iters / 1e3)
    per_call.sort()
    q = statistics.quantiles(per_call, n=10) if len(per_call) >= 2 else per_call * 9
    return {
        "name": name,
        "median_us": statistics.median(per_call),
        "p10_us": q[0],
        "p90_us": q[-1],
        "iters_per_batch": iters,
        "batches": batches,
    }


def bench_decode(batches: int, csr: bool = True) -> list[dict]:
    max_blocks = (PROMPT + DECODE_ITERS) // BLOCK + 2
    m = BlockManager(BATCH_SEQS * max_blocks + 64, BLOCK, max_blocks_per_seq=max_blocks)
    bufs = StepBuffers(BATCH_SEQS, BATCH_SEQS * 4, max_blocks, device="cpu", csr=csr)
    m.attach_buffers(bufs)
    seqs = np.arange(BATCH_SEQS, dtype=np.int64)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 32000, size=(BATCH_SEQS, PROMPT), dtype=np.int64)
    toks = rng.integers(0, 32000, size=BATCH_SEQS, dtype=np.int64)
    epoch = [0]

    def reset() -> None:
        # Fresh sequences each batch; distinct prompts per batch so no prefix hits at admission.
        for s in range(BATCH_SEQS):
            if s in m:
                m.free(s)
        epoch[0] += 1
        for s in range(BATCH_SEQS):
            m.admit(s, (prompts[s] + epoch[0]) % 32000)
        m.step(seqs, 1)  # registers the prompts' full blocks, as the prefill step would

    def decode(n: int) -> None:
        ab, st = m.append_batch, m.step
        for _ in range(n):
            ab(seqs, toks)
            st(seqs, 1)

    def append_only(n: int) -> None:
        ab = m.append_batch
        for _ in range(n):
            ab(seqs, toks)

    def step_only(n: int) -> None:
        st = m.step
        for _ in range(n):
            st(seqs, 1)

    def core_decode(n: int) -> None:
        # The same on the extension object: the binding's share without the wrapper's.
        core = m._core
        ab, st = core.append_batch, core.step
        for _ in range(n):
            ab(seqs, toks)
            st(seqs, 1)

    if not csr:
        out = [
            timed("decode_step_256_nocsr", decode, DECODE_ITERS, batches, reset),
            timed("core_decode_step_256_nocsr", core_decode, DECODE_ITERS, batches, reset),
        ]
        m.check_invariants()
        return out
    out = [
        timed("decode_step_256", decode, DECODE_ITERS, batches, reset),
        timed("append_batch_256", append_only, DECODE_ITERS, batches, reset),
        timed("step_256", step_only, DECODE_ITERS, batches, reset),
    ]
    m.check_invariants()
    return out


def bench_to_device(batches: int) -> list[dict]:
    """Host-side cost of `StepBuffers.to_device` after a 256-sequence decode step (CUDA only)."""
    import torch

    if not torch.cuda.is_available():
        return []
    max_blocks = PROMPT // BLOCK + 2
    m = BlockManager(BATCH_SEQS * max_blocks + 64, BLOCK, max_blocks_per_seq=max_blocks)
    bufs = StepBuffers(BATCH_SEQS, BATCH_SEQS * 4, max_blocks)
    m.attach_buffers(bufs)
    seqs = np.arange(BATCH_SEQS, dtype=np.int64)
    for s in range(BATCH_SEQS):
        m.admit(s, np.arange(PROMPT, dtype=np.int64) + s * PROMPT)
    info = m.step(seqs, 1)

    def copy(n: int) -> None:
        td = bufs.to_device
        for _ in range(n):
            td(info)
        torch.cuda.synchronize()

    return [timed("to_device_256", copy, 200, batches)]


def bench_admit(batches: int) -> list[dict]:
    n_tok = 4096
    m = BlockManager(4 * n_tok // BLOCK + 64, BLOCK)
    rng = np.random.default_rng(1)
    pool = rng.integers(0, 32000, size=(64, n_tok), dtype=np.int64)
    pool_u32 = pool.astype(np.uint32)

    m_off = BlockManager(4 * n_tok // BLOCK + 64, BLOCK, enable_prefix_caching=False)

    def admit_free(mgr: BlockManager, arrs: np.ndarray) -> Callable[[int], None]:
        def run(n: int) -> None:
            a, f = mgr.admit, mgr.free
            for i in range(n):
                a(1, arrs[i % 64])
                f(1)

        return run

    out = [
        timed("admit_4096", admit_free(m, pool), 200, batches),
        timed("admit_4096_uint32", admit_free(m, pool_u32), 200, batches),
        timed("admit_4096_nocache", admit_free(m_off, pool), 200, batches),
    ]

    # Cached: register one prompt's blocks with a step, free it; every later admission hits.
    mc = BlockManager(4 * n_tok // BLOCK + 64, BLOCK)
    mc.attach_buffers(StepBuffers(1, n_tok, mc.max_blocks_per_seq, device="cpu"))
    prompt = pool[0]
    mc.admit(1, prompt)
    mc.step([1], n_tok)
    mc.free(1)
    r = mc.admit(1, prompt)
    assert r.cached_tokens == n_tok - BLOCK, r
    mc.free(1)

    def cached(n: int) -> None:
        a, f = mc.admit, mc.free
        for _ in range(n):
            a(1, prompt)
            f(1)

    out.append(timed("admit_4096_cached", cached, 200, batches))
    mc.check_invariants()
    m.check_invariants()
    m_off.check_invariants()
    return out


def bench_overhead(batches: int) -> list[dict]:
    m = BlockManager(64, BLOCK)
    m.admit(3, [1, 2, 3])

    def wrapper(n: int) -> None:
        f = m.seq_len
        for _ in range(n):
            f(3)

    def core(n: int) -> None:
        f = m._core.seq_len
        for _ in range(n):
            f(3)

    empty = np.zeros(0, dtype=np.int64)

    def batch_floor(n: int) -> None:
        f = m.append_batch
        for _ in range(n):
            f(empty, empty)

    def core_batch_floor(n: int) -> None:
        f = m._core.append_batch
        for _ in range(n):
            f(empty, empty)

    return [
        timed("seq_len", wrapper, 20000, batches),
        timed("core_seq_len", core, 20000, batches),
        timed("append_batch_0", batch_floor, 20000, batches),
        timed("core_append_batch_0", core_batch_floor, 20000, batches),
    ]


def bench_serve(batches: int) -> list[dict]:
    """The serving trace: 256 live sequences, churn and eviction, ids as an engine holds them.

    A pool of 24 000 blocks of 16 holds 256 running sequences (contexts 300–1900 tokens, one
    shared 512-token system prompt) plus cached-free blocks of finished ones, so the free list
    is empty and every block a step allocates is an LRU eviction. Every 8th step one sequence
    finishes and a new one is admitted in its place (prefix hit on the system prompt, the rest
    prefilled by a step), so the batch changes as it does in an engine. Timed per decode step:
    ``append_batch(seq_ids, tokens)`` + ``step(seq_ids, 1)``, the ids and tokens passed as
    Python lists (``lists``) or int64 numpy arrays (``numpy``); admissions, frees and prefill
    steps are untimed. The figure is the median over batches of the mean per step. The step
    buffers are those pagedkv's own kernels read (slot mapping, block tables, lengths, query
    offsets: ``csr=False``); ``_csr`` adds the FlashInfer CSR page table, a packed full rewrite
    of every block id of the batch each step (~17 000 ids at these lengths).
    """
    rng = np.random.default_rng(7)
    n_seqs = BATCH_SEQS
    max_blocks = 2048 // BLOCK
    system = rng.integers(0, 32000, size=512).tolist()

    def new_prompt() -> list[int]:
        n = int(rng.integers(300, 1500))
        return system + rng.integers(0, 32000, size=max(n - 512, 1)).tolist()

    out = []
    for kind, csr in (("lists", False), ("numpy", False), ("lists", True)):
        m = BlockManager(24000, BLOCK, max_blocks_per_seq=max_blocks)
        bufs = StepBuffers(n_seqs, 4096, max_blocks, device="cpu", csr=csr)
        m.attach_buffers(bufs)
        live: list[int] = []
        next_id = [0]

        def admit_one() -> None:
            sid = next_id[0]
            next_id[0] += 1
            p = new_prompt()
            while not m.can_admit(p):  # what a scheduler would preempt; rare here
                m.free(live.pop(0))
            r = m.admit(sid, p)
            m.step([sid], len(p) - r.cached_tokens)
            live.append(sid)

        # Warm up: fill the pool with finished sequences' cached-free blocks, then 256 live.
        while m.stats().free_blocks > 0 or len(live) < n_seqs:
            if len(live) >= n_seqs or not m.can_admit(1500):
                m.free(live.pop(int(rng.integers(0, len(live)))))
            admit_one()
        step_no = [0]

        def churn() -> None:
            step_no[0] += 1
            if step_no[0] % 8 == 0:
                m.free(live.pop(int(rng.integers(0, len(live)))))
                admit_one()
            # Keep lengths bounded: retire sequences close to the row width.
            for sid in [s for s in live if m.seq_len(s) > 1900]:
                live.remove(sid)
                m.free(sid)
                admit_one()

        ab, st = m.append_batch, m.step
        per_batch = []
        evictions0 = m.stats().evictions
        for _ in range(batches):
            total = 0
            for _ in range(DECODE_ITERS // 2):
                churn()
                if kind == "lists":
                    ids = list(live)  # the engine's running list, rebuilt as it changes
                    toks = rng.integers(0, 32000, size=len(ids)).tolist()  # sampler .tolist()
                else:
                    ids = np.array(live, dtype=np.int64)
                    toks = rng.integers(0, 32000, size=len(ids), dtype=np.int64)
                gc.disable()
                t0 = time.perf_counter_ns()
                ab(ids, toks)
                st(ids, 1)
                t1 = time.perf_counter_ns()
                gc.enable()
                total += t1 - t0
            per_batch.append(total / (DECODE_ITERS // 2) / 1e3)
        assert m.stats().evictions > evictions0, "the trace must evict"
        assert m.stats().free_blocks == 0
        m.check_invariants()
        per_batch.sort()
        q = statistics.quantiles(per_batch, n=10) if len(per_batch) >= 2 else per_batch * 9
        out.append(
            {
                "name": f"serve_decode_256_{kind}" + ("_csr" if csr else ""),
                "median_us": statistics.median(per_batch),
                "p10_us": q[0],
                "p90_us": q[-1],
                "iters_per_batch": DECODE_ITERS // 2,
                "batches": batches,
            }
        )
    return out


def bench_convert(batches: int) -> list[dict]:
    """Token-id conversion: a 4096-token prompt as a Python list against a uint32 array (read in
    place), admitted and freed with prefix caching off (no hashing). The difference over 4096 is
    the list's conversion cost per token (``list_ns_per_token``)."""
    n_tok = 4096
    m = BlockManager(4 * n_tok // BLOCK + 64, BLOCK, enable_prefix_caching=False)
    rng = np.random.default_rng(3)
    arr = rng.integers(0, 32000, size=n_tok, dtype=np.uint32)
    lst = arr.tolist()
    big = (arr.astype(np.int64) + 2**31).tolist()  # ints above 2**31: the multi-digit path

    def run(x) -> Callable[[int], None]:
        def go(n: int) -> None:
            a, f = m.admit, m.free
            for _ in range(n):
                a(1, x)
                f(1)

        return go

    rs = [
        timed("admit_4096_list_nocache", run(lst), 200, batches),
        timed("admit_4096_bigint_list_nocache", run(big), 200, batches),
        timed("admit_4096_uint32_nocache", run(arr), 200, batches),
    ]
    base = rs[2]["median_us"]
    for r in rs[:2]:
        r["ns_per_token"] = (r["median_us"] - base) * 1e3 / n_tok
    return rs


TARGETS = {
    "decode_step_256": 10.0,
    "decode_step_256_nocsr": 10.0,
    "admit_4096": 5.0,
    "admit_4096_nocache": 5.0,
    "admit_4096_cached": 10.0,
    "serve_decode_256_lists": 10.0,
    "serve_decode_256_numpy": 10.0,
}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--batches", type=int, default=41, help="timed batches per case (default 41)")
    ap.add_argument("--quick", action="store_true", help="5 batches per case (a smoke run)")
    ap.add_argument("--only", help="comma-separated groups: decode,admit,overhead,serve,convert")
    args = ap.parse_args(argv)
    batches = 5 if args.quick else args.batches

    groups = {
        "decode": lambda: bench_decode(batches) + bench_decode(batches, csr=False),
        "serve": lambda: bench_serve(batches),
        "convert": lambda: bench_convert(batches),
        "admit": lambda: bench_admit(batches),
        "overhead": lambda: bench_overhead(batches),
        "to_device": lambda: bench_to_device(batches),
    }
    chosen = args.only.split(",") if args.only else list(groups)
    results = [r for g in chosen for r in groups[g]()]
    print(f"{'case':<32} {'median µs':>10} {'p10':>8} {'p90':>8} {'target µs':>10}")
    for r in results:
        t = TARGETS.get(r["name"])
        r["target_us"] = t
        tgt = f"≤ {t:g}" if t is not None else "—"
        extra = f"  ({r['ns_per_token']:.2f} ns/token)" if "ns_per_token" in r else ""
        print(
            f"{r['name']:<32} {r['median_us']:>10.2f} {r['p10_us']:>8.2f} {r['p90_us']:>8.2f}"
            f" {tgt:>10}{extra}"
        )
    if args.json:
        meta = {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "machine": platform.machine(),
            "batches": batches,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
