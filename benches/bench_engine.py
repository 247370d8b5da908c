"""Engine benchmark on a GPU: decode at Llama-3-8B dimensions with random bf16 weights, per batch.

Builds ``LlamaForCausalLM`` from a ``LlamaConfig`` (32 layers, hidden 4096, 32/8 heads, MLP 14336,
vocab 128256) with transformers and, at every batch size of ``--batches`` (default 1, 32, 128,
256; ``--prompt`` tokens each, ``--new`` greedy new tokens), in one run:

- drives :class:`pagedkv.engine.model_runner.ModelRunner` directly with a
  :class:`pagedkv.BlockManager` (chunked prefill of every prompt, then greedy decode of the
  batch): prefill tokens/s, the decode step (median wall time of a whole step: bookkeeping,
  copies, the graph replay, the argmax read back) and its floor, ``(weights read per step + the
  batch's KV bytes at mid-decode) / 4.8 TB/s`` (the H200's HBM bandwidth; the 4.24 TB/s copy
  rate is in the JSON too), as a fraction;
- the step's breakdown at mid-decode: H2D copies, graph replay, the attention kernels alone
  (``scatter_kv`` + ``paged_decode`` over every layer, as a graph), the GEMMs alone (the ones
  the step runs, as a graph), and the rest (norms, RoPE, activations, residual adds, embedding);
- with ``--llm``: ``pagedkv.LLM.generate`` end to end on the same prompts (scheduler, sampler,
  detokenization off): generated tokens/s, TTFT (the batch's prefill and first token) and the
  decode step it implies, against the same floor;
- with ``--llm --async-ab``: the same ``LLM.generate`` runs with and without
  ``async_scheduling`` (the next step scheduled while the previous runs), taking turns, 3 each:
  the median decode step of each and their ratio;
- with ``--contiguous``: the same engine limited to the batch that a contiguous ``max_model_len``
  reservation per sequence fits in the largest batch's KV memory;
- with ``--ab``: all of the above also with ``fused_model=False`` (transformers' module forwards;
  the fused forward is :mod:`pagedkv.engine.fused`), side by side;
- with ``--transformers 1,128``: transformers' ``generate`` (greedy, static cache) at those
  batch sizes, eager and with its automatic ``torch.compile`` (``--no-compiled`` skips it), and
  with ``--generate-batch 1,128`` its continuous batching (``generate_batch``).

Usage (on the GPU machine, repository root): ``PYTHONPATH=python python3 benches/bench_engine.py
[--batches 1,32,128,256] [--ab] [--llm] [--transformers 1,128] [--json out.json]``.
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

COPY_BW = 4.24e12  # bytes/s: the H200 copy bandwidth the project's kernel targets use
SPEC_BW = 4.8e12  # bytes/s: the H200's HBM3e bandwidth, the decode-step floor's denominator
#: Datasheet HBM bandwidth by device name (the floor's denominator): H100 SXM 3.35 TB/s.
SPEC_BW_BY_NAME = {"H200": 4.8e12, "H100": 3.35e12}


def spec_bandwidth() -> float:
    """The current device's datasheet HBM bandwidth (the H200's when the name is not known)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((bw for key, bw in SPEC_BW_BY_NAME.items() if key in name), SPEC_BW)


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
    from pagedkv.engine.core import build_block_manager

    mgr = build_block_manager(runner, enable_prefix_caching=False)
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
    step_times, book_times, exec_times = [], [], []
    ctx = prompt_len
    pos = np.full(batch, prompt_len, dtype=np.int64)
    mid = None
    for i in range(new_tokens - 1):
        t_a = time.perf_counter()
        mgr.append_batch(sids, toks)
        info = mgr.step(sids, 1)
        t_b = time.perf_counter()
        logits = runner.execute(toks, pos, info, range(batch))
        exec_times.append(time.perf_counter() - t_b)
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
        # Host time inside runner.execute (validation, staging, plan, graph launch; it returns
        # once the inputs are copied, before the GPU finishes the step).
        "execute_host_us_median": 1e6 * statistics.median(exec_times),
        "mean_context": prompt_len + new_tokens / 2,
        # Generated tokens over the whole run, prefill included: comparable to generate's rate.
        "end_to_end_tok_s": batch * new_tokens / (prefill_s + sum(step_times)),
    }
    if mid is not None:
        out["breakdown"] = mid
    for s in range(batch):
        mgr.free(s)
    return out


