"""KV cache groups on a GPU: how many 32K-token sequences a hybrid model runs at once.

Builds a random-weight model (bf16, on the device) of one of the hybrid shapes below, lets the
engine size its KV pool from the memory left (``gpu_memory_utilization``), and reports:

- the pool: pages, the grouping (groups x layers a page holds), bytes a page holds;
- per sequence of ``--context`` tokens, the pages it holds at its decode peak over every group
  (``LayerGrouping.need_blocks``), and the concurrency that gives, against the *analytic optimum*
  (the pool's bytes over a sequence's bytes when every layer holds exactly its own blocks: full
  layers every block, sliding layers their window's) and against full-attention accounting
  (every layer every block);
- with ``--run`` (the default): the engine admits ``--seqs`` sequences (default: the decode-peak
  concurrency) of ``--context`` tokens (prompt and ``--new`` decoded tokens; by default enough new
  tokens that the first still decodes when the last one's prefill ends); the
  most sequences it held at once (``peak_running_seqs``), the preemptions, and the wall time.
  Chunked prefill keeps a prefilling sequence's previous chunk's window too, so the peak it
  reaches sits a few sequences under the decode-peak figure.

Shapes (``--model``): ``gpt-oss-20b`` (24 layers alternating sliding-128 with sinks and full,
64 query / 8 KV heads x 64, 32 experts top-4) and ``gemma-3-27b`` (62 layers, 5 sliding-1024 to
each full, 32 / 16 heads x 128). ``--layers N`` keeps the shape's pattern over fewer layers (less
weight memory, more KV: the concurrency figures scale, the ratios hold).

Usage (GPU, repository root): ``PYTHONPATH=python python3 benches/bench_groups_gpu.py
[--model gpt-oss-20b] [--context 32768] [--gpu-memory-utilization 0.9] [--no-run]
[--json out.json]``. A CPU smoke run: ``--tiny --device cpu``. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List, Sequence

import numpy as np


def model_config(name: str, layers: int, tiny: bool) -> Any:
    import transformers

    if name == "gpt-oss-20b":
        n = layers or 24
        kw: Dict[str, Any] = dict(
            vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=n,
            num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
            num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                         for i in range(n)])
        if tiny:
            kw.update(vocab_size=512, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_local_experts=4,
                      num_experts_per_tok=2, sliding_window=16, max_position_embeddings=4096)
        return transformers.GptOssConfig(**kw, eos_token_id=None, bos_token_id=None,
                                         pad_token_id=None)
    if name == "gemma-3-27b":
        n = layers or 62
        kw = dict(vocab_size=262208, hidden_size=5376, intermediate_size=21504,
                  num_hidden_layers=n, num_attention_heads=32, num_key_value_heads=16,
                  head_dim=128, query_pre_attn_scalar=168, sliding_window=1024,
                  max_position_embeddings=131072,
                  layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                               for i in range(n)])
        if tiny:
            kw.update(vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      query_pre_attn_scalar=16, sliding_window=32, max_position_embeddings=4096)
        return transformers.Gemma3TextConfig(**kw, eos_token_id=None, bos_token_id=None,
                                             pad_token_id=None)
    raise SystemExit(f"unknown --model {name!r} (gpt-oss-20b, gemma-3-27b)")


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import torch
    import transformers

    import pagedkv
    from pagedkv.engine.loader import LoadedModel
    from pagedkv.groups import peak_decode_blocks
    from pagedkv.layer_groups import layer_kinds

    cfg = model_config(args.model, args.layers, args.tiny)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval().requires_grad_(False)
    build_s = time.perf_counter() - t0
    loaded = LoadedModel(model=model, tokenizer=None, config=model.config,
                         max_model_len=args.context, eos_token_ids=[], path="random")
    mem: Dict[str, Any] = {}
    if args.device == "cuda":
        mem = dict(gpu_memory_utilization=args.gpu_memory_utilization)
    else:
        mem = dict(kv_cache_memory=args.kv_cache_memory)
    llm = pagedkv.LLM(loaded, device=args.device, block_size=args.block_size,
                      max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.chunk,
                      enable_prefix_caching=False, progress=False, **mem)
    engine = llm.llm_engine
    runner = engine.core.runner
    grouping = runner.grouping
    manager = engine.manager
    bs = args.block_size
    pages = manager.num_blocks
    page_bytes = runner.spec.bytes_per_block  # one page: ``slots`` layers x B tokens
    kinds = layer_kinds(model.config)
    layer_token_bytes = page_bytes // (grouping.slots * bs)
    kv_bytes = pages * page_bytes
    need = grouping.need_blocks(args.context, bs)
    optimum = kv_bytes / (sum(peak_decode_blocks(k, args.context, bs) for k in kinds)
                          * bs * layer_token_bytes)
    full = kv_bytes / (len(kinds) * -(-args.context // bs) * bs * layer_token_bytes)
    r: Dict[str, Any] = {
        "model": args.model, "layers": len(kinds), "context": args.context, "block_size": bs,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "build_s": build_s, "pages": pages, "page_bytes": page_bytes,
        "groups": grouping.num_groups, "slots": grouping.slots, "kv_gib": kv_bytes / 2**30,
        "need_pages": need, "concurrency": pages / need, "optimum": optimum,
        "share_of_optimum": (pages / need) / optimum, "full_attention": full,
        "vs_full": (pages / need) / full,
    }
    if args.run:
        seqs = args.seqs or max(1, int(pages // need))
        # Enough new tokens that the first sequence still decodes when the last one's prefill
        # ends (a prefill chunk a step): all of them are running at once at the end.
        new = args.new or seqs * -(-args.context // args.chunk) + 8
        g = np.random.default_rng(0)
        vocab = model.config.vocab_size
        prompts = [g.integers(0, vocab, args.context - new).tolist() for _ in range(seqs)]
        params = pagedkv.SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        st = llm.stats()
        manager.check_invariants()
        r.update(run_seqs=seqs, new_tokens=new, run_s=time.perf_counter() - t0,
                 peak_running_seqs=st.peak_running_seqs, preemptions=st.num_preemptions,
                 completed=sum(len(o.outputs[0].token_ids) == new for o in outs))
    llm.shutdown()
    return r


def main(argv: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-oss-20b")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers, same pattern")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--new", type=int, default=0,
                    help="new tokens a sequence (0: enough for all to run at once)")
    ap.add_argument("--seqs", type=int, default=0, help="sequences run (0: the concurrency)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-cache-memory", default="64MiB", help="CPU only")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="small dimensions (a smoke run)")
    ap.add_argument("--no-run", dest="run", action="store_false")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(list(argv) or None)
    r = run(args)
    print(f"{r['model']} ({r['layers']} layers, random {args.dtype}) on {r['device']}, "
          f"{r['date']}; context {r['context']}, block {r['block_size']}")
    print(f"pool: {r['pages']} pages of {r['page_bytes'] / 2**20:.2f} MiB ({r['kv_gib']:.1f} GiB), "
          f"{r['groups']} groups of {r['slots']} layers")
    rows: List[tuple] = [
        ("pages a sequence holds at its decode peak", f"{r['need_pages']}"),
        ("concurrency (pool / that)", f"{r['concurrency']:.2f}"),
        ("analytic optimum", f"{r['optimum']:.2f}"),
        ("share of the optimum", f"{r['share_of_optimum'] * 100:.1f}%"),
        ("full-attention accounting", f"{r['full_attention']:.2f}"),
        ("against full accounting", f"{r['vs_full']:.2f}x"),
    ]
    if args.run:
        rows += [("sequences run", f"{r['run_seqs']} ({r['completed']} completed)"),
                 ("most running at once", f"{r['peak_running_seqs']}"),
                 ("preemptions", f"{r['preemptions']}"),
                 ("wall time", f"{r['run_s']:.1f} s")]
    for k, v in rows:
        print(f"  {k:<44} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
