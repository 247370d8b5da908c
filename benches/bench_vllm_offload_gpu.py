"""pagedkv's vLLM offloading handlers on the GPU, without vLLM: stores and loads of KV blocks in
vLLM's tensor layout through :class:`pagedkv.vllm.offload_copy.ChunkCopier`, against a plain
pinned copy of the same bytes.

The KV cache is what vLLM hands an offloading worker: one block-major tensor per layer,
``[num_blocks, page_bytes]`` (``--layers`` tensors, page = 2 (K, V) x ``--block-size`` tokens x
``--kv-heads`` x ``--head-dim`` x 2 bytes), all in one KV cache group. Each measurement moves
``--blocks`` blocks (a 4096-token prompt at 16 tokens a block: 256) between scattered GPU blocks
and host chunks of ``--blocks-per-chunk`` blocks, through the copier's CUDA path
``pipelined`` (module docs of :mod:`pagedkv.vllm.offload_copy`): one gather launch per group into
a ring of device staging slots, the DMA of each slot's runs of consecutive chunks overlapping the
gather of the next (loads: DMA, then one scatter launch per slot); as ``store`` (GPU blocks ->
host chunks) and ``load`` (host chunks -> GPU blocks), the chunks consecutive (``run``) or
scattered over the host pool (``scattered``). The baseline ``pinned``: one ``copy_`` of the same
byte count between a contiguous device buffer and pinned host memory, each direction.

Each figure is the median over ``--reps`` of the wall time from submit to the job's event
(CUDA-synchronized), after ``--warmup`` runs; the handlers' rate is reported as a fraction of the
pinned copy's in the same direction (goal: >= 90% on every row). The copier first passes a
round trip checked byte for byte. Prints a table and writes JSON::

    PYTHONPATH=python .venv/bin/python benches/bench_vllm_offload_gpu.py

``--baseline FILE`` also measures another version of the copier side by side: ``FILE`` is that
version's ``offload_copy.py`` (e.g. ``git show REV:python/pagedkv/vllm/offload_copy.py >
/tmp/old.py``), loaded beside the current one over the same tensors and host pool; ``--rounds``
rounds then alternate the two (baseline first in even rounds, second in odd ones), each round
with its own pinned copies, and a second table gives every row of every round.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import platform
import statistics
import time
from typing import Callable, Dict, List

import numpy as np
import torch

from pagedkv.vllm.offload_copy import ChunkCopier


def timed(fn: Callable[[], object], reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out: List[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--gpu-blocks", type=int, default=4096)
    ap.add_argument("--host-chunks", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--blocks-per-chunk", type=int, default=1)
    ap.add_argument("--staging-chunks", type=int, default=None,
                    help="device staging per direction, in chunks (default: the copier's)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", default=None,
                    help="another version's offload_copy.py, measured side by side")
    ap.add_argument("--rounds", type=int, default=4,
                    help="alternating rounds with --baseline")
    ap.add_argument("--json", default="bench_vllm_offload_gpu.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_vllm_offload_gpu: needs a CUDA device")
    dev = torch.device("cuda")
    page = 2 * args.block_size * args.kv_heads * args.head_dim * 2
    tensors = [torch.randint(-128, 127, (args.gpu_blocks, page), dtype=torch.int8, device=dev)
               for _ in range(args.layers)]
    bpc = args.blocks_per_chunk
    host = torch.empty((args.host_chunks, page * args.layers * bpc), dtype=torch.uint8,
                       pin_memory=True)
    cp = ChunkCopier(tensors, [list(range(args.layers))], blocks_per_chunk=bpc,
                     num_chunks=args.host_chunks, host=host, staging_chunks=args.staging_chunks)
    path = cp.path
    n = args.blocks
    nchunks = -(-n // bpc)
    nbytes = n * page * args.layers
    rng = np.random.default_rng(args.seed)
    gpu_ids = rng.choice(args.gpu_blocks, size=n, replace=False)
    layouts: Dict[str, np.ndarray] = {
        "run": np.arange(nchunks) + 7,
        "scattered": rng.choice(args.host_chunks, size=nchunks, replace=False),
    }
    job = [0]

    def next_job() -> int:
        job[0] += 1
        return job[0]

    # Correctness first: a store and a load into other blocks return the same bytes.
    rest = np.setdiff1d(np.arange(args.gpu_blocks), gpu_ids)
    g = torch.from_numpy(gpu_ids).to(dev)
    other = rng.choice(rest, size=n, replace=False)
    o = torch.from_numpy(other).to(dev)
    for t in tensors:
        t[o] = 0
    cp.store(next_job(), gpu_ids, [n], [0], layouts["scattered"])
    cp.load(next_job(), layouts["scattered"], other, [n], [0])
    cp.synchronize()
    for t in tensors:
        assert torch.equal(t[g], t[o]), f"{path}: round trip changed the bytes"
    cp.finished()

    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def pinned() -> Dict[str, float]:
        """The plain pinned copy's seconds, per direction."""
        return {"store": timed(lambda: host_buf.copy_(dev_buf, non_blocking=True), args.reps,
                               args.warmup),
                "load": timed(lambda: dev_buf.copy_(host_buf, non_blocking=True), args.reps,
                              args.warmup)}

    def move(c: ChunkCopier, d: str, chunks: np.ndarray) -> None:
        """One transfer through ``c``, ``d`` "store" or "load", waited for."""
        j = next_job()
        if d == "store":
            c.store(j, gpu_ids, [n], [0], chunks)
        else:
            c.load(j, chunks, gpu_ids, [n], [0])
        c.wait({j})

    pin = pinned()
    res: Dict[str, float] = {"pinned d2h": pin["store"], "pinned h2d": pin["load"]}
    for name, chunks in layouts.items():
        for d in ("store", "load"):
            res[f"{path} {d} {name}"] = timed(lambda: move(cp, d, chunks), args.reps,
                                              args.warmup)
        cp.finished()
    staging = cp.staging_chunks
    print(f"\n{torch.cuda.get_device_name()}: {n} blocks x {args.layers} layers "
          f"({nbytes / 2**20:.0f} MiB), {bpc} block(s) per chunk, median of {args.reps}; "
          f"path {path} (DMAs: {cp.dma}), staging chunks per direction {staging}")
    print(f"{'transfer':<28}{'ms':>9}{'GB/s':>9}{'of pinned':>11}")
    out = {}
    for name, s in res.items():
        base = res["pinned h2d" if " load " in name or name == "pinned h2d" else "pinned d2h"]
        frac = base / s
        out[name] = {"ms": s * 1e3, "GBps": nbytes / s / 1e9, "of_pinned": frac}
        print(f"{name:<28}{s * 1e3:>9.3f}{nbytes / s / 1e9:>9.1f}{frac:>10.0%}")
    worst = min(v["of_pinned"] for k, v in out.items() if k.startswith(path + " "))
    print(f"{path}: worst row {worst:.0%} of pinned "
          f"({'meets' if worst >= 0.9 else 'misses'} >= 90%)")
    rounds = []
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_offload_copy", args.baseline)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # its dataclasses look their module up
        spec.loader.exec_module(mod)
        base_cp = mod.ChunkCopier(tensors, [list(range(args.layers))], blocks_per_chunk=bpc,
                                  num_chunks=args.host_chunks, host=host,
                                  staging_chunks=args.staging_chunks)
        copiers = {"baseline": base_cp, "current": cp}
        print(f"\nside by side with {args.baseline}, {args.rounds} rounds alternating "
              f"(percent of that round's pinned copy)")
        cols = [f"{d} {name}" for name in layouts for d in ("store", "load")]
        print(f"{'round':<7}{'copier':<10}" + "".join(f"{k:>18}" for k in cols)
              + f"{'worst':>8}")
        for r in range(args.rounds):
            pin = pinned()
            for which in (("baseline", "current") if r % 2 == 0 else ("current", "baseline")):
                c = copiers[which]
                row = {}
                for name, chunks in layouts.items():
                    for d in ("store", "load"):
                        secs = timed(lambda: move(c, d, chunks), args.reps, args.warmup)
                        row[f"{d} {name}"] = {"ms": secs * 1e3, "of_pinned": pin[d] / secs}
                c.finished()
                low = min(v["of_pinned"] for v in row.values())
                rounds.append({"round": r, "copier": which, "rows": row, "worst": low,
                               "pinned_ms": {k: v * 1e3 for k, v in pin.items()}})
                print(f"{r:<7}{which:<10}" + "".join(f"{row[k]['of_pinned']:>18.0%}" for k in cols)
                      + f"{low:>8.0%}")
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "machine": platform.machine(),
                   "args": vars(args), "bytes": nbytes, "path": path, "dma": cp.dma,
                   "staging_chunks": staging,
                   "worst_of_pinned": worst, "results": out, "side_by_side": rounds}, f,
                  indent=1)


if __name__ == "__main__":
    main()
