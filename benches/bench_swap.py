"""Swap benchmark on a GPU: copy bandwidth, and swap against recompute at Llama-3-8B dimensions.

Part 1 — **bandwidth.** A device pool and a pinned host pool at Llama-3-8B's per-block size
(32 layers x K/V x 16 tokens x 8 KV heads x 128 x bf16 = 2 MiB a block). ``SwapEngine.swap_out``
then ``swap_in`` of ``--swap-blocks`` blocks at scattered device ids (a random permutation: every
block its own run on the device side), host ids either consecutive (one transfer a staging chunk)
or in runs of 4, against a plain pinned ``copy_`` of the same number of bytes between two
contiguous tensors (device -> pinned host, and back) on a side stream. Times are CUDA events around
the whole swap (gather, transfers, scatter), median of ``--reps``; the ratio swap / plain is the
figure the issue's target (>= 90%) reads.

Part 2 — **crossover.** ``LlamaForCausalLM`` from a ``LlamaConfig`` at Llama-3-8B dimensions,
random bf16 weights, run through :class:`~pagedkv.engine.model_runner.ModelRunner`. For each
context length L:

- swap: ``swap_out`` + ``swap_in`` of the sequence's ``ceil(L / 16)`` blocks (its real block
  table), host-synchronised wall time (what a preempted sequence pays to leave and come back);
- recompute, alone: the prefill of L tokens as the engine re-runs it, in chunks of the token
  budget (``--chunk``), one sequence per step;
- recompute, marginal: the same chunks each riding a step of ``--decode-batch`` decodes at context
  ``--decode-ctx``, minus a decode-only step measured just before each — what the recompute adds
  to steps that run anyway (how the scheduler re-admits a recomputed sequence).

The crossover is the smallest L from which swap stays cheaper than recompute. The cost model is then
fed the rates measured as the engine measures them at start-up (:meth:`ModelRunner.measure_rates`:
link bandwidth, prefill rate of a full step, step floor) and the core's ``BlockManager.decide`` is
asked on the live L-token sequence, alone (``batch_tokens=0``) and beside the decode batch (the
running sequences it counts by default); the table says whether it picked the faster mode in each
view. Mixed steps run eagerly, as the engine runs them.

Usage (GPU machine, repository root): ``PYTHONPATH=python python3 benches/bench_swap.py
[--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import numpy as np
import torch


DEV = "cuda"


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn, reps: int) -> float:
    if DEV != "cuda":
        return _wall_ms(fn, reps)
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times[1:])


def _wall_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps + 1):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times[1:])


def spec_8b():
    from pagedkv.config import CacheSpec

    if DEV != "cuda":  # the CPU dry run: same code paths, tiny shapes
        return CacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", block_size=16)
    return CacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16)


def bandwidth(args) -> dict:
    from pagedkv.kv_pool import KVPool
    from pagedkv.tiers.host import SwapEngine

    spec = spec_8b()
    n = args.swap_blocks
    pool = KVPool(spec, 2 * n, DEV, zero=False)
    eng = SwapEngine(pool, 2 * n)
    bpb = spec.bytes_per_block
    nbytes = n * bpb
    rng = np.random.default_rng(0)
    dev = rng.permutation(2 * n)[:n]
    consecutive = np.arange(n)
    runs4 = (np.arange(n) // 4) * 8 + np.arange(n) % 4  # runs of 4 host blocks, gaps of 4
    runs4 = runs4[runs4 < 2 * n][:n]
    dev = dev[: len(runs4)] if len(runs4) < n else dev
    out = {"block_bytes": bpb, "swap_blocks": n, "swap_bytes": nbytes,
           "staging_blocks": eng.staging_blocks}
    # Plain pinned copies of the same bytes between contiguous tensors, on a side stream.
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEV == "cuda")
    side = torch.cuda.Stream() if DEV == "cuda" else None

    def plain(a, b):
        def f():
            if side is None:
                a.copy_(b)
                return
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                a.copy_(b, non_blocking=True)
            torch.cuda.current_stream().wait_stream(side)
        return f

    d2h = _median_ms(plain(dst, src), args.reps)
    h2d = _median_ms(plain(src, dst), args.reps)
    out["plain_d2h_GBps"] = nbytes / d2h / 1e6
    out["plain_h2d_GBps"] = nbytes / h2d / 1e6

    def swap(fn, pairs):
        def f():
            fn(pairs)
            eng.wait()  # the current stream waits for the device side; events end on it
            if eng.is_cuda:
                # The transfers to host finish on the side stream: wait for those too.
                torch.cuda.current_stream().wait_stream(eng.out_stream)
                torch.cuda.current_stream().wait_stream(eng.in_stream)
        return f

    for name, host in (("consecutive", consecutive), ("runs4", runs4)):
        m = min(len(dev), len(host))
        pairs_out = np.stack([dev[:m], host[:m]], 1)
        pairs_in = np.stack([host[:m], dev[:m]], 1)
        t_out = _median_ms(swap(eng.swap_out, pairs_out), args.reps)
        t_in = _median_ms(swap(eng.swap_in, pairs_in), args.reps)
        b = m * bpb
        out[f"swap_out_{name}_GBps"] = b / t_out / 1e6
        out[f"swap_in_{name}_GBps"] = b / t_in / 1e6
        out[f"swap_out_{name}_vs_plain"] = (b / t_out) / (nbytes / d2h)
        out[f"swap_in_{name}_vs_plain"] = (b / t_in) / (nbytes / h2d)
    # Correctness at this size: a round trip restores every byte.
    before = pool.kv[:, :, dev[:8]].clone()
    eng.swap_out(np.stack([dev[:8], consecutive[:8]], 1))
    eng.wait()
    pool.kv[:, :, dev[:8]].zero_()
    eng.swap_in(np.stack([consecutive[:8], dev[:8]], 1))
    eng.wait()
    out["round_trip_exact"] = bool(torch.equal(pool.kv[:, :, dev[:8]].view(torch.uint8),
                                               before.view(torch.uint8)))
    del pool, eng, src, dst
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return out


def build_model(max_model_len: int):
    import transformers

    from pagedkv.engine.loader import LoadedModel

    dims = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8)
    if DEV != "cuda":
        dims = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    cfg = transformers.LlamaConfig(
        **dims, max_position_embeddings=max_model_len,
        rope_theta=500000.0, initializer_range=0.02, eos_token_id=None, bos_token_id=None,
        pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = transformers.LlamaForCausalLM._from_config(
            cfg, dtype=torch.bfloat16 if DEV == "cuda" else torch.float32)
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=None, config=model.config,
                       max_model_len=max_model_len, eos_token_ids=[], path="random")


def crossover(args) -> dict:
    from pagedkv.engine.core import build_block_manager
    from pagedkv.engine.model_runner import ModelRunner
    from pagedkv.manager import CostModel

    lengths = [int(x) for x in args.lengths.split(",")]
    max_len = max(lengths) + args.decode_ctx + 1024
    loaded = build_model(max_len)
    bs = 16
    steps = 2 * (args.reps_model + 1) * sum(math.ceil(L / args.chunk) for L in lengths) + 64
    need = math.ceil(max(lengths) / bs) * 2 + args.decode_batch * (
        math.ceil((args.decode_ctx + steps) / bs)) + 64
    budget = args.chunk + args.decode_batch
    runner = ModelRunner(loaded, block_size=bs, num_blocks=need, max_num_seqs=args.decode_batch + 1,
                         max_num_batched_tokens=budget, cuda_graphs=False)
    swap = runner.enable_swap(math.ceil(max(lengths) / bs) + 8)
    rates = runner.measure_rates()
    kvb = runner.spec.bytes_per_token
    res = {"measured_link_GBps": rates.host_link_bytes_per_s / 1e9,
           "measured_prefill_tok_s": rates.prefill_tokens_per_s,
           "measured_step_floor_ms": 1e3 * rates.step_floor_s,
           "kv_bytes_per_token": kvb, "step_budget": budget, "rows": []}
    vocab = runner.config.vocab_size
    rng = np.random.default_rng(1)
    mgr = build_block_manager(runner, enable_prefix_caching=False, num_host_blocks=swap.host.num_blocks)
    mgr.cost_model = CostModel(rates.host_link_bytes_per_s, rates.prefill_tokens_per_s,
                               float(kvb), step_floor_s=rates.step_floor_s,
                               max_step_tokens=budget)

    # The running decode batch of the marginal view: prefilled once, one token a measured step.
    dec_ids = list(range(1000, 1000 + args.decode_batch))
    ctx = args.decode_ctx
    for sid in dec_ids:
        prompt = rng.integers(0, vocab, ctx).tolist()
        mgr.admit(sid, prompt)
        info = mgr.step([sid], [ctx])
        runner.execute(prompt, np.arange(ctx), info, [0])
    dec_tok = rng.integers(0, vocab, len(dec_ids)).tolist()
    dec_pos = [ctx]
    next_id = [0]

    def timed(fn) -> float:
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        return time.perf_counter() - t0

    def step(ids, news, inp, pos, rows):
        info = mgr.step(ids, news)
        return timed(lambda: runner.execute(np.array(inp), np.array(pos), info, rows))

    def decode_only() -> float:
        mgr.append_batch(dec_ids, dec_tok)
        t = step(dec_ids, [1] * len(dec_ids), dec_tok, [dec_pos[0]] * len(dec_ids),
                 [len(dec_ids) - 1])
        dec_pos[0] += 1
        return t

    def prefill(L: int, beside: bool) -> tuple:
        """Prefills a fresh L-token sequence in chunks of ``--chunk`` as the scheduler feeds a
        re-admitted one: alone (one sequence a step), or beside the decode batch with a decode-only
        step before every chunk step; returns (seconds it cost, its seq id)."""
        sid = next_id[0]
        next_id[0] += 1
        prompt = rng.integers(0, vocab, L).tolist()
        done, cost = 0, 0.0
        while done < L:
            k = min(args.chunk, L - done)
            base = decode_only() if beside else 0.0
            if done == 0:
                mgr.admit(sid, prompt, max_new_tokens=k)
            else:
                mgr.append(sid, prompt[done:done + k])
            chunk, pos = prompt[done:done + k], list(range(done, done + k))
            if beside:
                mgr.append_batch(dec_ids, dec_tok)
                n = len(dec_ids)
                t = step(dec_ids + [sid], [1] * n + [k], dec_tok + chunk,
                         [dec_pos[0]] * n + pos, [n])
                dec_pos[0] += 1
            else:
                t = step([sid], [k], chunk, pos, [0])
            cost += t - base
            done += k
        return cost, sid

    for L in lengths:
        row = {"L": L}
        alone, marg = [], []
        sid = None
        for r in range(args.reps_model + 1):  # the first is a warm-up
            c, s2 = prefill(L, beside=True)
            mgr.free(s2)
            if sid is not None:
                mgr.free(sid)
            c0, sid = prefill(L, beside=False)
            if r:
                alone.append(1e3 * c0)
                marg.append(1e3 * max(0.0, c))
        row["recompute_alone_ms"] = statistics.median(alone)
        row["recompute_marginal_ms"] = statistics.median(marg)
        table = mgr.block_table(sid)
        host = np.arange(len(table))
        pairs_out = np.stack([np.array(table), host], 1)
        pairs_in = np.stack([host, np.array(table)], 1)

        def round_trip():
            swap.swap_out(pairs_out)
            swap.swap_in(pairs_in)
            swap.synchronize()

        row["swap_ms"] = _wall_ms(round_trip, args.reps)
        # The core's decision on the live L-token sequence: nothing else running, and beside the
        # decode batch (the running sequences the manager counts by default).
        d_alone = mgr.decide([sid], batch_tokens=0)
        d_marg = mgr.decide([sid])
        mgr.free(sid)
        for view, d, key in (("alone", d_alone, "recompute_alone_ms"),
                             ("marginal", d_marg, "recompute_marginal_ms")):
            faster = "swap" if row["swap_ms"] < row[key] else "recompute"
            row[f"model_{view}"] = d.mode
            row[f"model_{view}_swap_ms"] = 1e3 * d.swap_cost_s
            row[f"model_{view}_recompute_ms"] = 1e3 * d.recompute_cost_s
            row[f"faster_{view}"] = faster
            row[f"model_right_{view}"] = faster == d.mode
        row["batch_tokens"] = d_marg.batch_tokens
        res["rows"].append(row)
        print(json.dumps(row), flush=True)

    def cross(key):
        rows = res["rows"]
        for i, r in enumerate(rows):
            if all(q["swap_ms"] < q[key] for q in rows[i:]):
                return r["L"]
        return None

    def model_cross(view):
        rows = res["rows"]
        for i, r in enumerate(rows):
            if all(q[f"model_{view}"] == "swap" for q in rows[i:]):
                return r["L"]
        return None

    res["crossover_alone"] = cross("recompute_alone_ms")
    res["crossover_marginal"] = cross("recompute_marginal_ms")
    res["model_crossover_alone"] = model_cross("alone")
    res["model_crossover_marginal"] = model_cross("marginal")
    res["model_right_everywhere"] = all(r["model_right_alone"] and r["model_right_marginal"]
                                        for r in res["rows"])
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--swap-blocks", type=int, default=512, help="blocks per bandwidth swap (2 MiB each)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--reps-model", type=int, default=2)
    p.add_argument("--lengths", default="16,64,256,512,1024,2048,4096,8192,16384")
    p.add_argument("--chunk", type=int, default=2048, help="prefill token budget per step")
    p.add_argument("--decode-batch", type=int, default=32)
    p.add_argument("--decode-ctx", type=int, default=1024)
    p.add_argument("--skip-crossover", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="run every code path on the CPU at tiny shapes (no figures)")
    args = p.parse_args(argv)
    global DEV
    if args.cpu_dry_run:
        DEV = "cpu"
    out = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
           "torch": torch.__version__}
    out["bandwidth"] = bandwidth(args)
    print(json.dumps(out["bandwidth"], indent=1), flush=True)
    if not args.skip_crossover:
        out["crossover"] = crossover(args)
        c = out["crossover"]
        print(f"measured rates: link {c['measured_link_GBps']:.1f} GB/s, prefill "
              f"{c['measured_prefill_tok_s']:.0f} tok/s, step floor "
              f"{c['measured_step_floor_ms']:.2f} ms; decode batch {args.decode_batch}")
        print(f"{'L':>6} {'swap ms':>9} {'alone ms':>9} {'model':>9} {'ok':>3} "
              f"{'marginal ms':>12} {'model':>9} {'ok':>3}   (model estimates: swap / recompute)")
        for r in c["rows"]:
            print(f"{r['L']:>6} {r['swap_ms']:>9.2f} {r['recompute_alone_ms']:>9.2f} "
                  f"{r['model_alone']:>9} {'y' if r['model_right_alone'] else 'N':>3} "
                  f"{r['recompute_marginal_ms']:>12.2f} {r['model_marginal']:>9} "
                  f"{'y' if r['model_right_marginal'] else 'N':>3}   "
                  f"{r['model_alone_swap_ms']:.2f} / {r['model_alone_recompute_ms']:.2f}, "
                  f"{r['model_marginal_recompute_ms']:.2f}")
        print(f"crossover (swap cheaper from here on): alone L={c['crossover_alone']} "
              f"(model {c['model_crossover_alone']}), marginal L={c['crossover_marginal']} "
              f"(model {c['model_crossover_marginal']}); model right everywhere: "
              f"{c['model_right_everywhere']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
