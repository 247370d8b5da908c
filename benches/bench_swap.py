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
- recompute, marginal (L <= ``--chunk``): a step of ``--decode-batch`` decodes at context
  ``--decode-ctx`` plus the L-token prefill, minus the same decode step alone — what the recompute
  adds to a step that runs anyway.

The crossover is the smallest L from which swap stays cheaper than recompute. The cost model is then
fed the rates measured as the engine measures them at start-up (:meth:`ModelRunner.measure_rates`)
and asked for each L (the core's ``BlockManager.decide`` on a live sequence of L tokens when the
core has it, else the contract's formula: swap = 2 x KV bytes / link, recompute = tokens /
prefill rate); the table says whether it picked the faster mode in each view.

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
    from pagedkv.pool import KVPool
    from pagedkv.swap import SwapEngine

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
    from pagedkv.engine.model_runner import ModelRunner
    from pagedkv.manager import BlockManager

    lengths = [int(x) for x in args.lengths.split(",")]
    max_len = max(lengths) + 64
    loaded = build_model(max_len)
    bs = 16
    need = sum(math.ceil(L / bs) for L in [max(lengths)]) + args.decode_batch * (
        math.ceil((args.decode_ctx + 64) / bs)) + 64
    runner = ModelRunner(loaded, block_size=bs, num_blocks=need, max_num_seqs=args.decode_batch + 1,
                         max_num_batched_tokens=args.chunk + args.decode_batch, cuda_graphs=False)
    swap = runner.enable_swap(math.ceil(max(lengths) / bs) + 8)
    link, tps = runner.measure_rates()
    kvb = runner.spec.bytes_per_token
    res = {"measured_link_GBps": link / 1e9, "measured_prefill_tok_s": tps,
           "kv_bytes_per_token": kvb, "rows": []}
    vocab = runner.config.vocab_size
    rng = np.random.default_rng(1)
    core_decide = hasattr(BlockManager, "decide")
    kw = {"num_host_blocks": swap.host.num_blocks} if core_decide else {}
    mgr = runner.new_block_manager(enable_prefix_caching=False, **kw)
    if core_decide:
        from pagedkv.manager import CostModel

        mgr.cost_model = CostModel(host_link_bytes_per_s=link, prefill_tokens_per_s=tps,
                                   kv_bytes_per_token=float(kvb))
    res["cost_model"] = "core BlockManager.decide" if core_decide else "contract formula (Python)"

    # The decode batch for the marginal view: prefilled once, grown one token per measured step.
    dec_ids = list(range(1000, 1000 + args.decode_batch))
    ctx = args.decode_ctx
    for sid in dec_ids:
        prompt = rng.integers(0, vocab, ctx).tolist()
        mgr.admit(sid, prompt)
        info = mgr.step([sid], [ctx])
        runner.execute(prompt, np.arange(ctx), info, [0])
    dec_tok = rng.integers(0, vocab, len(dec_ids))
    dec_pos = [ctx]

    def decode_step(extra=None):
        mgr.append_batch(dec_ids, dec_tok)
        ids, news = list(dec_ids), [1] * len(dec_ids)
        inp = list(dec_tok)
        pos = [dec_pos[0]] * len(dec_ids)
        if extra is not None:
            sid, prompt = extra
            mgr.admit(sid, prompt)
            ids.append(sid)
            news.append(len(prompt))
            inp += prompt
            pos += list(range(len(prompt)))
        info = mgr.step(ids, news)
        runner.execute(np.array(inp), np.array(pos), info, [len(ids) - 1])
        dec_pos[0] += 1
        if extra is not None:
            mgr.free(extra[0])

    next_id = [0]

    def prefill_alone(L):
        sid = next_id[0]
        next_id[0] += 1
        prompt = rng.integers(0, vocab, L).tolist()
        done = 0
        while done < L:
            k = min(args.chunk, L - done)
            if done == 0:
                mgr.admit(sid, prompt, max_new_tokens=k)
            else:
                mgr.append(sid, prompt[done:done + k])
            info = mgr.step([sid], [k])
            runner.execute(np.array(prompt[done:done + k]), np.arange(done, done + k), info, [0])
            done += k
        return sid

    for L in lengths:
        row = {"L": L}
        # Recompute alone (the sequence is kept afterwards for the swap and the model's decision).
        times = []
        sid = None
        for r in range(args.reps_model + 1):
            if sid is not None:
                mgr.free(sid)
            _sync()
            t0 = time.perf_counter()
            sid = prefill_alone(L)
            _sync()
            times.append(1e3 * (time.perf_counter() - t0))
        row["recompute_alone_ms"] = statistics.median(times[1:])
        table = mgr.block_table(sid)
        host = np.arange(len(table))
        pairs_out = np.stack([np.array(table), host], 1)
        pairs_in = np.stack([host, np.array(table)], 1)

        def round_trip():
            swap.swap_out(pairs_out)
            swap.swap_in(pairs_in)
            swap.synchronize()

        row["swap_ms"] = _wall_ms(round_trip, args.reps)
        if core_decide:
            mode, s_est, r_est = mgr.decide([sid])[:3]
        else:
            s_est = 2 * L * kvb / link
            r_est = L / tps
            mode = "swap" if s_est < r_est else "recompute"
        row.update(model_mode=str(mode), model_swap_ms=1e3 * s_est, model_recompute_ms=1e3 * r_est)
        mgr.free(sid)
        if L <= args.chunk:
            base, mixed = [], []
            for r in range(args.reps_model + 1):
                _sync()
                t0 = time.perf_counter()
                decode_step()
                _sync()
                t1 = time.perf_counter()
                decode_step((next_id[0], rng.integers(0, vocab, L).tolist()))
                next_id[0] += 1
                _sync()
                t2 = time.perf_counter()
                if r:
                    base.append(t1 - t0)
                    mixed.append(t2 - t1)
            row["decode_step_ms"] = 1e3 * statistics.median(base)
            row["recompute_marginal_ms"] = 1e3 * max(0.0, statistics.median(mixed)
                                                     - statistics.median(base))
        row["faster_alone"] = "swap" if row["swap_ms"] < row["recompute_alone_ms"] else "recompute"
        row["model_right_alone"] = row["faster_alone"] == row["model_mode"]
        if "recompute_marginal_ms" in row:
            row["faster_marginal"] = ("swap" if row["swap_ms"] < row["recompute_marginal_ms"]
                                      else "recompute")
            row["model_right_marginal"] = row["faster_marginal"] == row["model_mode"]
        res["rows"].append(row)
        print(json.dumps(row), flush=True)

    def cross(key):
        rows = [r for r in res["rows"] if key in r]
        for i, r in enumerate(rows):
            if all(q["swap_ms"] < q[key] for q in rows[i:]):
                return r["L"]
        return None

    res["crossover_alone"] = cross("recompute_alone_ms")
    res["crossover_marginal"] = cross("recompute_marginal_ms")
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
              f"{c['measured_prefill_tok_s']:.0f} tok/s; cost model: {c['cost_model']}")
        print(f"{'L':>6} {'swap ms':>9} {'recomp alone':>13} {'recomp marg':>12} {'model':>10} "
              f"{'right (alone/marg)':>19}")
        for r in c["rows"]:
            marg = r.get("recompute_marginal_ms")
            print(f"{r['L']:>6} {r['swap_ms']:>9.2f} {r['recompute_alone_ms']:>13.2f} "
                  f"{marg if marg is not None else float('nan'):>12.2f} {r['model_mode']:>10} "
                  f"{str(r['model_right_alone']):>9}/{str(r.get('model_right_marginal', '-'))}")
        print(f"crossover (swap cheaper from here on): alone L={c['crossover_alone']}, "
              f"marginal L={c['crossover_marginal']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
