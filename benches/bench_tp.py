"""Tensor-parallel throughput: ``LLM.generate`` at Llama-3-8B dimensions, TP=2 against TP=1.

Random bf16 weights (``LlamaConfig``: 32 layers, hidden 4096, 32/8 heads, MLP 14336, vocab
128256), built identically on every rank from one seed and cut to each rank's shard by the
engine. Each configuration runs in fresh processes (``torch.multiprocessing``, one per rank, NCCL,
rank ``r`` on ``cuda:r``): every rank builds the model and constructs ``LLM(loaded,
tensor_parallel_size=N)`` — the one-script-per-rank launch —, rank 0 times ``generate`` of
``--batch`` prompts of ``--prompt`` tokens, ``--new`` greedy tokens each (``ignore_eos``), after a
warm-up ``generate``. Prints one row per TP size: generated tokens/s and total (prompt +
generated) tokens/s over the wall time, the engine's steps, the KV pool's blocks per rank, and
the step packet's bytes (what one broadcast moves).

The figure needs two GPUs (2 × H200); ``--tiny`` runs the same code at toy dimensions, on the CPU
with gloo when there is no GPU (a smoke test of the script, not a measurement).

Usage (repository root): ``PYTHONPATH=python python3 benches/bench_tp.py [--tp 1 2]
[--batch 64 --prompt 512 --new 128] [--json out.json]``;
``PYTHONPATH=python python3 benches/bench_tp.py --tiny`` on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from _dims import add_model_args, llama_config, model_dims


def build_loaded(args, device):
    import torch
    import transformers

    from pagedkv.engine.loader import LoadedModel

    cfg = llama_config(model_dims(args), args.max_model_len)
    # One seed on every rank: replicated weights (embeddings, norms, LM head) are identical, and
    # each rank's shard is a slice of the same full weights.
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with device:
        model = transformers.LlamaForCausalLM._from_config(cfg, dtype=dtype)
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=None, config=model.config,
                       max_model_len=args.max_model_len, path="random")


def rank_main(rank, args, tp, init_method, out_path):
    import torch
    import torch.distributed as dist

    from pagedkv.engine.llm import LLM
    from pagedkv.engine.sampling_params import SamplingParams

    cuda = torch.cuda.is_available() and not args.cpu
    if tp > 1:
        from pagedkv.distributed.tp import init_group

        group = init_group("nccl" if cuda else "gloo", init_method, rank, tp, timeout_s=900)
        device = group.device
    else:
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(0)
    loaded = build_loaded(args, device)
    kw = dict(block_size=args.block_size, max_num_seqs=args.batch,
              max_num_batched_tokens=args.max_num_batched_tokens, progress=False,
              enable_prefix_caching=False, cuda_graphs=cuda)
    if args.num_blocks:
        kw["num_blocks"] = args.num_blocks
    if tp > 1:
        kw["tensor_parallel_size"] = tp
    llm = LLM(loaded, **kw)
    prompts = [[(7919 * (i + 1) + 31 * j) % args.vocab for j in range(args.prompt)]
               for i in range(args.batch)]
    sp = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    llm.generate(prompts[: min(4, len(prompts))],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if rank == 0:
        eng = llm.llm_engine
        gen = sum(len(c.token_ids) for o in outs for c in o.outputs)
        b = eng.runner.broadcaster
        row = dict(tp=tp, device=str(device), batch=args.batch, prompt=args.prompt, new=args.new,
                   wall_s=wall, generated_tokens=gen, gen_tokens_per_s=gen / wall,
                   total_tokens_per_s=(gen + args.batch * args.prompt) / wall,
                   steps=eng.stats().num_steps, num_blocks=eng.runner.num_blocks,
                   kv_heads_per_rank=eng.runner.spec.num_kv_heads,
                   packet_bytes=b.nbytes if b is not None else 0)
        with open(out_path, "w") as fh:
            json.dump(row, fh)
    llm.shutdown()
    if tp > 1:
        dist.destroy_process_group()


def run_config(args, tp):
    import torch.multiprocessing as mp

    d = tempfile.mkdtemp(prefix="pagedkv-bench-tp-")
    out = os.path.join(d, "row.json")
    init = "file://" + os.path.join(d, "store")
    mp.spawn(rank_main, args=(args, tp, init, out), nprocs=tp, join=True)
    with open(out) as fh:
        return json.load(fh)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=0, help="0: the runner's default sizing")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=8192)
    add_model_args(p)
    p.add_argument("--tiny", action="store_true",
                   help="toy dimensions (2 layers, hidden 64): a smoke test, "
                   "CPU/gloo without a GPU")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (gloo) even with a GPU")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.heads, args.kv_heads = 2, 64, 4, 2
        args.mlp, args.vocab, args.max_model_len = 128, 128, 256
        args.batch, args.prompt, args.new = min(args.batch, 8), min(args.prompt, 40), \
            min(args.new, 16)
        args.num_blocks = args.num_blocks or 256
        args.block_size, args.max_num_batched_tokens = 4, 64
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    rows = [run_config(args, tp) for tp in args.tp]
    head = ("tp", "gen tok/s", "total tok/s", "wall s", "steps", "blocks/rank",
            "kv heads/rank", "packet B")
    print(f"Llama dims: {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} "
          f"heads, MLP {args.mlp}, vocab {args.vocab}; batch {args.batch} x prompt {args.prompt} "
          f"+ {args.new} new; device {rows[0]['device']}")
    print("  ".join(f"{h:>13}" for h in head))
    for r in rows:
        cells = (r["tp"], f"{r['gen_tokens_per_s']:.1f}", f"{r['total_tokens_per_s']:.1f}",
                 f"{r['wall_s']:.2f}", r["steps"], r["num_blocks"], r["kv_heads_per_rank"],
                 r["packet_bytes"])
        print("  ".join(f"{c!s:>13}" for c in cells))
    if len(rows) > 1:
        base = rows[0]["gen_tokens_per_s"]
        for r in rows[1:]:
            print(f"TP={r['tp']} / TP={rows[0]['tp']}: {r['gen_tokens_per_s'] / base:.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
