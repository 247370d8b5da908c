"""vLLM's KVCacheManager per-step cost: vLLM's manager on vLLM's BlockPool, on pagedkv's pool, and
pagedkv's whole drop-in manager (CPU only).

The trace: 256 running sequences decode one token per step; a sequence that reaches its output
length is freed and a new one admitted in its place. Prompts share one of 8 system prefixes (so
admissions hit the prefix cache) and end in a unique suffix; the pool is sized so that freed
cached blocks are evicted as new blocks are needed (eviction active). Both managers run the same
seeded trace in one process, interleaved step by step, and each step's wall time (every
get_computed_blocks / allocate_slots / free call of the step, as vLLM's scheduler makes them) is
recorded. The third runner is pagedkv's drop-in manager (pagedkv.vllm.manager), driven by the same
calls. Prints a table and writes JSON. Needs vLLM importable (scripts/test_vllm.sh installs it
into .vllm-test/site): ``PYTHONPATH=.vllm-test/site:python python benches/bench_vllm.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import random
import statistics
import time
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_coordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from pagedkv.vllm.manager import PagedKVCacheManager
from pagedkv.vllm.pool import PagedKVBlockPool, StockBlockPool


POOL_METHODS = {
    "get_new_blocks", "free_blocks", "touch", "get_cached_block", "cache_full_blocks",
    "get_num_free_blocks", "get_usage", "take_events", "emit_cached_block_events",
}


def make_manager(
    pool_cls: type, num_blocks: int, block_size: int, manager_cls: type = KVCacheManager
) -> KVCacheManager:
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    saved = kv_cache_coordinator.BlockPool
    kv_cache_coordinator.BlockPool = pool_cls  # type: ignore[misc]
    try:
        return manager_cls(
            cfg,
            max_model_len=8192,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
        )
    finally:
        kv_cache_coordinator.BlockPool = saved  # type: ignore[misc]


class Trace:
    """A seeded stream of (prompt, output length) pairs."""

    def __init__(self, seed: int, prefix_len: int, suffix_len: int, out_len: tuple[int, int]):
        self.rng = random.Random(seed)
        self.prefixes = [
            [self.rng.randrange(32000) for _ in range(prefix_len)] for _ in range(8)
        ]
        self.suffix_len, self.out_len, self.n = suffix_len, out_len, 0

    def next(self) -> tuple[str, list[int], int]:
        self.n += 1
        prompt = self.rng.choice(self.prefixes) + [
            self.rng.randrange(32000) for _ in range(self.suffix_len)
        ]
        return f"r{self.n}", prompt, self.rng.randint(*self.out_len)


class Runner:
    def __init__(
        self, pool_cls: type, args: argparse.Namespace, manager_cls: type = KVCacheManager
    ) -> None:
        self.m = make_manager(pool_cls, args.num_blocks, args.block_size, manager_cls)
        self.hasher = get_request_block_hasher(args.block_size, sha256)
        self.trace = Trace(args.seed, args.prefix_len, args.suffix_len, (args.min_out, args.max_out))
        self.running: list[tuple[Request, int]] = []
        self.tok = random.Random(args.seed + 1)
        self.hits = self.admitted = 0
        self.prompt_tokens = 0
        for _ in range(args.seqs):
            self.admit()

    def admit(self) -> None:
        rid, prompt, out = self.trace.next()
        sp = SamplingParams(max_tokens=out)
        sp.update_from_generation_config({}, eos_token_id=None)
        req = Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self.hasher,
        )
        blocks, num_hit, _ = self.m.get_computed_blocks(req)[:3]
        new = len(prompt) - num_hit
        got = self.m.allocate_slots(req, new, num_hit, blocks)
        assert got is not None, "pool too small for the trace"
        req.num_computed_tokens = len(prompt)
        self.hits += num_hit
        self.prompt_tokens += len(prompt)
        self.admitted += 1
        self.running.append((req, out))

    def step(self) -> int:
        """One decode step; returns its wall time in ns."""
        t0 = time.perf_counter_ns()
        still: list[tuple[Request, int]] = []
        finished = 0
        for req, out in self.running:
            if self.m.allocate_slots(req, 1) is None:
                raise RuntimeError("out of blocks mid-decode: enlarge --num-blocks")
            req.num_computed_tokens += 1
            req.append_output_token_ids(self.tok.randrange(32000))
            if req.num_output_tokens >= out:
                self.m.free(req)
                finished += 1
            else:
                still.append((req, out))
        self.running = still
        for _ in range(finished):
            self.admit()
        return time.perf_counter_ns() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=5500)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=128)
    ap.add_argument("--min-out", type=int, default=32)
    ap.add_argument("--max-out", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench_vllm.json")
    ap.add_argument("--profile", action="store_true", help="also print where each pool's time goes")
    ap.add_argument(
        "--split",
        action="store_true",
        help="also time allocate_slots(req, 1) alone over the 256 running requests (after 60 "
        "steps; 20 rounds, no token appended between rounds) on each manager",
    )
    args = ap.parse_args()
    init_none_hash(sha256)

    pools = {"vllm": StockBlockPool, "pagedkv": PagedKVBlockPool}
    managers = {
        "vllm": KVCacheManager,
        "pagedkv": KVCacheManager,
        "pagedkv-manager": PagedKVCacheManager,
    }
    runners = {
        name: Runner(pools.get(name, PagedKVBlockPool), args, managers[name]) for name in managers
    }
    times: dict[str, list[int]] = {name: [] for name in runners}
    for i in range(args.warmup + args.steps):
        for name, r in runners.items():  # interleaved: both see the same machine noise
            t = r.step()
            if i >= args.warmup:
                times[name].append(t)
    res: dict[str, Any] = {}
    for name, r in runners.items():
        ts = sorted(times[name])
        pool = r.m.block_pool
        evictions = pool.core_stats()["evictions"] if isinstance(pool, PagedKVBlockPool) else None
        res[name] = {
            "median_us": statistics.median(ts) / 1e3,
            "p90_us": ts[int(0.9 * (len(ts) - 1))] / 1e3,
            "mean_us": statistics.fmean(ts) / 1e3,
            "admitted": r.admitted,
            "prefix_hit_ratio": r.hits / r.prompt_tokens,
            "usage_end": pool.get_usage(),
            "evictions": evictions,
        }
    base = res["vllm"]["median_us"]
    print(f"{args.seqs}-sequence decode, {args.steps} steps (+{args.warmup} warm-up), "
          f"block {args.block_size}, {args.num_blocks} blocks, CPU {platform.processor() or platform.machine()}")
    print(f"{'pool / manager':<16} {'median µs/step':>15} {'p90 µs':>10} {'vs vLLM':>8} "
          f"{'admitted':>9} {'hit ratio':>10} {'evictions':>10}")
    for name, r in res.items():
        ev = "-" if r["evictions"] is None else str(r["evictions"])
        print(f"{name:<16} {r['median_us']:>15.0f} {r['p90_us']:>10.0f} "
              f"{base / r['median_us']:>7.2f}x {r['admitted']:>9} {r['prefix_hit_ratio']:>10.3f} "
              f"{ev:>10}")
    same = all(
        (r["admitted"], r["prefix_hit_ratio"])
        == (res["vllm"]["admitted"], res["vllm"]["prefix_hit_ratio"])
        for r in res.values()
    )
    print(f"same admissions and hits on all three: {same}")
    if args.split:
        print(f"\n{'pool / manager':<16} {'median µs for 256 allocate_slots(req, 1)':>42}")
        for name in managers:
            r = Runner(pools.get(name, PagedKVBlockPool), args, managers[name])
            for _ in range(60):
                r.step()
            ts = []
            for _ in range(20):
                t0 = time.perf_counter_ns()
                for req, _out in r.running:
                    r.m.allocate_slots(req, 1)
                ts.append(time.perf_counter_ns() - t0)
            res[name]["allocate_slots_256_us"] = statistics.median(ts) / 1e3
            print(f"{name:<16} {res[name]['allocate_slots_256_us']:>42.0f}")
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "results": res}, f, indent=2)
    if args.profile:
        for name, cls in pools.items():
            r = Runner(cls, args)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(100):
                r.step()
            prof.disable()
            st = pstats.Stats(prof)
            total = st.total_tt  # type: ignore[attr-defined]
            # Time inside the pool's public methods (cumulative), vs the whole step.
            in_pool: dict[str, float] = {}
            for (file, _, fn), (_, _, _, ct, _) in st.stats.items():  # type: ignore[attr-defined]
                if (file.endswith("core/block_pool.py") or file.endswith("vllm/pool.py")) and (
                    fn in POOL_METHODS
                ):
                    in_pool[fn] = in_pool.get(fn, 0.0) + ct
            pool_s = sum(in_pool.values())
            res[name]["profile_pool_share"] = pool_s / total
            print(f"\n== {name} pool, 100 steps under cProfile: {total * 1e3:.0f} ms in all, "
                  f"{pool_s * 1e3:.0f} ms ({100 * pool_s / total:.1f}%) inside BlockPool methods")
            for fn, t in sorted(in_pool.items(), key=lambda kv: -kv[1]):
                print(f"   {fn:<28} {t * 1e3:8.1f} ms")
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(8)
            print("\n".join(s.getvalue().splitlines()[6:16]))
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": res}, f, indent=2)


if __name__ == "__main__":
    main()
