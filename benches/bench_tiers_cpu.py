"""Tiers on the CPU: a multi-tenant multi-turn workload whose working set is many times the pool.

The engine runs a small real model (the embedded SmolLM2-135M, fp32 on the CPU) in a deliberately
small KV pool. ``--tenants`` tenants (each its own ``cache_salt`` and system prompt) have
``--users`` conversations each; every conversation runs ``--turns`` turns. Requests arrive one at
a time, round-robin over the conversations (turn ``t`` of every conversation, then turn ``t + 1``),
so by the time a conversation's next turn arrives its earlier turns' blocks have long been evicted
from the pool; one request at a time keeps TTFT a property of the cache (the prompt's prefill and
loads), not of a queue. Each turn's prompt is the whole conversation so far (system prompt, earlier
questions and the model's own answers, the new question), as a chat client sends it.

Three configurations, same workload, same model, same greedy sampling:

- ``none``: the pool alone (evicted blocks are lost, their tokens recomputed);
- ``host``: a host tier large enough for the working set (``--host-cache``);
- ``disk``: a small host tier (``--disk-host-cache``) over a disk tier in a temp directory.

For each: the request-level prefix hit ratio (prompt tokens served from any tier / prompt tokens),
hits by tier, mean and p90 TTFT (first token, from ``RequestOutput.metrics``), wall time, and
whether every answer equals the ``none`` run's token for token.

Prints a table, writes JSON (``--json``). Usage: ``PYTHONPATH=python python benches/bench_tiers_cpu.py``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time


def workload(args, vocab: int):
    rng = random.Random(args.seed)
    systems = [[rng.randrange(100, vocab) for _ in range(args.system_len)]
               for _ in range(args.tenants)]
    convs = []
    for t in range(args.tenants):
        for u in range(args.users):
            qs = [[rng.randrange(100, vocab) for _ in range(args.question_len)]
                  for _ in range(args.turns)]
            convs.append({"tenant": t, "questions": qs})
    return systems, convs


def run(config_name: str, args, extra: dict):
    import pagedkv

    llm = pagedkv.LLM(None, device="cpu", num_blocks=args.num_blocks, block_size=args.block_size,
                      max_num_seqs=2, max_num_batched_tokens=1024, progress=False, **extra)
    block_bytes = llm.llm_engine.runner.spec.bytes_per_block
    vocab = llm.llm_engine.vocab_size
    systems, convs = workload(args, vocab)
    history = [list(systems[c["tenant"]]) for c in convs]
    answers = []
    ttfts = []
    sp = pagedkv.SamplingParams(temperature=0.0, max_tokens=args.answer_len, ignore_eos=True)
    t0 = time.perf_counter()
    prompt_tokens = 0
    from tqdm import tqdm

    bar = tqdm(total=args.turns * len(convs), desc=config_name, unit="req", leave=False)
    for turn in range(args.turns):
        for i, c in enumerate(convs):
            history[i] = history[i] + c["questions"][turn]
            prompt_tokens += len(history[i])
            o = llm.generate([{"prompt_token_ids": list(history[i])}], sp, use_tqdm=False,
                             cache_salt=f"tenant-{c['tenant']}")[0]
            toks = list(o.outputs[0].token_ids)
            answers.append(toks)
            history[i] = history[i] + toks
            m = o.metrics
            if m is not None and m.first_token_time is not None:
                ttfts.append(m.first_token_time - m.arrival_time)
            bar.update(1)
    bar.close()
    wall = time.perf_counter() - t0
    st = llm.stats()
    llm.shutdown()
    hits = dict(getattr(st, "prefix_hits_by_tier", {}) or {})
    served = sum(hits.values()) if hits else st.prefix_hit_tokens
    ttfts.sort()
    return {
        "config": config_name, "wall_s": wall, "prompt_tokens": prompt_tokens,
        "block_bytes": block_bytes,
        "hit_ratio": served / prompt_tokens if prompt_tokens else 0.0, "hits_by_tier": hits,
        "mean_ttft_ms": statistics.mean(ttfts) * 1e3 if ttfts else None,
        "p90_ttft_ms": ttfts[int(0.9 * (len(ttfts) - 1))] * 1e3 if ttfts else None,
        "answers": answers,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-len", type=int, default=128)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--answer-len", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=24, help="the KV pool (blocks)")
    ap.add_argument("--host-cache", default="256MiB", help="the host config's tier (all of it)")
    ap.add_argument("--disk-host-cache", default="16MiB", help="the disk config's host tier")
    ap.add_argument("--disk-cache", default="256MiB")
    ap.add_argument("--configs", nargs="+", default=["none", "host", "disk"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            extra: dict = {}
            if name == "host":
                extra = {"host_cache_memory": args.host_cache}
            elif name == "disk":
                extra = {"host_cache_memory": args.disk_host_cache, "disk_cache_dir": tmp + "/kv",
                         "disk_cache_memory": args.disk_cache}
            print(f"running {name} ...", flush=True)
            results.append(run(name, args, extra))
    base = results[0]["answers"]
    pool_tokens = args.num_blocks * args.block_size
    work = args.tenants * (args.system_len + args.users * args.turns
                           * (args.question_len + args.answer_len))
    bb = results[0]["block_bytes"]
    print(f"\nworking set ~{work} tokens, KV pool {pool_tokens} tokens ({work / pool_tokens:.1f}x); "
          f"{bb / 2**10:.0f} KiB a block, working set {work / args.block_size * bb / 2**20:.0f} MiB")
    print(f"{'config':8} {'hit ratio':>9} {'mean TTFT':>10} {'p90 TTFT':>10} {'wall':>8}  "
          f"same  hits by tier")
    for r in results:
        same = r["answers"] == base
        r["same_outputs"] = same
        print(f"{r['config']:8} {r['hit_ratio']:9.1%} {r['mean_ttft_ms']:8.1f}ms "
              f"{r['p90_ttft_ms']:8.1f}ms {r['wall_s']:7.1f}s  {'yes' if same else 'NO ':4}  "
              f"{r['hits_by_tier']}")
    if args.json:
        for r in results:
            r.pop("answers")
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "working_set_tokens": work,
                       "pool_tokens": pool_tokens, "results": results}, f, indent=2)
    return 0 if all(r["same_outputs"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
