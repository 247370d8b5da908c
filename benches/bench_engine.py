"""Engine benchmark on a GPU: the model runner at Llama-3-8B dimensions with random bf16 weights.

Builds ``LlamaForCausalLM`` from a ``LlamaConfig`` (32 layers, hidden 4096, 32/8 heads, MLP 14336,
vocab 128256) with transformers, wraps it for :class:`pagedkv.engine.model_runner.ModelRunner`, and
drives the runner directly with a :class:`pagedkv.BlockManager` (the scheduler's job done inline:
chunked prefill of every prompt, then greedy decode of the whole batch). Prints one table:

- prefill tokens/s and decode tokens/s at ``--batch`` sequences of ``--prompt`` tokens, ``--new``
  new tokens each (the decode rate is the batch over the median wall time of one whole step:
  bookkeeping, copies, the graph replay and the argmax read back);
- the decode-step breakdown at the batch's mid-decode context: bookkeeping (manager
  ``append_batch`` + ``step``, host wall time), H2D copy (``StepBuffers.to_device`` + ids and
  positions, CUDA events), kernels (``scatter_kv`` + ``paged_decode`` for all layers at the same
  shapes, CUDA events over a replayed graph of just those launches), the rest of the model (graph
  replay time minus kernels);
  (the rest is split further into the linear layers alone, timed as a graph of just those GEMMs,
  and everything else: norms, RoPE, activations, residual adds, embedding);
- the memory-roofline fraction: (weight bytes read per step + the batch's KV bytes) / 4.24 TB/s
  over the measured step time (the GPU replay, and the whole step);
- optionally (``--contiguous``) the same engine limited to the batch that a contiguous
  max-length (``max_model_len``) reservation per sequence fits in the same KV memory;
- optionally (``--llm``) the user-facing path end to end: ``pagedkv.LLM.generate`` (scheduler,
  sampler, detokenization off) on the same model and prompts, generated tokens over wall time;
- optionally (``--transformers``) transformers' own ``generate`` (greedy, static cache, no
  ``torch.compile``) on the same model and prompts, in batches of ``--batch``, generated tokens
  over wall time — side by side with the engine's end-to-end rate (prefill included) in one run.

Usage (on the GPU machine, repository root): ``PYTHONPATH=python python3 benches/bench_engine.py
[--batch 128 --prompt 512 --new 128] [--contiguous] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
from _dims import add_model_args, llama_config, model_dims

COPY_BW = 4.24e12  # bytes/s: the H200 copy bandwidth the project's targets use


def build_model(args):
    import transformers

    cfg = llama_config(model_dims(args), args.max_model_len)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    from pagedkv.engine.loader import LoadedModel

    return LoadedModel(model=model, tokenizer=None, config=model.config,
                       max_model_len=args.max_model_len, eos_token_ids=[], path="random")


def weight_bytes_per_step(model, batch: int) -> int:
    """Bytes of weights a decode step reads: every matrix once, but only ``batch`` embedding rows."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            total += batch * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def run_batch(runner, batch, prompt_len, new_tokens, chunk, seed=0, breakdown=False):
    from pagedkv.manager import BlockManager

    mgr = runner.new_block_manager(enable_prefix_caching=False)
    g = np.random.default_rng(seed)
    vocab = runner.config.vocab_size
    prompts = [g.integers(0, vocab, prompt_len).astype(np.int64) for _ in range(batch)]
    sids = np.arange(batch, dtype=np.int64)
    # Prefill: whole prompts, as many per step as the token budget holds.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = np.zeros(batch, dtype=np.int64)
    per_step = max(1, chunk // prompt_len)
    for a in range(0, batch, per_step):
        ids = list(range(a, min(batch, a + per_step)))
        for s in ids:
            mgr.admit(s, prompts[s])
        info = mgr.step(ids, [prompt_len] * len(ids))
        inp = np.concatenate([prompts[s] for s in ids])
        pos = np.tile(np.arange(prompt_len), len(ids))
        logits = runner.execute(inp, pos, info, list(range(len(ids))))
        first[a:a + len(ids)] = logits.argmax(-1).cpu().numpy()
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    # Decode: every sequence, one token per step, greedy.
    toks = first
    step_times, book_times = [], []
    ctx = prompt_len
    pos = np.full(batch, prompt_len, dtype=np.int64)
    mid = None
    for i in range(new_tokens - 1):
        t_a = time.perf_counter()
        mgr.append_batch(sids, toks)
        info = mgr.step(sids, 1)
        t_b = time.perf_counter()
        logits = runner.execute(toks, pos, info, range(batch))
        toks = logits.argmax(-1).cpu().numpy()
        t_c = time.perf_counter()
        pos += 1
        ctx += 1
        book_times.append(t_b - t_a)
        step_times.append(t_c - t_a)
        if breakdown and i == new_tokens // 2:
            mid = measure_breakdown(runner, info, toks, pos)
    out = {
        "batch": batch,
        "prefill_s": prefill_s,
        "prefill_tok_s": batch * prompt_len / prefill_s,
        "decode_step_ms_median": 1e3 * statistics.median(step_times),
        "decode_tok_s": batch / statistics.median(step_times),
        "decode_tok_s_mean": batch * len(step_times) / sum(step_times),
        "bookkeeping_us_median": 1e6 * statistics.median(book_times),
        "mean_context": prompt_len + new_tokens / 2,
        # Generated tokens over the whole run, prefill included: comparable to generate's rate.
        "end_to_end_tok_s": batch * new_tokens / (prefill_s + sum(step_times)),
    }
    if mid is not None:
        out["breakdown"] = mid
    for s in range(batch):
        mgr.free(s)
    return out


def _prompts(args, vocab, seed=0):
    g = np.random.default_rng(seed)
    return [g.integers(0, vocab, args.prompt).tolist() for _ in range(args.batch)]


def run_llm(loaded, num_blocks, args):
    """``pagedkv.LLM.generate`` end to end: what a user of the offline API gets."""
    import pagedkv

    torch.cuda.empty_cache()
    llm = pagedkv.LLM(loaded, device="cuda", num_blocks=num_blocks, block_size=args.block_size,
                      max_num_seqs=args.batch, max_num_batched_tokens=args.chunk,
                      enable_prefix_caching=False, progress=False)
    prompts = _prompts(args, loaded.config.vocab_size)
    sp = pagedkv.SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    llm.generate(prompts[:2], pagedkv.SamplingParams(temperature=0.0, max_tokens=4,
                                                       ignore_eos=True), use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = sum(len(c.token_ids) for o in outs for c in o.outputs)
    del llm
    torch.cuda.empty_cache()
    return {"generated_tokens": n, "wall_s": dt, "tok_s": n / dt}


def run_transformers(model, args):
    """transformers' ``generate``: greedy, static cache, eager (no ``torch.compile``)."""
    torch.cuda.empty_cache()
    ids = torch.tensor(_prompts(args, model.config.vocab_size), device="cuda")
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, cache_implementation="static", disable_compile=True,
              eos_token_id=None, pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
        model.generate(ids[:, :16], max_new_tokens=4, **{**kw, "attention_mask": mask[:, :16]})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, **kw)
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"generated_tokens": int(n), "wall_s": dt, "tok_s": n / dt,
            "note": "static cache, greedy, disable_compile=True"}


