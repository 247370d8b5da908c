"""Decode steps of the model runner on ragged and uniform batches: the decode planner against the
split heuristic, at Llama-3-8B dimensions with random bf16 weights (GPU).

Two :class:`~pagedkv.engine.model_runner.ModelRunner` objects share one model: one plans each
decode step's split-K work from the real lengths (``decode_planner=True``, the default), the other
uses the heuristic that sizes every sequence's splits for the longest possible one. Both capture
their decode CUDA graphs. For each batch (a log-normal ragged batch of 128 sequences, 31 to
~15,000 tokens, as serving batches are; and a uniform one), the sequences are admitted into each
runner's manager (their blocks allocated; the prompt KV is whatever the pool holds, which a decode
step's cost does not depend on), then ``--steps`` decode steps run through ``execute`` (bookkeeping,
plan update, copies, graph replay). Reported per step: the median wall time of the whole step and
of the GPU replay alone (CUDA events), for both runners, and their ratio.

Usage (GPU machine, repository root): ``PYTHONPATH=python python3 benches/bench_engine_ragged.py
[--steps 20] [--json out.json]``; ``--tiny`` runs the same code on small shapes (CPU or GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
from _dims import LLAMA3_8B, llama_config


def build_model(args, device):
    import transformers

    from pagedkv.engine.loader import LoadedModel

    dims = LLAMA3_8B
    if args.tiny:
        dims = dict(vocab=256, hidden=64, mlp=128, layers=2, heads=4, kv_heads=2)
    cfg = llama_config(dims, args.max_model_len)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(cfg, dtype=dtype)
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=None, config=model.config,
                       max_model_len=args.max_model_len, eos_token_ids=[], path="random")


def batches(args):
    rng = np.random.default_rng(0)
    n = args.batch
    ragged = np.exp(rng.normal(np.log(1024), 1.2, n)).astype(np.int64)
    ragged = np.clip(ragged, 31, args.max_model_len - args.steps - 8)
    uniform = np.full(n, args.uniform_len, dtype=np.int64)
    return {"ragged": ragged, "uniform": uniform}


def run(runner, lens, args) -> dict:
    from pagedkv.engine.core import build_block_manager

    mgr = build_block_manager(runner, enable_prefix_caching=False)
    ids = list(range(len(lens)))
    rng = np.random.default_rng(1)
    vocab = runner.config.vocab_size
    for sid, L in zip(ids, lens):
        mgr.admit(sid, rng.integers(0, vocab, int(L)).tolist())
    tok = np.full(len(ids), 7, dtype=np.int64)
    pos = np.array(lens, dtype=np.int64)
    walls, gpus = [], []
    cuda = runner.is_cuda
    for i in range(args.steps + 2):  # the first two are warm-ups
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        mgr.append_batch(ids, tok)
        step = mgr.step(ids, 1)
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        logits = runner.execute(tok, pos, step, np.arange(len(ids)))
        if cuda:
            e.record()
        logits[:, 0].sum().item()
        t1 = time.perf_counter()
        if i >= 2:
            walls.append(1e6 * (t1 - t0))
            if cuda:
                gpus.append(1e3 * s.elapsed_time(e))
        pos += 1
    mgr.free_batch(ids)
    mgr.detach_buffers()
    return {"wall_us": statistics.median(walls),
            "gpu_us": statistics.median(gpus) if gpus else float("nan"),
            "tokens": int(np.sum(lens))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--uniform-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--tiny", action="store_true", help="small shapes (a dry run)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        args.batch, args.uniform_len, args.max_model_len = 8, 64, 512
    from pagedkv.engine.model_runner import ModelRunner

    loaded = build_model(args, device)
    sets = batches(args)
    need = max(int(np.sum(-(-(v + args.steps + 4) // 16))) for v in sets.values()) + 16
    backend = "triton" if device == "cpu" else "auto"
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "batch": args.batch, "rows": []}
    for name, lens in sets.items():
        print(f"{name}: {len(lens)} sequences, {lens.min()}-{lens.max()} tokens, "
              f"{int(lens.sum())} total", flush=True)
    runners = {}
    for planner in (True, False):
        runners[planner] = ModelRunner(loaded, num_blocks=need, max_num_seqs=args.batch,
                                       max_num_batched_tokens=max(args.batch, 256),
                                       decode_planner=planner, attention_backend=backend)
        for name, lens in sets.items():
            r = run(runners[planner], lens, args)
            r.update(batch=name, planner=planner)
            out["rows"].append(r)
            print(json.dumps(r), flush=True)
        del runners[planner]
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"{'batch':>8} {'planner wall':>13} {'heuristic wall':>15} {'ratio':>6} "
          f"{'planner gpu':>12} {'heuristic gpu':>14} {'ratio':>6}")
    for name in sets:
        p = next(r for r in out["rows"] if r["batch"] == name and r["planner"])
        h = next(r for r in out["rows"] if r["batch"] == name and not r["planner"])
        print(f"{name:>8} {p['wall_us']:>11.0f}us {h['wall_us']:>13.0f}us "
              f"{p['wall_us'] / h['wall_us']:>6.3f} {p['gpu_us']:>10.0f}us "
              f"{h['gpu_us']:>12.0f}us {p['gpu_us'] / h['gpu_us']:>6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
