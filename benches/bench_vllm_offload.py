"""The scheduler side of vLLM's KV offloading per prompt: pagedkv's OffloadingManager against
vLLM's ``CPUOffloadingManager`` (LRU and ARC), CPU only, no model, one process.

Each prompt is ``--prompt-tokens`` tokens (``--block-size`` per block: 4096 / 16 = 256 offload
keys, vLLM's ``OffloadKey`` = 32 hash bytes + 4-byte group). The calls per prompt are the ones
vLLM's ``OffloadingConnector`` scheduler makes, with a ``ReqContext`` per request carrying every
key's token position (as the connector records them):

- ``store``: ``on_new_request``, ``prepare_store`` of the prompt's 256 new keys, ``complete_store``,
  ``on_request_finished``, in a tier with room for every prompt of the run (no eviction);
- ``load``: ``on_new_request``, ``lookup`` of each of the 256 keys (all hits), ``prepare_load``,
  ``touch``, ``complete_load``, ``on_request_finished``;
- ``load-scattered``: as ``load``, after a churn (every chunk touched alone in a random order,
  then a quarter of a tier of new prompts stored), so each prompt's chunks are spread over the tier
  instead of adjacent (vLLM's ARC sits this one out: after the churn it evicts each new prompt to
  store the next);
- ``evict``: as ``store``, in a tier full of ready chunks: each ``prepare_store`` evicts 256.

Each manager is built with ``--chunks`` chunks (``store``: enough for the run) and warmed; the figure is the median over
``--reps`` prompts of the wall time of one prompt's calls (the managers take turns, prompt by
prompt, so they see the same machine load), in microseconds, and per block. Prints a table and
writes JSON (``--json``).

Needs vLLM 0.33 importable (what ``scripts/test_vllm.sh`` installs)::

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=.vllm-test/site:python \\
        .venv/bin/python benches/bench_vllm_offload.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from typing import Any, Callable, Dict, List


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=4096, help="chunks in the host tier")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="the churn's shuffle (load-scattered)")
    ap.add_argument("--json", default="bench_vllm_offload.json")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from pagedkv.vllm.offload import PagedKVOffloadingManager

    nblk = args.prompt_tokens // args.block_size
    builders: Dict[str, Callable[[], Any]] = {
        "pagedkv": lambda: PagedKVOffloadingManager(args.chunks, enable_events=True),
        "vllm-lru": lambda: CPUOffloadingManager(args.chunks, "lru", enable_events=True),
        "vllm-arc": lambda: CPUOffloadingManager(args.chunks, "arc", enable_events=True),
    }
    counter = [0]

    def prompt_keys() -> List[bytes]:
        counter[0] += 1
        base = counter[0].to_bytes(8, "little")
        return [make_offload_key(base + i.to_bytes(24, "little"), 0) for i in range(nblk)]

    def ctx(keys: List[bytes]) -> Any:
        counter[0] += 1
        rc = ReqContext(req_id=f"r{counter[0]}")
        for i, k in enumerate(keys):
            rc.set_offload_key_position(k, (i + 1) * args.block_size)  # type: ignore[arg-type]
        return rc

    # The timed calls; what they answered is checked after the clock stops (check()).
    def store(m: Any, keys: List[bytes], rc: Any) -> Any:
        m.on_new_request(rc)
        out = m.prepare_store(keys, rc)
        m.complete_store(keys, rc)
        m.on_request_finished(rc)
        for _ in m.take_events():
            pass
        return out

    def load(m: Any, keys: List[bytes], rc: Any) -> Any:
        m.on_new_request(rc)
        look = m.lookup
        found = [look(k, rc) for k in keys]  # the connector asks key by key
        m.prepare_load(keys, rc)
        m.touch(keys, rc)
        m.complete_load(keys, rc)
        m.on_request_finished(rc)
        return found

    def check(scenario: str, got: Any, keys: List[bytes]) -> None:
        if scenario.startswith("load"):
            assert len(got) == len(keys) and all(r is LookupResult.HIT for r in got)
        else:
            assert got is not None and len(got.keys_to_store) == len(keys)

    results: Dict[str, Dict[str, float]] = {}
    for scenario in ("store", "load", "load-scattered", "evict"):
        if scenario == "store":
            n = (args.warmup + args.reps + 1) * nblk
            managers = {"pagedkv": PagedKVOffloadingManager(n, enable_events=True),
                        "vllm-lru": CPUOffloadingManager(n, "lru", enable_events=True),
                        "vllm-arc": CPUOffloadingManager(n, "arc", enable_events=True)}
        else:
            # ARC sits out the scattered load: the churn's touches move every old chunk to its
            # frequent list, so ARC evicts each new prompt to store the next one.
            managers = {name: b() for name, b in builders.items()
                        if not (scenario == "load-scattered" and name == "vllm-arc")}
        pools: Dict[str, List[List[bytes]]] = {name: [] for name in managers}
        # Setup: "load" and "evict" start from a tier full of ready chunks.
        if scenario in ("load", "load-scattered", "evict"):
            for _ in range(args.chunks // nblk):
                keys = prompt_keys()
                for name, m in managers.items():
                    store(m, keys, ctx(keys))
                    pools[name].append(keys)
        if scenario == "load-scattered":
            # Churn: every chunk touched on its own in a random order (the eviction order
            # shuffled), then a quarter of a tier of new prompts stored: each takes its chunks from
            # all over the tier, so a prompt's keys no longer sit in adjacent chunks.
            shuffled = [k for p in pools["pagedkv"] for k in p]
            random.Random(args.seed).shuffle(shuffled)
            fresh = [prompt_keys() for _ in range(max(1, args.chunks // nblk // 4))]
            for name, m in managers.items():
                for k in shuffled:
                    rc = ctx([k])
                    m.on_new_request(rc)
                    m.touch([k], rc)
                    m.on_request_finished(rc)
                for keys in fresh:
                    store(m, keys, ctx(keys))
                pools[name] = fresh
        times: Dict[str, List[float]] = {name: [] for name in managers}
        for rep in range(args.warmup + args.reps):
            if scenario.startswith("load"):
                keys = pools["pagedkv"][rep % len(pools["pagedkv"])]
            else:
                keys = prompt_keys()
            for name, m in managers.items():
                rc = ctx(keys)
                run = load if scenario.startswith("load") else store
                t0 = time.perf_counter()
                got = run(m, keys, rc)
                t = time.perf_counter() - t0
                check(scenario, got, keys)
                if rep >= args.warmup:
                    times[name].append(t)
        results[scenario] = {name: statistics.median(v) * 1e6 for name, v in times.items()}

    print(f"\nper {args.prompt_tokens}-token prompt ({nblk} blocks), {args.chunks}-chunk tier, "
          f"median of {args.reps}; us (us/block)")
    print(f"{'scenario':<15}" + "".join(f"{n:>22}" for n in builders)
          + "".join(f"{'x vs ' + n:>16}" for n in builders if n != "pagedkv"))
    for scenario, r in results.items():
        row = f"{scenario:<15}" + "".join(
            f"{r[n]:>12.1f} ({r[n] / nblk:6.2f})" if n in r else f"{'-':>22}" for n in builders)
        row += "".join(f"{r[n] / r['pagedkv']:>15.1f}x" if n in r else f"{'-':>16}"
                       for n in builders if n != "pagedkv")
        print(row)
    with open(args.json, "w") as f:
        json.dump({"prompt_tokens": args.prompt_tokens, "blocks": nblk, "chunks": args.chunks,
                   "reps": args.reps, "machine": platform.machine(),
                   "cpus": os.cpu_count(), "median_us": results}, f, indent=1)


if __name__ == "__main__":
    main()
