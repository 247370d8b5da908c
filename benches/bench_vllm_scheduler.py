"""vLLM's own Scheduler step (schedule + update_from_output) with vLLM's KVCacheManager vs
pagedkv's drop-in manager (CPU only, no model).

The trace: a serving load that keeps ``--seqs`` requests running (``max_num_seqs``), prefix
caching on. Prompts are one of 8 shared system prefixes plus a unique suffix (admissions hit the
prefix cache), outputs are ``--min-out``..``--max-out`` tokens; a finished request is replaced by
a new arrival, so every step also admits (chunked prefill within ``--max-batched-tokens``) and
frees. The model is a fake ``ModelRunnerOutput`` built as vLLM's scheduler tests build one: one
sampled token per request whose prefill is done, none for a partial prefill chunk.

Both schedulers are vLLM's unchanged ``Scheduler``, built by vLLM's test helper
``tests/v1/core/utils.py:create_scheduler`` from the 0.33.0 sdist (``--vllm-src``), run the same
seeded trace in one process, interleaved step by step; each step's wall time is
``schedule()`` + ``update_from_output()``. Prints a table (medians) and writes JSON.

Needs what ``scripts/test_vllm.sh`` sets up (vLLM in ``.vllm-test/site``, the sdist, an offline
model config for ``facebook/opt-125m`` in ``.vllm-test/hf``)::

    VLLM_TARGET_DEVICE=cpu HF_HOME=.vllm-test/hf HF_HUB_OFFLINE=1 \\
        PYTHONPATH=.vllm-test/site:python python benches/bench_vllm_scheduler.py
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import random
import statistics
import sys
import time
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=6000)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=128)
    ap.add_argument("--min-out", type=int, default=32)
    ap.add_argument("--max-out", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-src", default=".vllm-test/vllm-0.33.0")
    ap.add_argument("--json", default="bench_vllm_scheduler.json")
    ap.add_argument("--profile", action="store_true", help="where each scheduler's time goes")
    ap.add_argument("--split", action="store_true",
                    help="also time the KV cache manager's calls inside the step (a second, "
                         "timer-wrapped run): the step without them bounds any manager's gain")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, os.path.abspath(args.vllm_src))
    from tests.v1.core.utils import create_scheduler  # vLLM's own test helper
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched import scheduler as sched_mod
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from pagedkv.vllm.manager import DropInKVCacheManager, PagedKVCacheManager

    init_none_hash(sha256)
    hasher = get_request_block_hasher(args.block_size, sha256)

    def build(manager_cls: Any) -> Any:
        saved = sched_mod.KVCacheManager
        if manager_cls is not None:  # None: vLLM's own manager
            sched_mod.KVCacheManager = manager_cls
        try:
            return create_scheduler(
                max_num_seqs=args.seqs,
                max_num_batched_tokens=args.max_batched_tokens,
                max_model_len=2048,
                enable_prefix_caching=True,
                num_blocks=args.num_blocks,
                block_size=args.block_size,
            )
        finally:
            sched_mod.KVCacheManager = saved

    class Trace:
        def __init__(self) -> None:
            rng = random.Random(args.seed)
            self.rng = rng
            self.prefixes = [
                [rng.randrange(32000) for _ in range(args.prefix_len)] for _ in range(8)
            ]
            self.n = 0

        def next(self) -> tuple[str, list[int], int]:
            self.n += 1
            rng = self.rng
            prompt = rng.choice(self.prefixes) + [
                rng.randrange(32000) for _ in range(args.suffix_len)
            ]
            return f"r{self.n}", prompt, rng.randint(args.min_out, args.max_out)

    class Runner:
        def __init__(self, manager_cls: Any) -> None:
            self.s = build(manager_cls)
            self.trace = Trace()
            self.tok = random.Random(args.seed + 1)
            self.finished = 0
            for _ in range(args.seqs + args.seqs // 4):
                self.add()

        def add(self) -> None:
            rid, prompt, out = self.trace.next()
            sp = SamplingParams(max_tokens=out, ignore_eos=True)
            sp.update_from_generation_config({}, eos_token_id=None)
            self.s.add_request(
                Request(
                    request_id=rid,
                    prompt_token_ids=prompt,
                    sampling_params=sp,
                    pooling_params=None,
                    block_hasher=hasher,
                )
            )

        def step(self) -> tuple[int, int]:
            """One engine step; returns (wall ns of schedule + update, running count). The fake
            model output is built between the two, outside the timed part."""
            s = self.s
            before = len(s.requests)
            t0 = time.perf_counter_ns()
            out = s.schedule()
            t1 = time.perf_counter_ns()
            ids = list(out.num_scheduled_tokens)
            reqs = s.requests
            tok = self.tok.randrange(32000)
            sampled = [
                [tok] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in ids
            ]
            mro = ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled,
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=[],
            )
            t2 = time.perf_counter_ns()
            eco = s.update_from_output(out, mro)
            dt = time.perf_counter_ns() - t2 + t1 - t0
            del eco
            done = before - len(s.requests)  # finished requests leave the scheduler
            self.finished += done
            for _ in range(done):
                self.add()
            return dt, len(s.running)

    runners = {"vllm": Runner(None), "pagedkv": Runner(DropInKVCacheManager)}
    assert not isinstance(runners["vllm"].s.kv_cache_manager, PagedKVCacheManager)
    assert isinstance(runners["pagedkv"].s.kv_cache_manager, PagedKVCacheManager)
    assert runners["pagedkv"].s.kv_cache_manager.fast
    times: dict[str, list[int]] = {n: [] for n in runners}
    running: dict[str, list[int]] = {n: [] for n in runners}
    for i in range(args.warmup + args.steps):
        for name, r in runners.items():  # interleaved: both see the same machine noise
            t, nrun = r.step()
            if i >= args.warmup:
                times[name].append(t)
                running[name].append(nrun)
    res: dict[str, Any] = {}
    for name, r in runners.items():
        ts = sorted(times[name])
        m = r.s.kv_cache_manager
        res[name] = {
            "median_us": statistics.median(ts) / 1e3,
            "p90_us": ts[int(0.9 * (len(ts) - 1))] / 1e3,
            "mean_us": statistics.fmean(ts) / 1e3,
            "median_running": statistics.median(running[name]),
            "finished": r.finished,
            "usage_end": m.usage,
        }
    base = res["vllm"]["median_us"]
    print(
        f"vLLM Scheduler step (schedule + update_from_output), {args.seqs} max running, "
        f"{args.steps} steps (+{args.warmup} warm-up), block {args.block_size}, "
        f"{args.num_blocks} blocks, prefix caching on, "
        f"CPU {platform.processor() or platform.machine()}"
    )
    print(f"{'KV cache manager':<18} {'median µs/step':>15} {'p90 µs':>10} {'speed-up':>9} "
          f"{'running':>8} {'finished':>9}")
    for name, r in res.items():
        print(f"{name:<18} {r['median_us']:>15.0f} {r['p90_us']:>10.0f} "
              f"{base / r['median_us']:>8.2f}x {r['median_running']:>8.0f} {r['finished']:>9}")
    same = res["vllm"]["finished"] == res["pagedkv"]["finished"]
    print(f"same schedule on both (finished counts agree): {same}")
    if args.split:
        calls = ("allocate_slots", "free", "get_computed_blocks", "get_blocks", "get_block_ids",
                 "new_step_starts", "take_events", "remove_skipped_blocks", "take_new_block_ids",
                 "cache_blocks", "take_kv_cache_block_copies", "take_boundary_state_offloads",
                 "make_prefix_cache_stats", "get_num_common_prefix_blocks", "create_kv_cache_blocks",
                 "empty_kv_cache_blocks", "evict_blocks")
        spent = {n: [0] for n in runners}
        split_runners = {"vllm": Runner(None), "pagedkv": Runner(DropInKVCacheManager)}
        for name, r in split_runners.items():
            m = r.s.kv_cache_manager
            acc = spent[name]
            for c in calls:
                f = getattr(m, c, None)
                if f is None or not callable(f):
                    continue

                def timed(*a: Any, _f: Any = f, _acc: list[int] = acc, **k: Any) -> Any:
                    t = time.perf_counter_ns()
                    try:
                        return _f(*a, **k)
                    finally:
                        _acc[0] += time.perf_counter_ns() - t
                setattr(m, c, timed)
        steps: dict[str, list[tuple[int, int]]] = {n: [] for n in split_runners}
        for i in range(args.warmup + args.steps):
            for name, r in split_runners.items():
                spent[name][0] = 0
                t, _ = r.step()
                if i >= args.warmup:
                    steps[name].append((t, spent[name][0]))
        print(f"\nthe same steps again, the manager's calls timed ({', '.join(calls[:4])}, ...): "
              "medians, µs")
        print(f"{'KV cache manager':<18} {'step':>8} {'in manager':>11} {'step without':>13} "
              f"{'bound':>7}")
        for name, v in steps.items():
            st = statistics.median(t for t, _ in v) / 1e3
            mg = statistics.median(m for _, m in v) / 1e3
            rest = statistics.median(t - m for t, m in v) / 1e3
            res[name].update({"split_step_us": st, "split_manager_us": mg,
                              "split_without_manager_us": rest})
            print(f"{name:<18} {st:>8.0f} {mg:>11.0f} {rest:>13.0f} {st / rest:>6.2f}x")
        print("bound: the step over the step without the manager's calls, i.e. the speed-up a "
              "manager costing nothing would give")
    if args.profile:
        for name, cls in (("vllm", None), ("pagedkv", DropInKVCacheManager)):
            r = Runner(cls)
            for _ in range(args.warmup):
                r.step()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(100):
                r.step()
            prof.disable()
            st = pstats.Stats(prof)
            total = st.total_tt  # type: ignore[attr-defined]
            in_kv = 0.0
            for (file, _, fn), (_, _, _, ct, _) in st.stats.items():  # type: ignore[attr-defined]
                if file.endswith(("kv_cache_manager.py", "vllm/manager.py")) and fn in (
                    "allocate_slots", "free", "get_computed_blocks", "get_blocks",
                    "get_block_ids", "new_step_starts", "take_events", "remove_skipped_blocks",
                    "take_new_block_ids", "cache_blocks", "take_kv_cache_block_copies",
                    "take_boundary_state_offloads", "make_prefix_cache_stats", "usage",
                ):
                    in_kv += ct
            res[name]["profile_kv_manager_share"] = in_kv / total
            print(f"\n== {name}: 100 steps under cProfile, {total * 1e3:.0f} ms, "
                  f"{in_kv * 1e3:.0f} ms ({100 * in_kv / total:.1f}%) in KVCacheManager calls")
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(10)
            print("\n".join(s.getvalue().splitlines()[6:18]))
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "results": res}, f, indent=2)


if __name__ == "__main__":
    main()
