"""Speculative decoding with n-gram (prompt lookup) or draft-model drafts against plain
decoding, on the CPU.

The embedded demo model (SmolLM2-135M-Instruct) answers chat prompts that ask it to repeat or
lightly edit a passage given in the prompt — the workload prompt lookup is for: the answer copies
long runs of the prompt. For each setting (no speculation, then ``num_speculative_tokens`` k in
``--k``), greedy, the same prompts in one ``LLM.chat`` batch (``--batch`` at a time) and each
timed ``--repeats`` times after a warm-up, the settings round-robin (so load from other processes
falls on all alike): generated tokens/s (median), steps, draft tokens,
acceptance rate and mean acceptance length, and whether every output equals the plain one (it
must: greedy acceptance keeps outputs identical).

``--method draft`` drafts with a draft model instead (``--draft PATH``; default: the target itself,
so every draft is accepted and the figure is the draft model's cost at its ceiling: a draft as
expensive as the target cannot win, a real draft is several times cheaper).

Usage (repository root): ``PYTHONPATH=python python3 benches/bench_spec_ngram.py [--k 2,4]
[--method ngram|draft] [--draft PATH] [--max-tokens 96] [--batch 1] [--repeats 3] [--threads N]
[--json out.json]``. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

PASSAGE_A = (
    "The paged KV cache stores keys and values in fixed-size blocks. Each sequence owns a block "
    "table that maps its logical token positions to physical blocks, so memory is allocated one "
    "block at a time as the sequence grows, and blocks holding a shared prompt prefix can be "
    "reused by every request that starts with it."
)
PASSAGE_B = (
    "To make tea, boil fresh water, warm the pot, add one spoon of leaves per cup, pour the "
    "water over the leaves, wait four minutes, then pour the tea through a strainer into the cups "
    "and serve it with milk or lemon."
)

PROMPTS = [
    f"Repeat the following passage exactly, word for word:\n\n{PASSAGE_A}",
    f"Rewrite this passage, replacing the word 'blocks' with 'pages' everywhere and changing "
    f"nothing else:\n\n{PASSAGE_A}",
    f"Copy this recipe exactly as written:\n\n{PASSAGE_B}",
    f"Repeat this text, but write 'coffee' instead of 'tea':\n\n{PASSAGE_B}",
]


def _run(llm: Any, params: Any, batch: int) -> List[List[int]]:
    out: List[List[int]] = []
    for i in range(0, len(PROMPTS), batch):
        msgs = [[{"role": "user", "content": p}] for p in PROMPTS[i:i + batch]]
        res = llm.chat(msgs, params, use_tqdm=False)
        out.extend(r.outputs[0].token_ids for r in res)
    return out


def build(model: str, k: Optional[int], args: argparse.Namespace) -> Any:
    from pagedkv import LLM

    spec: Optional[Dict[str, Any]] = None
    if k is not None and args.method == "draft":
        spec = {"method": "draft_model", "model": args.draft or model, "num_speculative_tokens": k}
    elif k is not None:
        spec = {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    return LLM(model, device="cpu", progress=False, enable_prefix_caching=False,
               kv_cache_memory="256MiB", speculative_config=spec)


def measure(settings: List[Optional[int]], llms: List[Any], args: argparse.Namespace
            ) -> List[Dict[str, Any]]:
    """Times the settings round-robin (one run of each per round), so load from other processes
    falls on all of them alike; returns one row per setting (median wall time)."""
    from pagedkv import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in llms:
        _run(llm, params, args.batch)  # warm-up
    times: List[List[float]] = [[] for _ in llms]
    outs: List[Any] = [None] * len(llms)
    for _ in range(args.repeats):
        for i, llm in enumerate(llms):
            llm.llm_engine.reset_stats()
            t0 = time.perf_counter()
            outs[i] = _run(llm, params, args.batch)
            times[i].append(time.perf_counter() - t0)
    rows = []
    for k, llm, ts, out in zip(settings, llms, times, outs):
        s = llm.llm_engine.stats()  # the last round's
        gen = s.num_generated_tokens
        wall = statistics.median(ts)
        rows.append({
            "k": k, "wall_s": wall, "wall_s_all": ts, "tokens": gen, "tokens_per_s": gen / wall,
            "steps": s.num_steps, "drafts": s.spec_num_drafts,
            "draft_tokens": s.spec_num_draft_tokens, "accepted": s.spec_num_accepted_tokens,
            "acceptance_rate": s.spec_acceptance_rate,
            "mean_acceptance_length": s.spec_mean_acceptance_length,
            "accepted_by_position": s.spec_accepted_tokens_by_position,
            "outputs": out,
        })
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded demo)")
    ap.add_argument("--k", default="2,4", help="num_speculative_tokens values, comma-separated")
    ap.add_argument("--method", choices=("ngram", "draft"), default="ngram",
                    help="n-gram lookup, or a draft model (--draft)")
    ap.add_argument("--draft", default=None,
                    help="the draft model with --method draft (default: the target itself)")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=1, help="prompts per generate call")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    import torch

    from pagedkv.engine.loader import default_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or default_model_path()
    settings: List[Optional[int]] = [None, *(int(x) for x in args.k.split(",") if x)]
    rows = measure(settings, [build(model, k, args) for k in settings], args)
    base = rows[0]
    print(f"{'setting':<12} {'tok/s':>8} {'speedup':>8} {'steps':>6} {'drafts':>7} "
          f"{'draft tok':>9} {'accepted':>8} {'accept %':>8} {'mean len':>8} {'identical':>9}")
    for r in rows:
        name = "plain" if r["k"] is None else f"{args.method} k={r['k']}"
        same = r["outputs"] == base["outputs"]
        r["identical"] = same
        print(f"{name:<12} {r['tokens_per_s']:8.1f} {r['tokens_per_s'] / base['tokens_per_s']:7.2f}x "
              f"{r['steps']:6d} {r['drafts']:7d} {r['draft_tokens']:9d} {r['accepted']:8d} "
              f"{100 * r['acceptance_rate']:7.1f}% {r['mean_acceptance_length']:8.2f} "
              f"{'yes' if same else 'NO':>9}")
    result = {
        "bench": "spec_ngram" if args.method == "ngram" else "spec_draft", "model": model,
        "draft": (args.draft or model) if args.method == "draft" else None, "device": "cpu",
        "threads": torch.get_num_threads(), "repeats": args.repeats, "max_tokens": args.max_tokens, "batch": args.batch,
        "prompts": len(PROMPTS), "lookup": [args.lookup_min, args.lookup_max],
        "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows],
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