def _prompts(args, vocab, batch, seed=0):
    g = np.random.default_rng(seed)
    return [g.integers(0, vocab, args.prompt).tolist() for _ in range(batch)]


def make_llm(loaded, num_blocks, max_seqs, args, fused, async_scheduling=False):
    import pagedkv

    torch.cuda.empty_cache()
    llm = pagedkv.LLM(loaded, device="cuda", num_blocks=num_blocks, block_size=args.block_size,
                      max_num_seqs=max_seqs, max_num_batched_tokens=args.chunk,
                      enable_prefix_caching=False, progress=False, fused_model=fused,
                      cuda_graph_pieces=args.graph_pieces if fused else 1,
                      async_scheduling=async_scheduling)
    prompts = _prompts(args, loaded.config.vocab_size, 2, seed=99)
    llm.generate(prompts, pagedkv.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    return llm


def run_llm(llm, loaded, batch, args):
    """``pagedkv.LLM.generate`` end to end at ``batch`` prompts: what a user of the offline API
    gets. TTFT: the same prompts with ``max_tokens=1`` (the whole batch's prefill and first
    token); the decode step: the full run's time past that, over its remaining steps."""
    import pagedkv

    prompts = _prompts(args, loaded.config.vocab_size, batch)

    def timed(n):
        sp = pagedkv.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, sum(len(c.token_ids) for o in outs for c in o.outputs)

    ttft, _ = timed(1)
    dt, n = timed(args.new)
    return {"generated_tokens": n, "wall_s": dt, "tok_s": n / dt, "ttft_ms": 1e3 * ttft,
            "decode_step_ms": 1e3 * (dt - ttft) / max(1, args.new - 1)}


def run_transformers(model, batch, args, compiled):
    """transformers' ``generate``: greedy, static cache, eager (``disable_compile``) or with its
    automatic ``torch.compile`` of the decode forward (the warm-up at the same shapes compiles)."""
    torch.cuda.empty_cache()
    ids = torch.tensor(_prompts(args, model.config.vocab_size, batch), device="cuda")
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, cache_implementation="static", disable_compile=not compiled,
              eos_token_id=None, pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
        t0 = time.perf_counter()
        # Warm-up at the timed shapes (compiled: this is where the compile happens).
        model.generate(ids, max_new_tokens=8 if compiled else 2, min_new_tokens=8 if compiled else 2,
                       **kw)
        torch.cuda.synchronize()
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, **kw)
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"generated_tokens": int(n), "wall_s": dt, "tok_s": n / dt, "warmup_s": warm,
            "note": "static cache, greedy, " + ("torch.compile (transformers' default)" if compiled
                                                else "disable_compile=True")}


def run_generate_batch(model, batch, args):
    """transformers' continuous batching (``generate_batch``), greedy, its own paged cache."""
    import transformers

    torch.cuda.empty_cache()
    prompts = _prompts(args, model.config.vocab_size, batch)
    gc = transformers.GenerationConfig(max_new_tokens=args.new, min_new_tokens=args.new,
                                       do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():
        model.generate_batch(prompts[:2], generation_config=gc)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=gc)
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = sum(len(o.generated_tokens) for o in out.values())
    return {"generated_tokens": int(n), "wall_s": dt, "tok_s": n / dt}


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


