"""Where a decode step's wall time goes beyond its graph replay (GPU).

At Llama-3-8B dimensions (random bf16), drives the model runner through decode steps at each
batch size of ``--batches`` and times, per step, with the host clock: the bookkeeping
(``append_batch`` + ``step``), every part of ``ModelRunner.execute`` (validation and positions,
the step tables' copies, the staging of ids/positions, the decode plan, the graph launch call
itself, the wait for the inputs' copy) and the argmax read back; then the graph alone from an
idle GPU (launch to completion, one replay) against back to back (the breakdown's figure), and
the same step captured as several graphs of a few layers each (``--pieces``), whose launches
overlap the earlier pieces' execution. At batch 1 the fused forward's linear layers run the
weight-streaming GEMV (its default for one-row steps); ``--gemv`` times batch 1 again with
``runner.gemv_rows = 0`` (cuBLAS throughout) beside it, the greedy tokens compared. Prints one
table; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time

import numpy as np
import torch
from _dims import add_model_args, llama_config, model_dims


def build(args):
    import transformers

    from pagedkv.engine.loader import LoadedModel
    from pagedkv.engine.model_runner import ModelRunner

    cfg = llama_config(model_dims(args), args.max_model_len)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    loaded = LoadedModel(model=model, tokenizer=None, config=model.config,
                         max_model_len=args.max_model_len, eos_token_ids=[], path="random")
    max_b = max(args.batches)
    blocks = max_b * (-(-(args.prompt + args.new) // 16) + 1)
    return ModelRunner(loaded, block_size=16, num_blocks=blocks, max_num_seqs=max_b,
                       max_num_batched_tokens=8192, cuda_graphs=True)


class _Timed:
    """Wraps a callable, appending each call's host time (s) to ``sink``."""

    def __init__(self, fn, sink):
        self.fn, self.sink = fn, sink

    def __call__(self, *a, **k):
        t = time.perf_counter()
        r = self.fn(*a, **k)
        self.sink.append(time.perf_counter() - t)
        return r


class _TimedGraph:
    def __init__(self, graph, sink):
        self.graph, self.sink = graph, sink

    def replay(self):
        t = time.perf_counter()
        self.graph.replay()
        self.sink.append(time.perf_counter() - t)


def instrument(runner, times):
    """Wraps the runner's step parts once, and every graph not wrapped yet, timing into ``times``."""
    if not getattr(runner, "_host_timed", False):
        runner.buffers.to_device = _Timed(runner.buffers.to_device, times["to_device"])
        runner.buffers.positions = _Timed(runner.buffers.positions, times["positions"])
        runner._stage = _Timed(runner._stage, times["stage"])
        runner._update_plan = _Timed(runner._update_plan, times["plan"])
        runner._replay = _Timed(runner._replay, times["replay_fn"])
        runner._inputs_copied.synchronize = _Timed(runner._inputs_copied.synchronize,
                                                   times["inputs_sync"])
        runner._host_timed = True
    for bs, (g, logits) in list(runner._graphs.items()):
        if not isinstance(g, _TimedGraph):
            runner._graphs[bs] = (_TimedGraph(g, times["graph_launch"]), logits)


