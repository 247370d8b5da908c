"""What tokenizing off the engine thread costs a short request: ``pagedkv serve`` with prompts
tokenized on worker threads (``tokenizer_workers=2``, the default) against tokenized on the engine
thread between steps (``tokenizer_workers=0``, the old path), side by side in one run.

The server runs in this process (uvicorn on a loopback port) over a tiny random Llama that uses the
embedded SmolLM2-135M-Instruct's real tokenizer (49,152 tokens), so a request's time is the HTTP
round trip, the tokenization path and one cheap engine step, not a forward. Each arm is measured
``--rounds`` times, the arms alternating (``worker, engine, worker, engine, ...``), and the best
round of each is reported:

* ``latency``: ``--requests`` non-streaming completions (``max_tokens=1``, a short English prompt
  of ~20 tokens made distinct per request) sent one after another over one keep-alive connection:
  median and p90 milliseconds per request;
* ``throughput``: the same number of requests with ``--concurrency`` in flight: requests/s.

The HTTP figures carry the noise of a shared machine; ``hop`` isolates the path itself, in process
with no HTTP: the median microseconds to get a short prompt's ids through a worker thread
(``_Tokenizers.run``) against through the engine thread (``AsyncLLM.call``, idle engine) and
against tokenizing inline on the event loop (no hop at all), ``--hops`` times each.

A last figure is what the off-thread path buys: ``stall``, the longest gap between two chunks of
a running stream while a prompt of ``--big-kib`` KiB is tokenized (engine thread: the stream waits
for the whole tokenization; worker: it does not).

Usage (repository root): ``PYTHONPATH=python python benches/bench_serve_tokenize.py
[--requests 200] [--concurrency 16] [--rounds 2] [--big-kib 256] [--json out.json]``.
Needs the ``serve`` and ``demo`` extras (the embedded model's tokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Without TCP_NODELAY the client's separate writes of head and body meet the server's delayed ACK
#: (~40 ms on Linux), which would hide everything measured here.
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]

PROMPT = ("The quick brown fox number {i} jumps over the lazy dog while the "
          "committee reviews the quarterly report.")


def build_model(directory: str) -> str:
    """A 2-layer random Llama with SmolLM2's tokenizer and vocabulary, saved to ``directory``."""
    import torch
    import transformers

    from pagedkv.engine.loader import default_model_path, load_model

    tok = load_model(default_model_path()).tokenizer
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=8192,
                                   eos_token_id=None, bos_token_id=None, pad_token_id=None)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


class Server:
    def __init__(self, model_dir: str, workers: int) -> None:
        import uvicorn

        from pagedkv import AsyncLLM
        from pagedkv.serve.app import build_app, uvicorn_config

        self.llm = AsyncLLM(model_dir, device="cpu", num_blocks=4096, block_size=16,
                            max_num_seqs=64, max_num_batched_tokens=8192,
                            enable_prefix_caching=False)
        app = build_app(self.llm, served_model_name="m", tokenizer_workers=workers)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn_config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.llm.shutdown()


def latency(url: str, n: int, offset: int) -> Dict[str, float]:
    import httpx

    times = []
    with httpx.Client(timeout=60, transport=httpx.HTTPTransport(socket_options=NODELAY)) as c:
        for i in range(n):
            t = time.perf_counter()
            r = c.post(f"{url}/v1/completions", json={
                "model": "m", "prompt": PROMPT.format(i=offset + i), "max_tokens": 1})
            times.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
    times.sort()
    return {"p50_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * times[int(0.9 * n)]}


async def _throughput(url: str, n: int, concurrency: int, offset: int) -> float:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    transport = httpx.AsyncHTTPTransport(socket_options=NODELAY, limits=limits)
    async with httpx.AsyncClient(timeout=60, transport=transport) as c:
        async def one(i: int) -> None:
            async with sem:
                r = await c.post(f"{url}/v1/completions", json={
                    "model": "m", "prompt": PROMPT.format(i=offset + i), "max_tokens": 1})
                assert r.status_code == 200, r.text

        t = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.perf_counter() - t)


