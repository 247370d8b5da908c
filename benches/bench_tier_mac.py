"""What authenticating a tier record costs: the MAC of one 2 MiB block against a plain copy of it.

Every disk and remote tier record carries an HMAC-SHA256 (``pagedkv.tiers.record``) on top of its
XXH3-128 checksum; a put computes both, a verified read computes both again. This prints, per
block of ``--block-bytes`` (default 2 MiB, Llama-3-8B's 16-token block in bf16): a plain copy of
the block (``memoryview`` slice assignment into warm memory), the XXH3-128 checksum, the keyed
hashes one could use (HMAC-SHA256, the one in use; keyed BLAKE2b; BLAKE3 where the ``blake3``
package is installed) and the store's real paths (``encode_parts`` and ``verify_split`` of a whole
record). Also, with two threads, the HMAC's throughput (hashlib releases the GIL on large
buffers, so the stores' I/O threads hash in parallel).

Each figure is the median over ``--rounds`` of ``--reps`` back-to-back calls, single-threaded.
Run: ``python benches/bench_tier_mac.py [--block-bytes 2097152 --reps 20 --rounds 7]
[--json out.json]``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List

import xxhash

from pagedkv.tiers import BlockMeta, Reason
from pagedkv.tiers.record import encode_parts, verify_split
from pagedkv.tiers.secret import TierSecret


def per_call_s(fn: Callable[[], Any], reps: int, rounds: int) -> float:
    fn()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def threaded_s(fn: Callable[[], Any], threads: int, reps: int, rounds: int) -> float:
    """Wall time per call with ``threads`` threads calling ``fn`` back to back."""
    with ThreadPoolExecutor(threads) as pool:
        def batch() -> None:
            list(pool.map(lambda _: fn(), range(reps * threads)))

        batch()
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            batch()
            samples.append((time.perf_counter() - t0) / (reps * threads))
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-bytes", type=int, default=2 << 20)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()

    n = args.block_bytes
    data = os.urandom(n)
    dest = bytearray(n)
    key = os.urandom(32)
    secret = TierSecret(os.urandom(32).hex().encode(), source="bench")
    meta = BlockMeta(12345, 678, 9, list(range(args.tokens)))
    fp = bytes(16)
    prefix, body, trailer = encode_parts(fp, meta, data, secret=secret)

    def copy() -> None:
        memoryview(dest)[:] = data

    def verify() -> None:
        assert verify_split(prefix, body, trailer, fingerprint=fp, block_hash=12345,
                            token_ids=meta.token_ids, salt_digest=9, secret=secret) is Reason.OK

    def hmac_sha256() -> None:
        mac = hmac.new(key, digestmod=hashlib.sha256)
        mac.update(data)
        mac.digest()

    cases: List[tuple] = [
        ("plain copy (baseline)", copy),
        ("XXH3-128 checksum (not a MAC)", lambda: xxhash.xxh3_128_digest(data)),
        ("HMAC-SHA256 (in use)", hmac_sha256),
        ("keyed BLAKE2b-128", lambda: hashlib.blake2b(data, key=key, digest_size=16).digest()),
    ]
    try:
        import blake3  # type: ignore[import-not-found]

        cases.append(("keyed BLAKE3", lambda: blake3.blake3(data, key=key).digest()))
    except ImportError:
        print("blake3 is not installed: not measured", file=sys.stderr)
    cases += [
        ("encode_parts (checksum + MAC, a put)", lambda: encode_parts(fp, meta, data, secret=secret)),
        ("verify_split (checksum + MAC, a read)", verify),
    ]

    rows: List[Dict[str, Any]] = []
    base = None
    for name, fn in cases:
        s = per_call_s(fn, args.reps, args.rounds)
        base = base if base is not None else s
        rows.append({"case": name, "us_per_block": s * 1e6, "gb_per_s": n / s / 1e9,
                     "x_copy": s / base})
    two = threaded_s(hmac_sha256, 2, args.reps, args.rounds)
    rows.append({"case": "HMAC-SHA256, 2 threads (wall per block)", "us_per_block": two * 1e6,
                 "gb_per_s": n / two / 1e9, "x_copy": two / base})

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"block {n} bytes, {args.tokens} tokens; {cpu}; {os.cpu_count()} CPUs; "
          f"median of {args.rounds} x {args.reps} calls")
    print(f"{'case':<42} {'us/block':>10} {'GB/s':>8} {'x copy':>8}")
    for r in rows:
        print(f"{r['case']:<42} {r['us_per_block']:>10.1f} {r['gb_per_s']:>8.2f} {r['x_copy']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"block_bytes": n, "tokens": args.tokens, "cpu": cpu, "cpus": os.cpu_count(),
                       "python": sys.version.split()[0], "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
