"""Host tier on a GPU: time to first token of a prompt served from pinned host memory vs recomputed.

At Llama-3-8B dimensions (random bf16 weights, ``benches/_dims.py``), for each prompt length:

1. ``warm``: the prompt runs once (``max_tokens=1``), so its full blocks enter the prefix cache;
2. a different prompt of the same length runs, in a GPU pool sized to hold one prompt, so the
   first prompt's cached blocks are evicted — and written back to the host tier;
3. ``host``: the first prompt again: its blocks are loaded from the host tier (the step's
   swap-in list), only the last partial block is prefilled; TTFT is the wall time of that
   ``generate`` call (one token);
4. ``recompute``: the same prompt under another tenant's ``cache_salt`` (nothing cached for it):
   a full prefill, same engine, same step;
5. ``copy``: a plain pinned host-to-device ``copy_`` of the same KV bytes, the bound on a load.

Also (``--reuse``) a reuse workload: ``--reuse-prompts`` unique prompts of ``--reuse-len`` tokens,
whose KV is several times the GPU pool, each asked twice in two passes; throughput of the second
pass (tokens/s of prompt + one generated token) with the host tier against without (the second
pass then recomputes whatever the GPU pool evicted).

Prints a table, writes JSON (``--json``). Usage (GPU machine, repository root):
``PYTHONPATH=python python3 benches/bench_tiers_gpu.py [--lens 1024 4096 16384 32768] [--reuse]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from _dims import add_model_args, llama_config, model_dims


def build(args):
    import transformers

    from pagedkv.engine.loader import LoadedModel

    cfg = llama_config(model_dims(args), args.max_model_len)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM._from_config(cfg, dtype=dtype)
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=None, config=model.config,
                       max_model_len=args.max_model_len, eos_token_ids=[], path="random-llama")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ttft(llm, ids, salt=None) -> float:
    import pagedkv

    sp = pagedkv.SamplingParams(temperature=0.0, max_tokens=1)
    sync()
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False, cache_salt=salt)
    sync()
    return time.perf_counter() - t0


def profiled(llm, ids, out_dir: str, label: str) -> None:
    """One host-tier TTFT under the torch profiler: prints the busiest CUDA and CPU ops and writes
    a Chrome trace (``{out_dir}/trace_{label}.json``), to see where the wall time goes."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    pr = cProfile.Profile()
    with profile(activities=acts) as prof:
        pr.enable()
        t = ttft(llm, ids)
        pr.disable()
    print(f"  profile {label}: wall {t*1e3:.2f} ms")
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=15))
    pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
    prof.export_chrome_trace(f"{out_dir}/trace_{label}.json")