async def _stall(url: str, big_kib: int) -> float:
    """The longest gap (ms) between two chunks of a stream while a big prompt is tokenized."""
    import httpx

    arrivals: List[float] = []
    big = ("lorem ipsum dolor sit amet " * (big_kib * 1024 // 27 + 1))[: big_kib * 1024]
    async with httpx.AsyncClient(timeout=120) as c:
        async def stream() -> None:
            body = {"model": "m", "prompt": "w", "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
            async with c.stream("POST", f"{url}/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.perf_counter())

        async def big_request() -> Any:
            while len(arrivals) < 20:
                await asyncio.sleep(0.001)
            start = time.perf_counter()
            r = await c.post(f"{url}/v1/completions",
                             json={"model": "m", "prompt": big, "max_tokens": 1})
            return start, time.perf_counter(), r.status_code

        _, (start, end, _status) = await asyncio.gather(stream(), big_request())
    window = [t for t in arrivals if t >= start - 0.5]
    gaps = [b - a for a, b in zip(window, window[1:]) if b >= start and a <= end]
    return 1e3 * max(gaps, default=0.0)


async def _hops(llm: Any, n: int) -> Dict[str, float]:
    """Median microseconds of one short prompt's tokenization by each path."""
    from pagedkv.serve.app import _encode_all, _Tokenizers

    tok = llm.get_tokenizer()
    workers = _Tokenizers(tok, 2)
    inline_tok = __import__("copy").deepcopy(tok)
    out: Dict[str, List[float]] = {"inline": [], "worker": [], "engine": []}
    try:
        for i in range(n):
            texts = [PROMPT.format(i=i)]
            t = time.perf_counter()
            _encode_all(inline_tok, texts, True)
            out["inline"].append(time.perf_counter() - t)
            t = time.perf_counter()
            await workers.run(_encode_all, texts, True)
            out["worker"].append(time.perf_counter() - t)
            t = time.perf_counter()
            await llm.call(lambda e: _encode_all(e.tokenizer, texts, True))
            out["engine"].append(time.perf_counter() - t)
    finally:
        workers.shutdown()
    return {k: 1e6 * statistics.median(v) for k, v in out.items()}


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--big-kib", type=int, default=256)
    p.add_argument("--hops", type=int, default=2000)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    arms = {"worker": 2, "engine": 0}
    results: Dict[str, Dict[str, List[float]]] = {
        a: {"p50_ms": [], "p90_ms": [], "req_per_s": [], "stall_ms": []} for a in arms}
    with tempfile.TemporaryDirectory() as d:
        model_dir = build_model(d)
        from pagedkv import AsyncLLM

        llm = AsyncLLM(model_dir, device="cpu", num_blocks=64, block_size=16)
        try:
            hops = asyncio.run(_hops(llm, args.hops))
        finally:
            llm.shutdown()
        print("hop (us): " + ", ".join(f"{k} {v:.1f}" for k, v in hops.items()), file=sys.stderr)
        offset = 0
        for r in range(args.rounds):
            for arm, workers in arms.items():
                s = Server(model_dir, workers)
                try:
                    latency(s.url, 20, 10**6 + offset)  # warm-up
                    lat = latency(s.url, args.requests, offset)
                    offset += args.requests
                    rps = asyncio.run(_throughput(s.url, args.requests, args.concurrency,
                                                  offset))
                    offset += args.requests
                    stall = asyncio.run(_stall(s.url, args.big_kib))
                finally:
                    s.stop()
                for k, v in (("p50_ms", lat["p50_ms"]), ("p90_ms", lat["p90_ms"]),
                             ("req_per_s", rps), ("stall_ms", stall)):
                    results[arm][k].append(v)
                print(f"round {r} {arm}: p50 {lat['p50_ms']:.2f} ms, p90 {lat['p90_ms']:.2f} ms, "
                      f"{rps:.1f} req/s, stall {stall:.1f} ms", file=sys.stderr)
    best = {a: {"p50_ms": min(v["p50_ms"]), "p90_ms": min(v["p90_ms"]),
                "req_per_s": max(v["req_per_s"]), "stall_ms": min(v["stall_ms"])}
            for a, v in results.items()}
    print(f"\nshort prompt, max_tokens=1, {args.requests} requests; best of {args.rounds} rounds; "
          f"stall: a {args.big_kib} KiB prompt during a stream")
    rps_head = f"req/s (c={args.concurrency})"
    print(f"{'tokenized on':<22}{'p50 ms':>9}{'p90 ms':>9}{rps_head:>14}{'stall ms':>10}")
    names = {"worker": "worker threads (2)", "engine": "engine thread"}
    for arm in arms:
        b = best[arm]
        print(f"{names[arm]:<22}{b['p50_ms']:>9.2f}{b['p90_ms']:>9.2f}{b['req_per_s']:>14.1f}"
              f"{b['stall_ms']:>10.1f}")
    delta = best["worker"]["p50_ms"] - best["engine"]["p50_ms"]
    print(f"added p50 latency off-thread (HTTP, noisy): {delta:+.3f} ms per request")
    print(f"\none short prompt's ids, median of {args.hops} (us): inline on the loop "
          f"{hops['inline']:.1f}, worker thread {hops['worker']:.1f}, engine thread "
          f"{hops['engine']:.1f}; the worker hop adds {hops['worker'] - hops['inline']:.1f} us "
          f"over inline, {hops['worker'] - hops['engine']:+.1f} us against the engine thread")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": results, "best": best,
                       "added_p50_ms": delta, "hop_us": hops}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