def _events_ms(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def measure_breakdown(runner, info, toks, pos):
    """GPU-side parts of one decode step at this step's exact state (K/V rewrites are idempotent)."""
    from pagedkv.kernels import paged_decode, scatter_kv

    n = info.num_seqs
    bs = runner._graph_size(n)
    buffers = runner.buffers
    h2d_ms = _events_ms(lambda: (buffers.to_device(info), runner._stage(toks, pos, n)))
    graph, _ = runner._graphs[bs]
    replay_ms = _events_ms(graph.replay)
    # The attention kernels alone, at the graph's shapes, over every layer, captured as a graph so
    # launch overhead is what the real replay pays.
    dev = buffers.device
    spec = runner.spec
    q = torch.randn(bs, runner.num_q_heads, spec.head_dim, device="cuda", dtype=runner.dtype)
    k = torch.randn(bs, spec.num_kv_heads, spec.head_dim, device="cuda", dtype=runner.dtype)
    v = torch.randn_like(k)
    slots = torch.full((bs,), -1, dtype=torch.int64, device="cuda")  # write nothing: keep the pool
    out = torch.empty_like(q)

    def kernels():
        for layer in range(spec.num_layers):
            scatter_kv(k, v, runner.pool.k_caches[layer], runner.pool.v_caches[layer], slots)
            paged_decode(q, runner.pool.k_caches[layer], runner.pool.v_caches[layer],
                         dev.block_tables[:bs], dev.seq_lens[:bs], out=out,
                         workspace=runner.workspace, max_seq_len=runner.max_model_len)

    kernels()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kernels()
    kernels_ms = _events_ms(g.replay)
    # Every linear layer (the weight-streaming part of "the rest"), at the graph's batch.
    lins = [m for m in runner.model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {f: torch.randn(bs, f, device="cuda", dtype=runner.dtype)
          for f in {lin.in_features for lin in lins}}

    def gemms():
        for lin in lins:
            torch.nn.functional.linear(xs[lin.in_features], lin.weight, lin.bias)

    gemms()
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        gemms()
    gemms_ms = _events_ms(g2.replay)
    seq_lens = dev.seq_lens[:n].to(torch.int64)
    kv_bytes = int(seq_lens.sum()) * spec.bytes_per_token
    return {"graph_batch": bs, "h2d_ms": h2d_ms, "replay_ms": replay_ms, "kernels_ms": kernels_ms,
            "rest_ms": replay_ms - kernels_ms, "gemms_ms": gemms_ms,
            "other_ms": replay_ms - kernels_ms - gemms_ms, "kv_bytes": kv_bytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    add_model_args(ap)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--contiguous", action="store_true",
                    help="also run the batch a max-length contiguous reservation fits")
    ap.add_argument("--llm", action="store_true",
                    help="also time pagedkv.LLM.generate end to end on the same prompts")
    ap.add_argument("--transformers", action="store_true",
                    help="also time transformers' generate with its static cache")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from pagedkv.engine.model_runner import ModelRunner

    t0 = time.perf_counter()
    loaded = build_model(args)
    t_build = time.perf_counter() - t0
    # The KV memory the batch needs (whole blocks), plus one block per sequence of slack.
    from pagedkv.config import CacheSpec

    per_seq_blocks = -(-(args.prompt + args.new) // args.block_size) + 1
    num_blocks = args.batch * per_seq_blocks
    t0 = time.perf_counter()
    runner = ModelRunner(loaded, block_size=args.block_size, num_blocks=num_blocks,
                         max_num_seqs=args.batch, max_num_batched_tokens=args.chunk,
                         cuda_graphs=True)
    t_capture = time.perf_counter() - t0
    res = run_batch(runner, args.batch, args.prompt, args.new, args.chunk, breakdown=True)
    wb = weight_bytes_per_step(loaded.model, args.batch)
    bd = res.get("breakdown", {})
    step_s = res["decode_step_ms_median"] / 1e3
    roof_bytes = wb + bd.get("kv_bytes", 0)
    report = {
        "device": torch.cuda.get_device_name(),
        "args": vars(args),
        "build_s": t_build,
        "runner_init_and_capture_s": t_capture,
        "graph_sizes": runner.graph_sizes,
        "num_blocks": runner.num_blocks,
        "kv_pool_gib": runner.pool.nbytes / 2**30,
        "weight_bytes_per_step": wb,
        "engine": res,
        "roofline_ms": 1e3 * roof_bytes / COPY_BW,
        "roofline_fraction_step": (roof_bytes / COPY_BW) / step_s,
    }
    if bd:
        report["roofline_fraction_replay"] = (roof_bytes / COPY_BW) / (bd["replay_ms"] / 1e3)
        report["bookkeeping_fraction"] = (res["bookkeeping_us_median"] / 1e6) / step_s
    if args.contiguous:
        fit = (runner.num_blocks * args.block_size) // runner.max_model_len
        if fit >= 1:
            report["contiguous"] = run_batch(runner, fit, args.prompt, args.new, args.chunk, seed=1)
            report["contiguous"]["note"] = (
                f"{fit} sequences: a {runner.max_model_len}-token reservation each in the same "
                f"{runner.num_blocks * args.block_size} token slots")
            report["paged_over_contiguous"] = (res["decode_tok_s"] /
                                               report["contiguous"]["decode_tok_s"])
    # Each comparison runs on its own: one that fails is reported, not fatal to the others.
    if args.llm:
        nb = runner.num_blocks
        del runner  # its pool and graphs; the LLM builds its own
        try:
            report["llm"] = run_llm(loaded, nb, args)
        except Exception as e:  # noqa: BLE001 - reported in the table and the JSON
            report["llm_error"] = repr(e)
    if args.transformers:
        try:
            report["transformers"] = run_transformers(loaded.model, args)
        except Exception as e:  # noqa: BLE001
            report["transformers_error"] = repr(e)
    print_table(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


def print_table(r):
    e = r["engine"]
    bd = e.get("breakdown", {})
    rows = [
        ("device", r["device"]),
        ("model", f"Llama-3-8B dims, random bf16, {r['args']['layers']} layers"),
        ("batch x prompt + new", f"{e['batch']} x {r['args']['prompt']} + {r['args']['new']}"),
        ("runner init + graph capture", f"{r['runner_init_and_capture_s']:.1f} s "
                                        f"(sizes {r['graph_sizes']})"),
        ("prefill", f"{e['prefill_tok_s']:,.0f} tok/s ({e['prefill_s']:.2f} s)"),
        ("decode step (median, wall)", f"{e['decode_step_ms_median']:.2f} ms"),
        ("decode tokens/s (median step)", f"{e['decode_tok_s']:,.0f}"),
        ("decode tokens/s (mean step)", f"{e['decode_tok_s_mean']:,.0f}"),
        ("end to end tokens/s (prefill incl.)", f"{e['end_to_end_tok_s']:,.0f}"),
        ("bookkeeping (append_batch+step)", f"{e['bookkeeping_us_median']:.1f} us "
                                            f"({100 * r.get('bookkeeping_fraction', 0):.2f}% of step)"),
    ]
    if bd:
        rows += [
            ("H2D copy (buffers + ids/pos)", f"{1e3 * bd['h2d_ms']:.1f} us"),
            ("graph replay (GPU)", f"{bd['replay_ms']:.3f} ms (batch {bd['graph_batch']})"),
            ("  attention kernels (scatter+decode)", f"{bd['kernels_ms']:.3f} ms"),
            ("  rest of the model", f"{bd['rest_ms']:.3f} ms"),
            ("    linear layers (GEMMs alone)", f"{bd['gemms_ms']:.3f} ms"),
            ("    norms, RoPE, activations, ...", f"{bd['other_ms']:.3f} ms"),
            ("roofline (weights + KV)", f"{r['roofline_ms']:.3f} ms"),
            ("roofline fraction (replay)", f"{100 * r['roofline_fraction_replay']:.1f}%"),
        ]
    rows.append(("roofline fraction (whole step)", f"{100 * r['roofline_fraction_step']:.1f}%"))
    if "contiguous" in r:
        c = r["contiguous"]
        rows.append(("contiguous max-length reservation", f"{c['decode_tok_s']:,.0f} tok/s at batch "
                                                          f"{c['batch']}"))
        rows.append(("paged / contiguous", f"{r['paged_over_contiguous']:.1f}x"))
    if "llm" in r:
        rows.append(("pagedkv.LLM.generate end to end", f"{r['llm']['tok_s']:,.0f} tok/s "
                                                       f"({r['llm']['wall_s']:.2f} s)"))
    if "transformers" in r:
        t = r["transformers"]
        rows.append(("transformers generate (static)", f"{t['tok_s']:,.0f} tok/s ({t['wall_s']:.2f} s)"))
        if "llm" in r:
            rows.append(("LLM.generate / transformers", f"{r['llm']['tok_s'] / t['tok_s']:.1f}x"))
    for key in ("llm_error", "transformers_error"):
        if key in r:
            rows.append((key, r[key][:200]))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
