"""The engine's own host time per decode step, without a model: what ``LLMEngine.step`` costs
around the forward (scheduling, the manager's step, sampling bookkeeping, stop checks, outputs).

On a GPU this work runs while the device idles between two steps (the step's token ids are read
back before the next step is built), so it adds to every decode step of ``LLM.generate``. This
bench isolates it on any machine: a tiny random Llama is loaded (no tokenizer, as the GPU benches'
random models), and ``ModelRunner.execute`` is replaced by a stub that returns precomputed random
logits over a 128-token vocabulary, so the sampler's device work is negligible and what is timed
is the engine's Python and the core's bookkeeping. Requests are greedy with ``ignore_eos`` and the
``FINAL_ONLY`` outputs ``LLM.generate`` asks for.

For each batch size: the batch is admitted and prefilled, then ``--steps`` decode steps are timed
one by one; the table gives the median and p90 per step and per sequence. ``--profile B`` prints a
cProfile table of batch ``B``'s steps. ``--json`` writes the figures.

``--ttft N [N ...]``: instead, the host time of one ``generate`` call (``max_tokens=1``) of an
``N``-token prompt whose full blocks are cached, in the GPU pool (``gpu``) or only in the host
tier (``host``: another prompt of the same length evicted them first), with the same stub: what
a prefix hit's time to first token pays on the host besides the forward and its loads.

Usage (repository root): ``PYTHONPATH=python python benches/bench_engine_host.py
[--batches 1,32,128,256] [--steps 60] [--json out.json] [--profile 256]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def build(max_len: int):
    import transformers

    from pagedkv.engine.loader import LoadedModel

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return LoadedModel(model=model, tokenizer=None, config=model.config, max_model_len=max_len,
                       eos_token_ids=[], path="random-tiny")


def run(loaded, batch: int, steps: int, prompt: int, profile: bool) -> dict:
    import pagedkv
    from pagedkv.engine.sampling_params import RequestOutputKind

    blocks_per_seq = -(-(prompt + steps + 8) // 16)
    llm = pagedkv.LLM(loaded, device="cpu", num_blocks=batch * blocks_per_seq + 16, block_size=16,
                      max_num_seqs=batch, max_num_batched_tokens=max(8192, batch * prompt),
                      progress=False)
    eng = llm.llm_engine
    vocab = int(loaded.config.vocab_size)
    g = torch.Generator().manual_seed(batch)
    bank = torch.randn(64, batch, vocab, generator=g)
    calls = [0]

    def execute(ids, pos, step, rows, extra_logit_indices=None):
        calls[0] += 1
        n = len(rows) + len(extra_logit_indices or [])
        return bank[calls[0] % 64, :n] if n <= batch else torch.randn(n, vocab)

    eng.runner.execute = execute
    sp = pagedkv.SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(batch):
        eng.add_request(f"r{i}", {"prompt_token_ids": [(i * 7 + j) % vocab for j in range(prompt)]},
                        sp)
    for _ in range(3):  # the prefill of the whole batch (one step's budget), then warm decodes
        eng.step()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    llm.shutdown()
    times.sort()
    med = statistics.median(times)
    return {"batch": batch, "median_us": med * 1e6, "p90_us": times[int(0.9 * (len(times) - 1))] * 1e6,
            "per_seq_us": med * 1e6 / batch, "steps": steps}


def run_ttft(n: int, tier: str, reps: int) -> dict:
    import random

    import pagedkv

    loaded = build(n + 64)
    vocab = int(loaded.config.vocab_size)
    kw = {"host_cache_memory": "256MiB"} if tier == "host" else {}
    llm = pagedkv.LLM(loaded, device="cpu", num_blocks=n // 16 * 102 // 100 + 32, block_size=16,
                      max_num_seqs=4, max_num_batched_tokens=8192, progress=False, **kw)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(n))
    llm.llm_engine.runner.execute = (
        lambda ids, pos, step, rows, extra_logit_indices=None: logits[:len(rows)])
    rng = random.Random(n)
    prompt = [rng.randrange(vocab) for _ in range(n)]
    sp = pagedkv.SamplingParams(temperature=0.0, max_tokens=1)

    def gen(ids):
        llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)

    gen(prompt)
    times = []
    before = dict(llm.stats().prefix_hits_by_tier)
    for _ in range(reps):
        if tier == "host":
            gen([rng.randrange(vocab) for _ in range(n)])  # evicts the prompt's blocks
        t0 = time.perf_counter()
        gen(prompt)
        times.append(time.perf_counter() - t0)
    hits = {k: v - before.get(k, 0) for k, v in llm.stats().prefix_hits_by_tier.items()}
    llm.shutdown()
    return {"prompt": n, "tier": tier, "median_ms": statistics.median(times) * 1e3,
            "min_ms": min(times) * 1e3, "hits_by_tier": hits, "reps": reps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--profile", type=int, default=0, help="print a cProfile table at this batch")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ttft", type=int, nargs="+", default=None,
                    help="time generate() of cached N-token prompts instead (GPU and host tier)")
    ap.add_argument("--reps", type=int, default=9, help="generate() calls per --ttft figure")
    args = ap.parse_args(argv)
    if args.ttft:
        rows = [run_ttft(n, tier, args.reps) for n in args.ttft for tier in ("gpu", "host")]
        print(f"{'prompt':>7} {'cached in':>9} {'median':>9} {'min':>9}  hits")
        for r in rows:
            print(f"{r['prompt']:>7} {r['tier']:>9} {r['median_ms']:>7.2f}ms {r['min_ms']:>7.2f}ms  "
                  f"{r['hits_by_tier']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ttft": rows, "args": vars(args)}, f, indent=2)
        return 0
    batches = [int(b) for b in args.batches.split(",")]
    loaded = build(args.prompt + args.steps + 64)
    rows = [run(loaded, b, args.steps, args.prompt, b == args.profile) for b in batches]
    print(f"{'batch':>6} {'step median':>12} {'p90':>10} {'per sequence':>13}")
    for r in rows:
        print(f"{r['batch']:>6} {r['median_us']:>10.0f}us {r['p90_us']:>8.0f}us {r['per_seq_us']:>11.2f}us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
