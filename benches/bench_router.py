"""Cache-aware vs round-robin routing over three `pagedkv serve` replicas (tiny Llama, CPU).

Multi-tenant workload: 16 system prompts (64 tokens, 4 blocks of 16), many users each (a distinct
16-token question after the system prompt), streamed with a fixed concurrency. Each policy gets
fresh replicas (empty caches) whose KV pool holds about a third of the system prompts' blocks
beside the running requests, so a replica that sees every tenant (round robin) keeps evicting them
and one that sees a third of them (cache-aware) keeps them. Reported per policy: prefix hit ratio
(prompt tokens served from cache, from the replicas' /metrics), TTFT p50/p99, throughput, and
whether every output equals the other policy's (greedy).

    PYTHONPATH=python python benches/bench_router.py [--users 6] [--json out.json]

``--index`` measures the router's index instead, the previous implementation (loaded from git,
``--baseline-ref``) beside the current one: bytes per indexed (block, tier) entry (tracemalloc,
200 000 GPU entries), and the latency of requests placed through a real router (uvicorn, httpx,
a stub replica) while one batch of 10^6 stored hashes is applied from another thread, as a
subscriber thread does.

    PYTHONPATH=python python benches/bench_router.py --index [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

import httpx
import uvicorn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from tiny_llama import save_tiny_llama  # noqa: E402

from pagedkv.router import ReplicaSpec, Router, build_app  # noqa: E402

KEY = 0xB0BA
BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replicas(model: str, n: int, num_blocks: int) -> List[Dict[str, Any]]:
    reps = []
    for _ in range(n):
        port, ev, rp = free_port(), free_port(), free_port()
        cmd = [sys.executable, "-m", "pagedkv", "serve", model, "--device", "cpu",
               "--port", str(port), "--num-blocks", str(num_blocks), "--block-size", str(BLOCK),
               "--max-num-seqs", "8", "--hash-seed", str(KEY), "--served-model-name", "tiny",
               "--kv-events-endpoint", f"tcp://*:{ev}",
               "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rp}", "--log-level", "warning"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        reps.append(dict(proc=proc, url=f"http://127.0.0.1:{port}",
                         events=f"tcp://127.0.0.1:{ev}", replay=f"tcp://127.0.0.1:{rp}"))
    deadline = time.monotonic() + 120
    for r in reps:
        while True:
            try:
                if httpx.get(r["url"] + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "replica did not start"
            time.sleep(0.2)
    return reps


def prefix_metrics(reps: List[Dict[str, Any]]) -> tuple[float, float]:
    q = h = 0.0
    for r in reps:
        for line in httpx.get(r["url"] + "/metrics").text.splitlines():
            if line.startswith("pagedkv_prefix_cache_queries_total"):
                q += float(line.split()[-1])
            elif line.startswith("pagedkv_prefix_cache_hits_total"):
                h += float(line.split()[-1])
    return q, h


async def one(client: httpx.AsyncClient, url: str, prompt: List[int]) -> tuple[float, str]:
    t0 = time.perf_counter()
    ttft = None
    text = []
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return ttft or 0.0, "".join(text)


async def drive(url: str, prompts: List[List[int]], concurrency: int) -> tuple[list, list, float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def run(p: List[int]) -> tuple[float, str]:
            async with sem:
                return await one(client, url, p)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(run(p) for p in prompts))
        wall = time.perf_counter() - t0
    return [r[0] for r in res], [r[1] for r in res], wall


def pct(xs: List[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def run_policy(model: str, policy: str, prompts: List[List[int]], args: Any) -> Dict[str, Any]:
    reps = start_replicas(model, 3, args.num_blocks)
    try:
        router = Router([ReplicaSpec(r["url"], r["events"], r["replay"]) for r in reps],
                        block_size=BLOCK, hash_seed=KEY, policy=policy, health_interval_s=1.0)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        server = uvicorn.Server(uvicorn.Config(build_app(router), log_level="warning"))
        th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        th.start()
        while not server.started:
            time.sleep(0.05)
        time.sleep(0.5)
        q0, h0 = prefix_metrics(reps)
        ttfts, texts, wall = asyncio.run(drive(url, prompts, args.concurrency))
        q1, h1 = prefix_metrics(reps)
        server.should_exit = True
        th.join(10)
        return dict(policy=policy, requests=len(prompts), hit_ratio=(h1 - h0) / max(q1 - q0, 1),
                    ttft_p50_ms=pct(ttfts, 50) * 1e3, ttft_p99_ms=pct(ttfts, 99) * 1e3,
                    req_per_s=len(prompts) / wall, wall_s=wall,
                    routed=[r.routed for r in router.replicas], texts=texts)
    finally:
        for r in reps:
            r["proc"].terminate()
        for r in reps:
            r["proc"].wait(30)


BASELINE_REF = "89f02e5"  # the index before it was made compact, TTL'd and sliced


def load_baseline_index(ref: str) -> Any:
    """The PrefixIndex class of ``ref``'s python/pagedkv/router/index.py (None without git)."""
    import importlib.util

    root = os.path.join(os.path.dirname(__file__), "..")
    try:
        src = subprocess.run(["git", "show", f"{ref}:python/pagedkv/router/index.py"], cwd=root,
                             capture_output=True, check=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    spec = importlib.util.spec_from_loader("pagedkv.router._baseline_index", loader=None)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    mod.__package__ = "pagedkv.router"
    exec(compile(src, f"{ref}:index.py", "exec"), mod.__dict__)
    return mod.PrefixIndex


def stored_batch(hashes: List[int], medium: str = "GPU") -> Any:
    from pagedkv.events import BlockStored, KVEventBatch, hash_to_wire

    return KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=[hash_to_wire(h) for h in hashes], parent_block_hash=None, token_ids=[],
        block_size=BLOCK, lora_id=None, medium=medium, lora_name=None)])


