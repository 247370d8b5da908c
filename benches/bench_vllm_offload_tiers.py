"""Cascade and promotion throughput of vLLM's tiered offloading with pagedkv's disk and Redis tiers.

vLLM 0.33's real ``TieringOffloadingSpec`` / ``TieringOffloadingManager`` on the CPU, as
``tests/test_vllm_offload_tiers.py`` drives them: ``--chunks`` chunks of ``--chunk-kib`` KiB of
random bytes are stored into the primary (CPU) tier, cascaded to the secondary tier in jobs of
``--job-chunks`` keys (the time from ``complete_store`` until every cascade job has finished), the
primary tier is reset, and every key is looked up and promoted back (the time from the first
``lookup`` until every key is a ``HIT``); the promoted bytes are checked against the stored ones.
The manager is polled every 0.5 ms, as a scheduler stepping fast would.

Tiers: ``pagedkv-disk`` (``PagedKVDiskTier`` in a fresh directory under ``--dir``), vLLM's own
``fs`` tier in the same place with the same thread count (its O_DIRECT I/O bypasses the page
cache where the file system allows; pagedkv's reads hit the page cache right after the writes),
and ``pagedkv-redis`` when ``--redis-url`` is given (``PAGEDKV_TIER_SECRET`` set for it). Each is
run ``--repeat`` times; the table gives the median and the best, in GiB/s and ms.

Usage::

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=$VLLM_SITE:python python benches/bench_vllm_offload_tiers.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

import numpy as np


def build(tier: Dict[str, Any], chunks: int, chunk_bytes: int, engine: str) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, tuple(f"model.layers.{i}.attn" for i in range(32)), 0),),
        worker_kv_bytes_per_block=chunk_bytes, enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec",
                      "cpu_bytes_to_use": chunks * chunk_bytes, "secondary_tiers": [tier]},
        engine_id=engine, model=OffloadingModelConfig(name="bench/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False),
    )
    spec = TieringOffloadingSpec(cfg)
    return spec, spec.get_manager()


def one_run(tier: Dict[str, Any], args: argparse.Namespace, run: int,
            name: str) -> Dict[str, float]:
    from vllm.v1.kv_offload.base import (
        LookupResult,
        ReqContext,
        ScheduleEndContext,
        make_offload_key,
    )

    chunk_bytes = args.chunk_kib * 1024
    step = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    spec, m = build(tier, args.chunks, chunk_bytes, f"bench-{os.getpid()}-{name}-{run}")
    try:
        view = m.primary_tier.get_kv_memoryview()
        rows = np.asarray(view).view(np.uint8).reshape(len(view), -1)
        keys = [make_offload_key((run * 1_000_000 + i).to_bytes(32, "big"), 0)
                for i in range(args.chunks)]
        data = np.random.default_rng(run).integers(0, 256, size=(args.chunks, chunk_bytes),
                                                   dtype=np.uint8)

        def settle() -> None:
            while m.has_pending_work():
                m.on_schedule_end(step)
                time.sleep(0.0005)
            m.on_schedule_end(step)

        # The GPU -> primary stores (not timed), then the cascades (timed).
        jobs = [keys[i : i + args.job_chunks] for i in range(0, args.chunks, args.job_chunks)]
        ctxs = []
        for j, batch in enumerate(jobs):
            ctx = ReqContext(req_id=f"s{j}")
            m.on_new_request(ctx)
            out = m.prepare_store(batch, ctx)
            assert out is not None
            first = keys.index(batch[0])
            for i, c in enumerate(out.store_spec.chunk_ids):
                rows[int(c)] = data[first + i]
            ctxs.append(ctx)
        t0 = time.perf_counter()
        for batch, ctx in zip(jobs, ctxs):
            m.complete_store(batch, ctx)
        settle()
        cascade = time.perf_counter() - t0
        for ctx in ctxs:
            m.on_request_finished(ctx)
        settle()

        m.reset_cache()
        m.on_reset_flushed()
        rows[:] = 0
        ctx = ReqContext(req_id="load")
        m.on_new_request(ctx)
        t0 = time.perf_counter()
        while True:
            res = [m.lookup(k, ctx) for k in keys]
            if all(r is LookupResult.HIT for r in res):
                break
            assert LookupResult.MISS not in res, "a stored chunk was not found"
            m.on_schedule_end(step)
            time.sleep(0.0005)
        promote = time.perf_counter() - t0
        load = m.prepare_load(keys, ctx)
        got = np.stack([rows[int(c)] for c in load.chunk_ids])
        assert np.array_equal(got, data), "promoted bytes differ from the stored ones"
        m.complete_load(keys, ctx)
        m.on_request_finished(ctx)
        del rows, view
        return {"cascade_s": cascade, "promote_s": promote}
    finally:
        m.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--chunk-kib", type=int, default=1024, help="bytes of one chunk, in KiB")
    ap.add_argument("--job-chunks", type=int, default=16, help="keys per cascade job")
    ap.add_argument("--threads", type=int, default=2, help="I/O threads of each tier")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="parent of the cache directories (default: temp)")
    ap.add_argument("--redis-url", default=None, help="also run pagedkv's Redis tier against it")
    ap.add_argument("--no-fs", action="store_true", help="skip vLLM's own fs tier")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    parent = tempfile.mkdtemp(prefix="pagedkv-bench-tiers-", dir=args.dir)
    os.chmod(parent, 0o700)
    tiers: List[tuple[str, Any]] = [
        ("pagedkv-disk", lambda r: {
            "type": "PagedKVDiskTier", "module_path": "pagedkv.vllm.offload_tiers",
            "path": os.path.join(parent, f"pkv{r}"), "threads": args.threads,
            "capacity_bytes": 2 * args.chunks * (args.chunk_kib + 8) * 1024}),
    ]
    if not args.no_fs:
        tiers.append(("vllm-fs", lambda r: {
            "type": "fs", "root_dir": os.path.join(parent, f"fs{r}"),
            "n_read_threads": args.threads, "n_write_threads": args.threads}))
    if args.redis_url:
        tiers.append(("pagedkv-redis", lambda r: {
            "type": "PagedKVRemoteTier", "module_path": "pagedkv.vllm.offload_tiers",
            "url": args.redis_url, "timeout_s": 5.0, "threads": args.threads}))
    total = args.chunks * args.chunk_kib * 1024
    results: Dict[str, List[Dict[str, float]]] = {}
    try:
        for r in range(args.repeat):
            for name, make in tiers:
                results.setdefault(name, []).append(one_run(make(r), args, r, name))
    finally:
        shutil.rmtree(parent, ignore_errors=True)

    print(f"\n{args.chunks} chunks x {args.chunk_kib} KiB = {total / 2**20:.0f} MiB, "
          f"cascade jobs of {args.job_chunks} keys, {args.threads} I/O threads, {args.repeat} runs")
    print(f"{'tier':<15}{'cascade GiB/s':>16}{'(best)':>9}{'ms':>9}{'promote GiB/s':>16}"
          f"{'(best)':>9}{'ms':>9}")
    summary = {}
    for name, runs in results.items():
        c = [x["cascade_s"] for x in runs]
        p = [x["promote_s"] for x in runs]
        gib = total / 2**30
        row = {"cascade_gib_s": gib / statistics.median(c), "cascade_best": gib / min(c),
               "cascade_ms": 1e3 * statistics.median(c),
               "promote_gib_s": gib / statistics.median(p),
               "promote_best": gib / min(p), "promote_ms": 1e3 * statistics.median(p)}
        summary[name] = row
        print(f"{name:<15}{row['cascade_gib_s']:>16.2f}{row['cascade_best']:>9.2f}"
              f"{row['cascade_ms']:>9.0f}{row['promote_gib_s']:>16.2f}{row['promote_best']:>9.2f}"
              f"{row['promote_ms']:>9.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": summary, "runs": results}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