def copy_time(nbytes: int, device: str, reps: int = 5) -> float:
    cuda = device == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def run_lengths(loaded, args) -> list:
    import pagedkv

    rows = []
    bs = args.block_size
    vocab = loaded.config.vocab_size
    g = torch.Generator().manual_seed(1)
    longest = max(args.lens)
    # One longest prompt's blocks (and a small margin) on the GPU: two other longest prompts
    # after the timed one evict every block of it (it is the least recently used).
    num_blocks = longest // bs + 64
    llm = pagedkv.LLM(loaded, device=args.device, num_blocks=num_blocks, block_size=bs,
                      max_num_seqs=4, max_num_batched_tokens=args.chunk,
                      host_cache_memory=args.host_cache, progress=False)
    kv_token = llm.llm_engine.runner.spec.bytes_per_token

    def evict_others():
        for _ in range(2):
            ttft(llm, torch.randint(0, vocab, (llm.max_model_len - 1,), generator=g).tolist())

    for n in args.lens:
        host_t, rec_t = [], []
        for rep in range(args.reps):
            a = torch.randint(0, vocab, (n,), generator=g).tolist()
            ttft(llm, a)
            evict_others()
            before = llm.stats().prefix_hits_by_tier
            host_t.append(ttft(llm, a))
            after = llm.stats().prefix_hits_by_tier
            hits = after.get("host", 0) - before.get("host", 0)
            gpu_hits = after.get("gpu", 0) - before.get("gpu", 0)
            if gpu_hits:
                print(f"  warning: {gpu_hits} tokens of the {n}-token prompt were still on the GPU")
            rec_t.append(ttft(llm, a, salt=f"other-tenant-{n}-{rep}"))
        if args.profile_dir and n in args.profile_lens:
            a = torch.randint(0, vocab, (n,), generator=g).tolist()
            ttft(llm, a)
            evict_others()
            profiled(llm, a, args.profile_dir, f"host_{n}")
        full = (n // bs) * bs
        cp = copy_time(full * kv_token, args.device)
        h, r = statistics.median(host_t), statistics.median(rec_t)
        rows.append({"prompt": n, "host_ttft_ms": h * 1e3, "recompute_ttft_ms": r * 1e3,
                     "speedup": r / h, "copy_ms": cp * 1e3, "host_hit_tokens": hits,
                     "gpu_hit_tokens": gpu_hits, "load_fraction_of_copy": cp / h})
        line = (f"  {n:>6} tokens: host {h*1e3:8.2f} ms   recompute {r*1e3:8.2f} ms   "
                f"x{r/h:5.1f}   plain copy {cp*1e3:6.2f} ms   host hits {hits}")
        print(line, flush=True)
    llm.shutdown()
    return rows


def run_reuse(loaded, args) -> dict:
    import pagedkv

    vocab = loaded.config.vocab_size
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, vocab, (args.reuse_len,), generator=g).tolist()
               for _ in range(args.reuse_prompts)]
    sp = pagedkv.SamplingParams(temperature=0.0, max_tokens=1)
    out = {}
    for label, host in (("no tier", None), ("host tier", args.reuse_host)):
        llm = pagedkv.LLM(loaded, device=args.device, num_blocks=args.reuse_blocks,
                          block_size=args.block_size, max_num_seqs=256,
                          max_num_batched_tokens=args.chunk, host_cache_memory=host,
                          progress=False)
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        sync()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        sync()
        dt = time.perf_counter() - t0
        st = llm.stats()
        out[label] = {"seconds": dt, "tokens_per_s": len(prompts) * (args.reuse_len + 1) / dt,
                      "hits_by_tier": dict(st.prefix_hits_by_tier),
                      "first_tokens": [o.outputs[0].token_ids[0] for o in outs[:8]]}
        print(f"  reuse, {label:9}: {dt:7.2f} s  {out[label]['tokens_per_s']:10.0f} tok/s  "
              f"hits {out[label]['hits_by_tier']}", flush=True)
        llm.shutdown()
        del llm
        if args.device == "cuda":
            torch.cuda.empty_cache()
    out["speedup"] = out["no tier"]["seconds"] / out["host tier"]["seconds"]
    out["same_outputs"] = out["no tier"]["first_tokens"] == out["host tier"]["first_tokens"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--lens", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=33792)
    ap.add_argument("--host-cache", default="12GiB")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--reuse-prompts", type=int, default=2000)
    ap.add_argument("--reuse-len", type=int, default=512)
    ap.add_argument("--reuse-blocks", type=int, default=8192, help="GPU pool of the reuse run")
    ap.add_argument("--reuse-host", default="80GiB")
    ap.add_argument("--skip-lens", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile-dir", default=None,
                    help="profile one more host-tier TTFT per --profile-lens length: tables "
                         "printed, Chrome traces written here")
    ap.add_argument("--profile-lens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a dry run of the script's paths (fp32; give small dimensions)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_tiers_gpu: needs CUDA (--device cpu for a dry run)", file=sys.stderr)
        return 2
    loaded = build(args)
    res = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "args": vars(args)}
    if not args.skip_lens:
        print("TTFT from the host tier vs recompute (Llama-3-8B dims, bf16):")
        res["lengths"] = run_lengths(loaded, args)
    if args.reuse:
        print(f"reuse workload: {args.reuse_prompts} x {args.reuse_len}-token prompts, twice; "
              f"GPU pool {args.reuse_blocks} blocks")
        res["reuse"] = run_reuse(loaded, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