def bytes_per_entry(index_cls: Any, n: int) -> float:
    import gc
    import tracemalloc

    rng = random.Random(1)
    batch = stored_batch([rng.getrandbits(128) for _ in range(n)])
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = index_cls()
    index.apply(0, batch)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert index.blocks(0) == n
    return (after - before) / n


def latency_during_batch(index_cls: Any, n: int) -> Dict[str, Any]:
    """Requests through a real router while one n-hash batch is applied on another thread."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from pagedkv import hash_prompt

    stub = FastAPI()

    @stub.post("/v1/completions")
    async def completions() -> Any:
        return JSONResponse({"choices": [{"text": ""}]})

    @stub.get("/health")
    async def health() -> Any:
        return JSONResponse({})

    def serve(app: Any) -> tuple[Any, str, threading.Thread]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        th.start()
        while not server.started:
            time.sleep(0.02)
        return server, f"http://127.0.0.1:{sock.getsockname()[1]}", th

    stub_server, stub_url, stub_th = serve(stub)
    router = Router([ReplicaSpec(stub_url)], block_size=BLOCK, hash_seed=KEY,
                    health_interval_s=3600)
    router.index = index_cls()
    prompt = list(range(3, 3 + 4 * BLOCK + 1))
    router.index.apply(0, stored_batch(hash_prompt(prompt, BLOCK, KEY)))
    front, url, front_th = serve(build_app(router))
    big = stored_batch(list(range(10, 10 + n)))
    done = threading.Event()
    span: Dict[str, float] = {}

    def apply() -> None:
        span["t0"] = time.perf_counter()
        router._on_batch(0, big)
        span["t1"] = time.perf_counter()
        done.set()

    async def requests() -> List[tuple[float, float]]:
        out = []
        async with httpx.AsyncClient(timeout=120) as client:
            for _ in range(5):  # warm up
                await client.post(url + "/v1/completions", json={"prompt": prompt})
            threading.Thread(target=apply, daemon=True).start()
            while not done.is_set():
                t0 = time.perf_counter()
                r = await client.post(url + "/v1/completions", json={"prompt": prompt})
                assert r.status_code == 200
                out.append((t0, time.perf_counter() - t0))
        return out

    lat = asyncio.run(requests())
    during = [d for t0, d in lat if t0 < span["t1"]]
    front.should_exit = stub_server.should_exit = True
    front_th.join(10)
    stub_th.join(10)
    return dict(batch_apply_s=span["t1"] - span["t0"], requests=len(during),
                worst_ms=max(during) * 1e3, p50_ms=pct(during, 50) * 1e3,
                matched=router.stats.matched_blocks)


def index_bench(args: Any) -> None:
    from pagedkv.router import PrefixIndex

    impls = []
    baseline = load_baseline_index(args.baseline_ref)
    if baseline is None:
        print(f"(no baseline: git show {args.baseline_ref} failed)")
    else:
        impls.append((f"before ({args.baseline_ref})", baseline))
    impls.append(("after", PrefixIndex))
    rows = []
    for name, cls in impls:
        row: Dict[str, Any] = dict(impl=name, bytes_per_entry=bytes_per_entry(cls, args.entries))
        row.update(latency_during_batch(cls, args.batch_hashes))
        rows.append(row)
        print(f"measured {name}", flush=True)
    print(f"{'index':<18} {'B/entry':>8} {'batch apply s':>13} {'requests':>8} "
          f"{'worst ms':>9} {'p50 ms':>7}")
    for r in rows:
        print(f"{r['impl']:<18} {r['bytes_per_entry']:>8.1f} {r['batch_apply_s']:>13.2f} "
              f"{r['requests']:>8} {r['worst_ms']:>9.1f} {r['p50_ms']:>7.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"index": rows, "args": vars(args)}, fh, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", action="store_true",
                    help="measure the index (bytes per entry, latency during a giant batch)")
    ap.add_argument("--baseline-ref", default=BASELINE_REF)
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--batch-hashes", type=int, default=1_000_000)
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--num-blocks", type=int, default=48)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.index:
        index_bench(args)
        return
    rng = random.Random(0)
    systems = [[rng.randrange(3, 120) for _ in range(4 * BLOCK)] for _ in range(args.tenants)]
    prompts = [systems[t] + [rng.randrange(3, 120) for _ in range(BLOCK)]
               for _ in range(args.users) for t in range(args.tenants)]
    rng.shuffle(prompts)
    with tempfile.TemporaryDirectory() as d:
        model = save_tiny_llama(d, max_len=256)
        results = [run_policy(model, p, prompts, args) for p in ("round_robin", "prefix")]
    same = results[0]["texts"] == results[1]["texts"]
    print(f"{'policy':<12} {'hit ratio':>9} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
          f"{'req/s':>7}  routed")
    for r in results:
        print(f"{r['policy']:<12} {r['hit_ratio']:>9.3f} {r['ttft_p50_ms']:>11.1f} "
              f"{r['ttft_p99_ms']:>11.1f} {r['req_per_s']:>7.2f}  {r['routed']}")
    print(f"outputs identical across policies: {same}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"results": [{k: v for k, v in r.items() if k != "texts"}
                                   for r in results], "outputs_identical": same,
                       "args": vars(args)}, fh, indent=2)


if __name__ == "__main__":
    main()