def step_gemms(runner):
    """(weight, bias) of every GEMM one step runs: the fused Q|K|V and gate|up weights when the
    runner runs the fused forward, each projection otherwise; the LM head."""
    out = []
    for layer in runner.model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        if runner.fused:
            out += [att._pagedkv_qkv, (att.o_proj.weight, att.o_proj.bias), mlp._pagedkv_gate_up,
                    (mlp.down_proj.weight, mlp.down_proj.bias)]
        else:
            out += [(m.weight, m.bias) for m in (att.q_proj, att.k_proj, att.v_proj, att.o_proj,
                                                  mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    out.append((runner.model.lm_head.weight, runner.model.lm_head.bias))
    return out


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
    # Every GEMM the step runs (the weight-streaming part of "the rest"), at the graph's batch.
    lins = step_gemms(runner)
    xs = {w.shape[1]: torch.randn(bs, w.shape[1], device="cuda", dtype=runner.dtype)
          for w, _ in lins}

    def gemms():
        for w, b in lins:
            torch.nn.functional.linear(xs[w.shape[1]], w, b)

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


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def engine_arm(loaded, args, batches, fused):
    """The runner driven directly, then ``LLM.generate``, at every batch size: one arm of the
    fused/unfused comparison (each its own pool and graphs, built and freed in turn)."""
    from pagedkv.engine.model_runner import ModelRunner

    max_b = max(batches)
    per_seq_blocks = -(-(args.prompt + args.new) // args.block_size) + 1
    num_blocks = max_b * per_seq_blocks
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    runner = ModelRunner(loaded, block_size=args.block_size, num_blocks=num_blocks,
                         max_num_seqs=max_b, max_num_batched_tokens=args.chunk,
                         cuda_graphs=True, fused_model=fused,
                         cuda_graph_pieces=args.graph_pieces if fused else 1)
    arm = {"fused": runner.fused, "runner_init_and_capture_s": time.perf_counter() - t0,
           "graph_sizes": runner.graph_sizes, "num_blocks": runner.num_blocks, "batches": {}}
    # Compiles the prefill kernels' shapes once, outside every timed figure.
    run_batch(runner, min(2, max_b), args.prompt, 3, args.chunk, seed=7)
    for b in batches:
        res = run_batch(runner, b, args.prompt, args.new, args.chunk, breakdown=True)
        bd = res.get("breakdown", {})
        wb = weight_bytes_per_step(loaded.model, b)
        roof = wb + bd.get("kv_bytes", 0)
        res["weight_bytes_per_step"] = wb
        res["floor_ms"] = 1e3 * roof / spec_bandwidth()
        res["floor_ms_copy_bw"] = 1e3 * roof / COPY_BW
        res["floor_fraction_step"] = res["floor_ms"] / res["decode_step_ms_median"]
        if bd:
            res["floor_fraction_replay"] = res["floor_ms"] / bd["replay_ms"]
        arm["batches"][b] = res
        print(f"[{'fused' if fused else 'unfused'}] runner batch {b}: step "
              f"{res['decode_step_ms_median']:.2f} ms, floor {res['floor_ms']:.2f} ms", flush=True)
    if args.contiguous:
        # The same engine limited to the batch a contiguous max-length reservation per sequence
        # fits in the same KV memory.
        fit = (runner.num_blocks * args.block_size) // runner.max_model_len
        if fit >= 1:
            c = arm["contiguous"] = run_batch(runner, min(fit, max_b), args.prompt, args.new,
                                              args.chunk, seed=1)
            c["note"] = (f"{fit} sequences: a {runner.max_model_len}-token reservation each in "
                         f"the same {runner.num_blocks * args.block_size} token slots")
            big = arm["batches"][max_b]
            arm["paged_over_contiguous"] = big["decode_tok_s"] / c["decode_tok_s"]
    del runner
    if args.llm:
        try:
            llm = make_llm(loaded, num_blocks, max_b, args, fused)
            for b in batches:
                arm["batches"][b]["llm"] = r = run_llm(llm, loaded, b, args)
                r["floor_fraction"] = arm["batches"][b]["floor_ms"] / r["decode_step_ms"]
                print(f"[{'fused' if fused else 'unfused'}] LLM.generate batch {b}: "
                      f"{r['tok_s']:,.0f} tok/s, step {r['decode_step_ms']:.2f} ms, TTFT "
                      f"{r['ttft_ms']:.1f} ms", flush=True)
            if args.async_ab:
                # The same, with and without async_scheduling, taking turns (3 runs each).
                llm_a = make_llm(loaded, num_blocks, max_b, args, fused, async_scheduling=True)
                for b in batches:
                    runs = {"sync": [], "async": []}
                    for _ in range(3):
                        runs["sync"].append(run_llm(llm, loaded, b, args))
                        runs["async"].append(run_llm(llm_a, loaded, b, args))
                    ab = {k: statistics.median(x["decode_step_ms"] for x in v)
                          for k, v in runs.items()}
                    ab["ratio"] = ab["sync"] / ab["async"]
                    ab["floor_fraction_async"] = arm["batches"][b]["floor_ms"] / ab["async"]
                    ab["floor_fraction_sync"] = arm["batches"][b]["floor_ms"] / ab["sync"]
                    ab["steps_ahead"] = llm_a.llm_engine.core.num_async_steps
                    arm["batches"][b]["llm_async_ab"] = ab
                    print(f"[{'fused' if fused else 'unfused'}] LLM.generate batch {b}: decode "
                          f"step {ab['sync']:.2f} ms sync, {ab['async']:.2f} ms async "
                          f"({ab['ratio']:.3f}x; {100 * ab['floor_fraction_sync']:.0f}% -> "
                          f"{100 * ab['floor_fraction_async']:.0f}% of the floor)", flush=True)
                del llm_a
            del llm
        except Exception as e:  # noqa: BLE001 - reported in the table and the JSON
            arm["llm_error"] = repr(e)
    torch.cuda.empty_cache()
    return arm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=_ints, default=[1, 32, 128, 256],
                    help="comma-separated batch sizes (one runner and one LLM serve them all)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    add_model_args(ap)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--contiguous", action="store_true",
                    help="also run the batch a max-length contiguous reservation fits, at the "
                         "largest batch's KV memory")
    ap.add_argument("--graph-pieces", type=int, default=1,
                    help="capture each fused decode step as this many graphs (cuda_graph_pieces)")
    ap.add_argument("--ab", action="store_true",
                    help="also run every engine figure with fused_model=False (before/after)")
    ap.add_argument("--async-ab", action="store_true",
                    help="with --llm: LLM.generate with and without async_scheduling, in turns")
    ap.add_argument("--llm", action="store_true",
                    help="also time pagedkv.LLM.generate end to end on the same prompts")
    ap.add_argument("--transformers", type=_ints, default=[],
                    help="batch sizes at which to time transformers' generate (static cache, "
                         "eager and compiled)")
    ap.add_argument("--no-compiled", action="store_true",
                    help="skip transformers' compiled generate")
    ap.add_argument("--generate-batch", type=_ints, default=[],
                    help="batch sizes at which to time transformers' generate_batch")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    loaded = build_model(args)
    report = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
              "args": vars(args), "build_s": time.perf_counter() - t0,
              "spec_bandwidth": spec_bandwidth(), "copy_bandwidth": COPY_BW, "arms": {}}
    # The unfused arm first: fusing re-points the model's projection weights (views, same values).
    for fused in ([False, True] if args.ab else [True]):
        report["arms"]["fused" if fused else "unfused"] = engine_arm(loaded, args, args.batches,
                                                                     fused)
        _save(report, args)
    hf = report["transformers"] = {}

    def hf_run(b, key, fn):
        try:
            hf.setdefault(b, {})[key] = fn()
            print(f"transformers {key} batch {b}: {hf[b][key]['tok_s']:,.0f} tok/s", flush=True)
        except Exception as e:  # noqa: BLE001 - reported in the table and the JSON
            hf.setdefault(b, {})[key + "_error"] = repr(e)[:500]
        _save(report, args)

    # Compiled last: its compile is the longest part, and it leaves compiled code on the model.
    for b in args.transformers:
        hf_run(b, "eager", lambda: run_transformers(loaded.model, b, args, False))
    for b in args.generate_batch:
        hf_run(b, "generate_batch", lambda: run_generate_batch(loaded.model, b, args))
    if not args.no_compiled:
        for b in args.transformers:
            hf_run(b, "compiled", lambda: run_transformers(loaded.model, b, args, True))
    _save(report, args)
    print_table(report)
    return 0


def _save(report, args):
    """Writes the JSON so far: a run cut short still leaves every finished figure."""
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


def print_table(r):
    print(f"device {r['device']}, {r['date']}; Llama-3-8B dims, random bf16, "
          f"{r['args']['layers']} layers; {r['args']['prompt']} prompt + {r['args']['new']} new; "
          f"floor = (weights + KV) / {r['spec_bandwidth'] / 1e12:.1f} TB/s")
    arms = r["arms"]
    hdr = ("arm", "batch", "step ms", "floor ms", "% floor", "replay", "attn", "gemm", "other",
           "h2d us", "exec host us", "LLM tok/s", "LLM step", "% floor", "TTFT ms", "prefill tok/s")
    print(" | ".join(hdr))
    for name, arm in arms.items():
        for b, e in arm["batches"].items():
            bd = e.get("breakdown", {})
            llm = e.get("llm", {})
            cells = [name, str(b), f"{e['decode_step_ms_median']:.2f}", f"{e['floor_ms']:.2f}",
                     f"{100 * e['floor_fraction_step']:.0f}%",
                     f"{bd.get('replay_ms', float('nan')):.2f}",
                     f"{bd.get('kernels_ms', float('nan')):.2f}",
                     f"{bd.get('gemms_ms', float('nan')):.2f}",
                     f"{bd.get('other_ms', float('nan')):.2f}",
                     f"{1e3 * bd.get('h2d_ms', float('nan')):.0f}",
                     f"{e['execute_host_us_median']:.0f}",
                     f"{llm.get('tok_s', float('nan')):,.0f}",
                     f"{llm.get('decode_step_ms', float('nan')):.2f}",
                     f"{100 * llm.get('floor_fraction', float('nan')):.0f}%",
                     f"{llm.get('ttft_ms', float('nan')):.1f}", f"{e['prefill_tok_s']:,.0f}"]
            print(" | ".join(cells))
        if "contiguous" in arm:
            c = arm["contiguous"]
            print(f"{name} contiguous max-length reservation: {c['decode_tok_s']:,.0f} tok/s at "
                  f"batch {c['batch']}; paged at batch {max(arm['batches'])} / contiguous = "
                  f"{arm['paged_over_contiguous']:.1f}x")
        if "llm_error" in arm:
            print(f"{name} llm_error: {arm['llm_error'][:300]}")
    for b, t in r.get("transformers", {}).items():
        for key, v in t.items():
            if key.endswith("_error"):
                print(f"transformers {key} batch {b}: {v[:300]}")
                continue
            line = f"transformers {key} batch {b}: {v['tok_s']:,.0f} tok/s ({v['wall_s']:.2f} s)"
            fb = arms.get("fused", {}).get("batches", {}).get(b, {})
            fused = fb.get("llm")
            if fused:
                line += f"; LLM.generate (fused) / this = {fused['tok_s'] / v['tok_s']:.2f}x"
            ab = fb.get("llm_async_ab")
            if ab and fused:
                # The async run's tokens/s from its decode step, the same prefill and first token.
                new = r["args"]["new"]
                tok_s = b * new / (fused["ttft_ms"] / 1e3 + (new - 1) * ab["async"] / 1e3)
                line += f"; with async_scheduling {tok_s / v['tok_s']:.2f}x"
            print(line)
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
