"""Where a scattered host<->device transfer loses time: many DMAs against one, issued three ways.

Moves ``--mib`` MiB between a device buffer and a pinned host pool as ``--pieces`` pieces
(2 MiB each by default: one 4096-token chunk of a 32-layer model), the host side scattered
over a pool twice the size (a random permutation of slots), each direction:

- ``one``: a single ``copy_`` of the whole buffer (the baseline);
- ``torch``: one ``copy_(non_blocking=True)`` per piece on one stream (what the copier does);
- ``raw``: one ``cuMemcpyAsync`` per piece through the driver API (no torch dispatch);
- ``batch``: every piece in one ``cuMemcpyBatchAsync`` (CUDA 12.8+ drivers), source access
  order ``stream``;
- ``batch-any``: the same with source access order ``any``.

Each figure is the median of ``--reps`` (after ``--warmup``) wall times from the first submit to
the stream's end, and is checked byte for byte once. Prints a table, writes JSON::

    PYTHONPATH=python python3 benches/bench_dma_probe.py
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from typing import Callable, Dict, List

import numpy as np
import torch

# The driver's CUmemcpyAttributes, as the copier declares it.
from pagedkv.vllm.offload_dma import _Attributes as MemcpyAttributes


def driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--piece-kib", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default="bench_dma_probe.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    piece = args.piece_kib * 1024
    n = args.mib * 2**20 // piece
    gpu = torch.randint(0, 255, (n, piece), dtype=torch.uint8, device=dev)
    gpu2 = torch.empty_like(gpu)
    host = torch.empty((2 * n, piece), dtype=torch.uint8, pin_memory=True)
    rng = np.random.default_rng(0)
    slots = np.sort(rng.permutation(2 * n)[:n])
    stream = torch.cuda.Stream(dev)
    cu = driver()
    sh = ctypes.c_void_p(stream.cuda_stream)
    cu.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t,
                                 ctypes.c_void_p]
    batch_fns = {}
    for name in ("cuMemcpyBatchAsync_v2", "cuMemcpyBatchAsync"):
        try:
            batch_fns[name] = getattr(cu, name)
        except AttributeError:
            pass
    print("driver symbols:", sorted(batch_fns))
    hp = [host[s].data_ptr() for s in slots]
    gp = [gpu[i].data_ptr() for i in range(n)]
    g2p = [gpu2[i].data_ptr() for i in range(n)]
    U64 = ctypes.c_uint64 * n
    sizes = (ctypes.c_size_t * n)(*([piece] * n))

    def batch(fn_name: str, order: int, dsts: List[int], srcs: List[int]) -> None:
        attrs = MemcpyAttributes(order, 0, 0, 0, 0, 0)
        idx = (ctypes.c_size_t * 1)(0)
        d, s = U64(*dsts), U64(*srcs)
        fn = batch_fns[fn_name]
        if fn_name.endswith("_v2"):
            rc = fn(d, s, sizes, ctypes.c_size_t(n), ctypes.byref(attrs), idx, ctypes.c_size_t(1),
                    sh)
        else:
            fail = ctypes.c_size_t(0)
            rc = fn(d, s, sizes, ctypes.c_size_t(n), ctypes.byref(attrs), idx,
                    ctypes.c_size_t(1), ctypes.byref(fail), sh)
        if rc != 0:
            raise RuntimeError(f"{fn_name} returned {rc}")

    def ways(direction: str) -> Dict[str, Callable[[], None]]:
        h2d = direction == "load"
        dst_g = gpu2 if h2d else gpu
        dsts = g2p if h2d else hp
        srcs = hp if h2d else gp
        flat_h = host[:n]
        w: Dict[str, Callable[[], None]] = {}

        def one() -> None:
            with torch.cuda.stream(stream):
                if h2d:
                    dst_g.copy_(flat_h, non_blocking=True)
                else:
                    flat_h.copy_(gpu, non_blocking=True)
        w["one"] = one

        def tor() -> None:
            with torch.cuda.stream(stream):
                for i, s in enumerate(slots):
                    if h2d:
                        gpu2[i].copy_(host[s], non_blocking=True)
                    else:
                        host[s].copy_(gpu[i], non_blocking=True)
        w["torch"] = tor

        def raw() -> None:
            for d, s in zip(dsts, srcs):
                rc = cu.cuMemcpyAsync(d, s, piece, sh)
                if rc:
                    raise RuntimeError(f"cuMemcpyAsync returned {rc}")
        w["raw"] = raw
        for fn_name in batch_fns:
            tag = "batch" + ("" if fn_name.endswith("_v2") else "-v1")
            w[tag] = lambda f=fn_name: batch(f, 1, dsts, srcs)
            w[tag + "-any"] = lambda f=fn_name: batch(f, 3, dsts, srcs)
        return w

    def timed(fn: Callable[[], None]) -> float:
        for _ in range(args.warmup):
            fn()
        stream.synchronize()
        out = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            stream.synchronize()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    res: Dict[str, Dict[str, float]] = {}
    for direction in ("store", "load"):
        res[direction] = {}
        for name, fn in ways(direction).items():
            # correctness once
            host.zero_()
            gpu2.zero_()
            torch.cuda.synchronize()
            try:
                if direction == "store":
                    fn()
                    stream.synchronize()
                    got = host[:n] if name == "one" else host[torch.from_numpy(slots)]
                    ok = bool(torch.equal(got.cuda(), gpu))
                else:
                    if name == "one":
                        host[:n] = gpu.cpu()
                    else:
                        host[torch.from_numpy(slots)] = gpu.cpu()
                    fn()
                    stream.synchronize()
                    ok = bool(torch.equal(gpu2, gpu))
                t = timed(fn)
            except Exception as exc:  # noqa: BLE001
                print(f"{direction} {name}: failed: {exc}")
                continue
            res[direction][name] = t
            gbs = n * piece / t / 1e9
            print(f"{direction:<6} {name:<14} {t * 1e3:8.3f} ms {gbs:6.1f} GB/s "
                  f"{res[direction]['one'] / t * 100 if 'one' in res[direction] else 0:5.0f}%"
                  f"  {'ok' if ok else 'MISMATCH'}", flush=True)
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "pieces": n, "piece_bytes": piece,
                   "median_s": res}, f, indent=1)


if __name__ == "__main__":
    main()
