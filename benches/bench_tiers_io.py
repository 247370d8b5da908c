"""Disk and Redis tier throughput: put/get of 2 MiB blocks (Llama-3-8B dims, block 16).

For each store — :class:`~pagedkv.tiers.DiskStore` in a directory (``--dir``, default a temporary
one) and :class:`~pagedkv.tiers.RemoteStore` against a redis-server on loopback (``--redis-url``, or
one started here on a free port when ``redis-server`` is on PATH) — ``--blocks`` distinct random
blocks of ``--block-bytes`` are

- put one at a time on the caller's thread (per-block latency: median and p99, MB/s),
- read back one at a time with ``get`` (a fresh ``bytes``) and ``get_into`` (into a preallocated
  buffer, as a fetch into a host slot does),
- put and read as a batch through ``put_async`` / ``get_into_async`` on the store's thread pool
  (``--threads``): MB/s of the whole batch.

When the server was started here, two more rows say what a miss costs while it does not answer
(SIGSTOP): the one call that waits for the 50 ms timeout, and the calls during the back-off after it.

The disk figures also include a *cold* read: after an fsync the segment files' pages are dropped
from the page cache (``posix_fadvise(DONTNEED)`` on files this process owns; no root needed), so
``get_into`` (one at a time, then as an async batch) goes to the device. Warm reads are page-cache copies plus the checksum.

Each store is measured ``--reps`` times from scratch; the table shows each figure's median.

Usage: ``PYTHONPATH=python python benches/bench_tiers_io.py [--blocks 128] [--reps 3] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import wait
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from pagedkv.tiers import BlockMeta, DiskStore, RemoteStore, fingerprint
from pagedkv.tiers.secret import TierSecret

#: A throwaway tier secret: the records are authenticated as in production.
SECRET = TierSecret(os.urandom(32).hex().encode(), source="bench")

MIB = 1 << 20
TOKENS = 16


def blocks(n: int, block_bytes: int) -> tuple[List[BlockMeta], List[np.ndarray]]:
    rng = np.random.default_rng(0)
    metas = [
        BlockMeta(int(rng.integers(0, 1 << 63)) << 64 | i, None, 7, rng.integers(0, 128_000, TOKENS))
        for i in range(n)
    ]
    data = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(n)]
    return metas, data


def timed_each(fn: Callable[[int], Any], n: int) -> List[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def summary(name: str, times: List[float], block_bytes: int) -> Dict[str, Any]:
    times_sorted = sorted(times)
    total = sum(times)
    return {
        "op": name,
        "blocks": len(times),
        "mb_s": len(times) * block_bytes / total / 1e6,
        "p50_ms": statistics.median(times) * 1e3,
        "p99_ms": times_sorted[min(len(times) - 1, int(0.99 * len(times)))] * 1e3,
    }


def batch(name: str, submit: Callable[[int], Any], n: int, block_bytes: int) -> Dict[str, Any]:
    t0 = time.perf_counter()
    futures = [submit(i) for i in range(n)]
    wait(futures)
    elapsed = time.perf_counter() - t0
    assert all(f.result() for f in futures), f"{name}: a block was not stored or not read back"
    return {"op": name, "blocks": n, "mb_s": n * block_bytes / elapsed / 1e6, "p50_ms": None, "p99_ms": None}


def run_store(label: str, make: Callable[[], Any], metas: List[BlockMeta], data: List[np.ndarray],
              block_bytes: int, cold: Optional[Callable[[Any], None]] = None) -> List[Dict[str, Any]]:
    n = len(metas)
    rows = []
    out = np.empty(block_bytes, np.uint8)
    with make() as s:
        rows.append(summary("put", timed_each(lambda i: s.put(metas[i], data[i]), n), block_bytes))
        rows.append(summary("get (bytes)", timed_each(lambda i: s.get(metas[i]), n), block_bytes))
        rows.append(summary("get_into", timed_each(lambda i: s.get_into(metas[i], out), n), block_bytes))
        if cold is not None:
            cold(s)
            rows.append(summary("get_into, cold", timed_each(lambda i: s.get_into(metas[i], out), n), block_bytes))
            cold(s)
            many = [np.ones(block_bytes, np.uint8) for _ in range(n)]
            rows.append(batch("get_into_async, cold", lambda i: s.get_into_async(metas[i], many[i]), n, block_bytes))
            del many
        assert s.stats().hits >= 2 * n and s.stats().corrupt == 0
        for i in range(n):
            s.remove(metas[i].block_hash)
        rows.append(batch("put_async batch", lambda i: s.put_async(metas[i], data[i]), n, block_bytes))
        # One destination per read in flight: a buffer two reads share would fail their checks.
        outs = [np.ones(block_bytes, np.uint8) for _ in range(n)]
        rows.append(batch("get_into_async batch", lambda i: s.get_into_async(metas[i], outs[i]), n, block_bytes))
        hashes = [m.block_hash for m in metas[:64]]
        lp = timed_each(lambda i: s.longest_prefix(hashes), 50)
        rows.append({"op": f"longest_prefix({len(hashes)})", "blocks": None, "mb_s": None,
                     "p50_ms": statistics.median(lp) * 1e3, "p99_ms": sorted(lp)[48] * 1e3})
        for m in metas:  # the next run starts empty
            s.remove(m.block_hash)
    for row in rows:
        row["store"] = label
    return rows


def median_of(reps: int, run: Callable[[], List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """Each figure's median over ``reps`` runs (a shared machine's neighbours make single runs noisy)."""
    runs = [run() for _ in range(max(1, reps))]
    rows = []
    for i, row in enumerate(runs[0]):
        merged = dict(row)
        for key in ("mb_s", "p50_ms", "p99_ms"):
            values = [r[i][key] for r in runs if r[i][key] is not None]
            merged[key] = statistics.median(values) if values else None
        merged["reps"] = len(runs)
        rows.append(merged)
    return rows


def drop_page_cache(store: DiskStore) -> None:
    for name in os.listdir(store.path):
        if name.endswith(".pkv"):
            fd = os.open(os.path.join(store.path, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def failure_rows(proc: "subprocess.Popen[bytes]", url: str, fp: bytes, block_bytes: int,
                 meta: BlockMeta, data: np.ndarray) -> List[Dict[str, Any]]:
    """What a miss costs while the server does not answer (SIGSTOP): the call that times out
    (``timeout_s`` = 50 ms, the default) and the calls during the back-off after it."""
    rows = []
    with RemoteStore(url, fp, block_bytes, timeout_s=0.05, backoff_s=60, secret=SECRET) as s:
        s.put(meta, data)
        proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.perf_counter()
            assert s.get(meta) is None
            first = time.perf_counter() - t0
            during = timed_each(lambda i: s.get(meta), 1000)
            assert s.stats().timeouts == 1 and s.stats().unavailable == 1000
        finally:
            proc.send_signal(signal.SIGCONT)
    rows.append({"op": "get, server stopped", "blocks": 1, "mb_s": None, "p50_ms": first * 1e3, "p99_ms": None})
    rows.append({"op": "get, backing off", "blocks": 1000, "mb_s": None,
                 "p50_ms": statistics.median(during) * 1e3, "p99_ms": sorted(during)[989] * 1e3})
    for row in rows:
        row["store"] = "redis (failing)"
    return rows


def start_redis() -> tuple[Optional[subprocess.Popen[bytes]], Optional[str], Optional[str]]:
    binary = shutil.which("redis-server")
    if binary is None:
        return None, None, None
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="bench-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir, "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.split()[2].removeprefix("v=")
    import redis

    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.02)
    return proc, f"redis://127.0.0.1:{port}/0", version


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=128)
    p.add_argument("--block-bytes", type=int, default=2 * MIB, help="bytes of one block (2 MiB: Llama-3-8B, block 16)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dir", default=None, help="directory of the disk store (default: a temporary one)")
    p.add_argument("--redis-url", default=None, help="use this server instead of starting one")
    p.add_argument("--timeout-s", type=float, default=1.0, help="RemoteStore timeout (large: measure, not drop)")
    p.add_argument("--reps", type=int, default=3, help="runs of each store; the table shows the median")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    fp = fingerprint("bench/llama-3-8b-dims", "bfloat16", 16, 32, 8, 128)
    metas, data = blocks(args.blocks, args.block_bytes)
    rows: List[Dict[str, Any]] = []

    tmp = tempfile.mkdtemp(prefix="bench-tiers-", dir=args.dir)
    try:
        slot = DiskStore(os.path.join(tmp, "probe"), 64 * args.block_bytes, fp, args.block_bytes).slot_bytes
        shutil.rmtree(os.path.join(tmp, "probe"))
        rows += median_of(args.reps, lambda: run_store(
            "disk",
            lambda: DiskStore(tempfile.mkdtemp(prefix="cache-", dir=tmp), args.blocks * slot, fp, args.block_bytes,
                              threads=args.threads, max_tokens=TOKENS),
            metas, data, args.block_bytes, cold=drop_page_cache,
        ))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    proc, url, version = (None, args.redis_url, None) if args.redis_url else start_redis()
    try:
        if url is not None:
            rows += median_of(args.reps, lambda: run_store(
                f"redis {version or ''}".strip(),
                lambda: RemoteStore(url, fp, args.block_bytes, timeout_s=args.timeout_s, threads=args.threads,
                                    secret=SECRET),
                metas, data, args.block_bytes,
            ))
        else:
            print("redis-server not found: the remote tier is not measured", file=sys.stderr)
        if proc is not None:
            rows += failure_rows(proc, url, fp, args.block_bytes, metas[0], data[0])
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            proc.wait()

    def cell(v: Any, fmt: str) -> str:
        width = int(fmt.split(".")[0])
        return f"{'-':>{width}}" if v is None else format(v, fmt)

    print(f"{args.blocks} blocks of {args.block_bytes / MIB:g} MiB, {args.threads} I/O threads, "
          f"{os.cpu_count()} CPUs, {platform.platform()}")
    print(f"{'store':<16}{'op':<24}{'MB/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
    for r in rows:
        print(f"{r['store']:<16}{r['op']:<24}{cell(r['mb_s'], '10.0f')}{cell(r['p50_ms'], '10.3f')}"
              f"{cell(r['p99_ms'], '10.3f')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"blocks": args.blocks, "block_bytes": args.block_bytes, "threads": args.threads,
                       "cpus": os.cpu_count(), "platform": platform.platform(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