def decode(runner, batch, args, times):
    from pagedkv.engine.core import build_block_manager

    mgr = build_block_manager(runner, enable_prefix_caching=False)
    g = np.random.default_rng(0)
    vocab = runner.config.vocab_size
    sids = np.arange(batch, dtype=np.int64)
    per = max(1, 8192 // args.prompt)
    first = np.zeros(batch, dtype=np.int64)
    for a in range(0, batch, per):
        ids = list(range(a, min(batch, a + per)))
        prompts = [g.integers(0, vocab, args.prompt) for _ in ids]
        for s, p in zip(ids, prompts):
            mgr.admit(s, p)
        info = mgr.step(ids, [args.prompt] * len(ids))
        lg = runner.execute(np.concatenate(prompts), None, info, list(range(len(ids))))
        first[a:a + len(ids)] = lg.argmax(-1).cpu().numpy()
    toks = first
    seen = []
    rec = collections.defaultdict(list)
    for i in range(args.new):
        for v in times.values():
            v.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        mgr.append_batch(sids, toks)
        info = mgr.step(sids, 1)
        t1 = time.perf_counter()
        logits = runner.execute(toks, None, info, range(batch))
        t2 = time.perf_counter()
        toks = logits.argmax(-1).cpu().numpy()
        t3 = time.perf_counter()
        seen.append(toks)
        if i < 3:
            continue
        rec["step"].append(t3 - t0)
        rec["bookkeeping"].append(t1 - t0)
        rec["execute"].append(t2 - t1)
        rec["wait_and_argmax"].append(t3 - t2)
        for k, v in times.items():
            rec[k].append(sum(v))
    for s in range(batch):
        mgr.free(s)
    return {k: 1e6 * statistics.median(v) for k, v in rec.items()}, np.stack(seen)


def graph_latency(graph, reps=20):
    """(idle-GPU launch-to-done, back-to-back per replay) in µs, and the launch call's host µs."""
    lat, call = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        call.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        lat.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    b2b = (time.perf_counter() - t) / reps
    return 1e6 * statistics.median(lat), 1e6 * b2b, 1e6 * statistics.median(call)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 128])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--pieces", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of 3 steps")
    ap.add_argument("--gemv", action="store_true",
                    help="at batch 1, also time the step on cuBLAS (runner.gemv_rows = 0) beside "
                         "the default GEMV")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    t = time.perf_counter()
    runner = build(args)
    print(f"built in {time.perf_counter() - t:.1f} s; graphs {runner.graph_sizes}", flush=True)
    out = {"device": torch.cuda.get_device_name(), "args": vars(args), "batches": {}}
    times = collections.defaultdict(list)
    for b in args.batches:
        bs = runner._graph_size(b)
        res = {}
        for p in [1] + args.pieces:
            runner.capture_graphs([bs], pieces=p)
            g = runner._graphs[bs][0]
            instrument(runner, times)
            r, toks = decode(runner, b, args, times)
            r["execute_rest"] = r["execute"] - sum(r.get(k, 0.0) for k in (
                "positions", "to_device", "stage", "plan", "replay_fn", "inputs_sync"))
            lat, b2b, call = graph_latency(g)
            r.update(graph_idle_us=lat, graph_b2b_us=b2b, graph_call_us=call)
            if p == 1:
                ref = toks
            r["greedy_equal_to_one_graph"] = bool(np.array_equal(toks, ref))
            res[p] = r
            print(f"batch {b} pieces {p}: " + ", ".join(f"{k} {v:.0f}" for k, v in r.items())
                  + " (us)", flush=True)
        if args.gemv and b == 1:
            # The same step with the fused forward's linear layers on cuBLAS, as the graphs
            # above but captured with the GEMV off (the runner's internal bound).
            default_rows = runner.gemv_rows
            runner.gemv_rows = 0
            runner.capture_graphs([bs])
            g = runner._graphs[bs][0]  # the bare graph, as the arms above time it
            instrument(runner, times)
            r, toks = decode(runner, b, args, times)
            r["execute_rest"] = r["execute"] - sum(r.get(k, 0.0) for k in (
                "positions", "to_device", "stage", "plan", "replay_fn", "inputs_sync"))
            lat, b2b, call = graph_latency(g)
            r.update(graph_idle_us=lat, graph_b2b_us=b2b, graph_call_us=call)
            r["greedy_equal_to_one_graph"] = bool(np.array_equal(toks, ref))
            r["greedy_agreement"] = float((toks == ref).mean())
            res["cublas"] = r
            print(f"batch {b} cublas: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) and v < 2
                                                  else f"{k} {v:.0f}" for k, v in r.items())
                  + " (us)", flush=True)
            runner.gemv_rows = default_rows
            runner.capture_graphs([bs])
        out["batches"][b] = res
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        b = args.batches[0]
        small = argparse.Namespace(**{**vars(args), "new": 6})
        runner.capture_graphs([runner._graph_size(b)])
        instrument(runner, times)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            decode(runner, b, small, times)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
