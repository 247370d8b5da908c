"""Serving benchmark: ``pagedkv bench serve`` against the OpenAI-compatible server, at Llama-3-8B
dimensions with random bf16 weights, on one GPU.

Builds ``LlamaForCausalLM`` from a ``LlamaConfig`` of ``_dims.py`` (32 layers, hidden 4096, 32/8
heads, MLP 14336, vocab 128256) on the device, with a word-level tokenizer made in memory (token
``i`` is the word ``w<i>``, so every generated id has text to stream), and serves it exactly as
``pagedkv serve`` does: an :class:`pagedkv.AsyncLLM` with ``serve``'s engine defaults (256
sequences, a 2048-token step budget, chunked prefill, prefix caching, CUDA-graph decode) under
:func:`pagedkv.serve.app.build_app`, run by uvicorn in this process on a free 127.0.0.1 port.
Nothing is written to disk but the report.

Each setting is one ``python -m pagedkv bench serve --url ... --json`` run in a child process (the
client must not share the server's interpreter: its event loop would compete with uvicorn's and the
engine thread for the GIL). Settings (every one ``--ignore-eos``, its own ``--seed``, so no run
finds the previous one's prompts in the prefix cache):

- ``--dataset random``, 512 prompt / 128 output tokens, Poisson arrivals at 4 and 16 requests/s,
  and all at once (``inf``);
- ``--dataset prefix``: 384 shared tokens (one of 4 prefixes) + 128 random ones, 128 output
  tokens, at 16 requests/s — the same prompt length and rate as the random run, so the TTFT gap is
  what the prefix cache saves.

A short unrecorded warm-up run first compiles the prefill kernels, which would otherwise land in
the first setting's TTFT. Prints one table (throughput; TTFT, TPOT and ITL percentiles; the prefix
hit ratio and preemptions the engine counted during the run) and writes the full JSON (the bench's
own reports, the server-side counters, timings of the model build and of the engine's start-up
with its graph captures) to ``--json`` (default ``$OUT/bench_serve_gpu.json``).

Usage (GPU machine, repository root): ``OUT=out bash benches/gpu_serve.sh [--quick]``, or with the
server's dependencies on the path ``PYTHONPATH=python python3 benches/bench_serve_gpu.py``.
``--tiny --device cpu`` runs the same path end to end at tiny dimensions on the CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional

from _dims import add_model_args, llama_config, model_dims

#: Dimensions of ``--tiny``: a few seconds on a CPU, the same code path.
TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "mlp": 128, "vocab": 1024}
NAME = "llama-3-8b-random"


def settings(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """The runs, in order. ``quick`` keeps one random run at a finite rate, the saturating one and
    the prefix run; ``tiny`` shrinks lengths and counts to CPU size."""
    n = args.num_prompts
    if args.tiny:
        inp, out, pre = 32, 8, 24
        runs = [dict(name="random r=4", dataset="random", rate=4.0, num_prompts=n or 6),
                dict(name="random r=inf", dataset="random", rate=math.inf, num_prompts=n or 8),
                dict(name="prefix r=4", dataset="prefix", rate=4.0, num_prompts=n or 6)]
    else:
        inp, out, pre = 512, 128, 384
        runs = [dict(name="random r=4", dataset="random", rate=4.0, num_prompts=n or 64),
                dict(name="random r=16", dataset="random", rate=16.0, num_prompts=n or 256),
                dict(name="random r=inf", dataset="random", rate=math.inf, num_prompts=n or 256),
                dict(name="prefix r=16", dataset="prefix", rate=16.0, num_prompts=n or 256)]
        if args.quick:
            runs = [dict(r, num_prompts=n or 128) for r in runs[1:]]
    for seed, r in enumerate(runs, start=1):
        r["seed"] = seed
        r["output_len"] = out
        if r["dataset"] == "prefix":
            # The same total prompt length as the random runs: only the cache makes the difference.
            r.update(prefix_len=pre, num_prefixes=4, input_len=inp - pre)
        else:
            r["input_len"] = inp
    return runs


# ----------------------------------------------------------------------------------- the model

def build_tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over the whole vocabulary, made in memory (no hub, no files).

    Every id decodes to text: the server streams a chunk only for tokens that add text, and the
    bench times chunks, so an id without text would vanish from TTFT and ITL."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    # The chat route works too (the bench drives completions only).
    fast.chat_template = ("{% for m in messages %}w1 {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}w2{% endif %}")
    return fast


def build_model(dims: Dict[str, int], max_model_len: int, device: str, dtype: Any) -> Any:
    """Random weights built on the device itself: 16 GB of bf16 never touch the host or a disk."""
    import torch
    import transformers

    from pagedkv.engine.loader import LoadedModel

    cfg = llama_config(dims, max_model_len)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(cfg, dtype=dtype)
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=build_tokenizer(dims["vocab"]), config=model.config,
                       max_model_len=max_model_len, eos_token_ids=[], path=NAME)


# ---------------------------------------------------------------------------------- the server

class Server:
    """``pagedkv serve`` in this process: the app over an AsyncLLM, uvicorn on a thread, bound to
    a free loopback port."""

    def __init__(self, llm: Any) -> None:
        import uvicorn

        from pagedkv.serve.app import build_app, uvicorn_config

        self.llm = llm
        app = build_app(llm, served_model_name=NAME)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        # uvicorn as `serve` configures it (its bounds, TCP_NODELAY on every connection, which
        # asyncio does not set on a socket bound here); only the log level is quieter, and no
        # lifespan (the app defines none).
        self.server = uvicorn.Server(uvicorn_config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)

    def counters(self) -> Dict[str, int]:
        # The manager's reads are safe from any thread.
        s = self.llm.engine.manager.stats()
        return {"prefix_query_tokens": s.prefix_query_tokens,
                "prefix_hit_tokens": s.prefix_hit_tokens, "preemptions": s.preemptions,
                "evictions": s.evictions}

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Until every request is finished and every block is back (a run's stragglers must not
        overlap the next run)."""
        deadline = time.monotonic() + timeout
        while self.llm.num_unfinished or self.llm.engine.manager.stats().used_blocks:
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not go idle")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.llm.shutdown()


def bench(url: str, run: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """One ``pagedkv bench serve`` run in a child process; its JSON report."""
    cmd = [sys.executable, "-m", "pagedkv", "bench", "serve", "--url", url, "--json",
           "--ignore-eos", "--num-prompts", str(run["num_prompts"]),
           "--dataset", run["dataset"], "--input-len", str(run["input_len"]),
           "--output-len", str(run["output_len"]), "--seed", str(run["seed"])]
    if not math.isinf(run["rate"]):
        cmd += ["--request-rate", str(run["rate"])]
    if run["dataset"] == "prefix":
        cmd += ["--prefix-len", str(run["prefix_len"]), "--num-prefixes", str(run["num_prefixes"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        raise RuntimeError(f"bench serve exited {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout)[-2000:]}") from None
    report["command"] = "pagedkv " + " ".join(cmd[3:])
    return report


# ---------------------------------------------------------------------------------- the report

def _ms(st: Dict[str, Optional[float]], key: str) -> str:
    v = st.get(key)
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def format_table(report: Dict[str, Any]) -> str:
    cols = ("setting", "n", "ok/fail", "dur s", "req/s", "out tok/s", "tot tok/s", "TTFT p50",
            "TTFT p99", "TPOT p50", "ITL p50", "ITL p99", "E2E p50", "prefix hit", "preempt")
    rows = []
    for r in report["runs"]:
        if "error" in r:
            rows.append((r["name"], str(r["num_prompts"]), "error: " + r["error"][:80]))
            continue
        s, srv = r["summary"], r["server"]
        hit = (f"{100 * srv['prefix_hit_tokens'] / srv['prefix_query_tokens']:.0f}%"
               if srv["prefix_query_tokens"] else "-")
        rows.append((r["name"], str(r["num_prompts"]), f"{s['completed']}/{s['failed']}",
                     f"{s['duration_s']:.1f}", f"{s['request_throughput']:.2f}",
                     f"{s['output_throughput']:,.0f}", f"{s['total_token_throughput']:,.0f}",
                     _ms(s["ttft_ms"], "p50"), _ms(s["ttft_ms"], "p99"),
                     _ms(s["tpot_ms"], "p50"), _ms(s["itl_ms"], "p50"), _ms(s["itl_ms"], "p99"),
                     _ms(s["e2e_ms"], "p50"), hit, str(srv["preemptions"])))
    widths = [max(len(c), *(len(row[i]) for row in rows if i < len(row)))
              for i, c in enumerate(cols)]
    a = report["args"]
    e = report["engine"]
    head = [
        f"pagedkv bench serve against pagedkv's server: {report['device']}, "
        f"{report['model']}",
        f"engine: {e['num_blocks']} blocks of {a['block_size']} ({e['kv_pool_gib']:.1f} GiB KV), "
        f"max_num_seqs {a['max_num_seqs']}, max_num_batched_tokens "
        f"{a['max_num_batched_tokens']}, prefix caching, chunked prefill, "
        f"CUDA graphs {e['graph_sizes'] or 'off'}",
        f"model build {report['build_s']:.1f} s, engine start-up {report['engine_init_s']:.1f} s, "
        f"warm-up {report['warmup_s']:.1f} s, total {report['total_s']:.0f} s; "
        f"latencies in ms; prompts {report['prompt_desc']}",
        "",
    ]
    def line(cells: Any) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join(head + [line(cols)] + [line(row) for row in rows])


# ------------------------------------------------------------------------------------- main

def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true",
                    help="tiny dimensions and few prompts (checks the whole script on a CPU)")
    ap.add_argument("--quick", action="store_true", help="three settings of 128 prompts")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 (float32 on the CPU)")
    add_model_args(ap)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: 8192 (512 tiny)")
    ap.add_argument("--kv-cache-memory", default=None,
                    help="KV pool bytes, e.g. 40GiB (default: 40GiB on a GPU, what every run "
                         "needs with room to spare, so a GPU shared with other work is not "
                         "claimed whole; the engine's CPU default otherwise)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--num-prompts", type=int, default=None, help="override every setting's")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per bench run")
    ap.add_argument("--json", default=None, help="default: $OUT/bench_serve_gpu.json")
    args = ap.parse_args(argv)
    if args.tiny:
        for k, v in TINY.items():
            if getattr(args, k) == _dims_default(k):
                setattr(args, k, v)
    device = args.device or ("cpu" if args.tiny else "cuda")
    if args.max_model_len is None:
        args.max_model_len = 512 if args.tiny else 8192
    if args.kv_cache_memory is None and device.startswith("cuda"):
        args.kv_cache_memory = "40GiB"
    out_dir = os.environ.get("OUT", "out")
    json_path = args.json or os.path.join(out_dir, "bench_serve_gpu.json")
    # Offline, as `pagedkv serve` sets it; the child processes inherit it.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    import torch

    import pagedkv

    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.float32 if device == "cpu" else torch.bfloat16)
    dims = model_dims(args)
    t_start = time.perf_counter()
    loaded = build_model(dims, args.max_model_len, device, dtype)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t_built = time.perf_counter()
    engine_args = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       kv_cache_memory=args.kv_cache_memory)
    llm = pagedkv.AsyncLLM(loaded, **engine_args)
    t_engine = time.perf_counter()
    runner = llm.engine.runner
    dev_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    label = ("Llama-3-8B dims" if dims == _default_dims() else
             f"Llama dims {dims}") + f", random {str(dtype).replace('torch.', '')}"
    runs = settings(args)
    first = runs[0]
    report: Dict[str, Any] = {
        "device": dev_name, "model": label, "dims": dims, "args": vars(args),
        "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
        "engine": {"num_blocks": runner.num_blocks, "graph_sizes": runner.graph_sizes,
                   "kv_pool_gib": runner.pool.nbytes / 2**30,
                   "max_model_len": llm.engine.max_model_len},
        "build_s": t_built - t_start, "engine_init_s": t_engine - t_built,
        "prompt_desc": (f"{first['input_len']} random tokens + {first['output_len']} generated; "
                        f"prefix: {runs[-1].get('prefix_len')} shared (4 prefixes) + "
                        f"{runs[-1].get('input_len')} random"),
        "runs": [],
    }
    print(f"model built in {report['build_s']:.1f} s; engine up in {report['engine_init_s']:.1f} s "
          f"({runner.num_blocks} blocks, graphs {runner.graph_sizes})", flush=True)
    server = Server(llm)
    try:
        t0 = time.perf_counter()
        warm = dict(first, name="warm-up", rate=math.inf, num_prompts=min(16, first["num_prompts"]),
                    output_len=min(16, first["output_len"]), seed=0)
        try:
            bench(server.url, warm, args.timeout)
        finally:
            server.wait_idle()
        report["warmup_s"] = time.perf_counter() - t0
        for run in runs:
            before = server.counters()
            entry: Dict[str, Any] = dict(run, rate=None if math.isinf(run["rate"]) else run["rate"])
            try:
                entry["summary"] = bench(server.url, run, args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                entry["error"] = str(exc)
            server.wait_idle()
            after = server.counters()
            entry["server"] = {k: after[k] - before[k] for k in after}
            report["runs"].append(entry)
            s = entry.get("summary")
            print(f"{run['name']}: " + (f"{s['completed']}/{run['num_prompts']} done in "
                                        f"{s['duration_s']:.1f} s, "
                                        f"{s['output_throughput']:,.0f} output tok/s"
                                        if s else entry["error"][:300]), flush=True)
    finally:
        server.stop()
    report["total_s"] = time.perf_counter() - t_start
    table = format_table(report)
    report["table"] = table
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as fh:
        json.dump(report, fh, indent=2)
    print(f"JSON: {json_path}\n")
    print(table, flush=True)
    ok = all("error" not in r and r["summary"]["completed"] == r["num_prompts"]
             for r in report["runs"])
    return 0 if ok else 1


def _default_dims() -> Dict[str, int]:
    from _dims import LLAMA3_8B

    return dict(LLAMA3_8B)


def _dims_default(name: str) -> int:
    return _default_dims()[name]


if __name__ == "__main__":
    raise SystemExit(main())
