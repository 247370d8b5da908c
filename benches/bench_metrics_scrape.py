"""The engine's CPU step median with and without a concurrent metrics scrape loop, live-read endpoint vs snapshot endpoint.

A tiny random Llama (2 layers, hidden 64, fp32) runs on the CPU through ``LLMEngine.step`` with a
steady decode batch (``--seqs`` sequences; finished requests are replaced). Each configuration
times ``--steps`` steps, in ``--rounds`` interleaved rounds so drift hits all of them alike:

- ``none``: no metrics endpoint;
- ``live``: ``prometheus_client.start_http_server`` (a thread per connection) over a collector
  that reads the manager and the scheduler at every scrape, as the endpoint did before snapshots;
- ``snapshot``: :func:`pagedkv.metrics.start_metrics_server` (one thread, snapshots taken by the
  step thread at a step boundary and reused for ``max_age_s``).

The scrape loop is a tight loop of HTTP GETs of ``/metrics``, either from another process
(``--scraper process``, as Prometheus scrapes) or from a thread of the engine's process
(``--scraper thread``); both by default. Prints one table (median and p90 step time, scrapes per
second) and, with ``--json PATH``, writes the figures there.

Usage (repository root): ``PYTHONPATH=python python3 benches/bench_metrics_scrape.py
[--steps 400 --rounds 3 --seqs 16] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SCRAPER = r"""
import signal, socket, sys, time
port, stop = int(sys.argv[1]), [False]
signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
n = 0
while not stop[0]:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        if data.startswith(b"HTTP/1.") and b" 200 " in data[:16]:
            n += 1
    except OSError:
        time.sleep(0.001)
print(n, flush=True)
"""


def _scrape_once(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return b" 200 " in data[:16]


def _tiny_model(directory: str) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=4096, eos_token_id=None,
                                   bos_token_id=None, pad_token_id=None)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
    return directory


class _Workload:
    """A steady decode batch: ``seqs`` requests in flight, each replaced when it finishes."""

    def __init__(self, engine: Any, seqs: int) -> None:
        from pagedkv import SamplingParams

        self.engine, self.seqs = engine, seqs
        self.params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        self.n = 0

    def top_up(self) -> None:
        e = self.engine
        while e.scheduler.num_running + e.scheduler.num_waiting < self.seqs:
            self.n += 1
            e.add_request(None, [(self.n * 7 + i) % 128 for i in range(24)], self.params)

    def time_steps(self, steps: int) -> List[float]:
        out = []
        for _ in range(steps):
            self.top_up()
            t0 = time.perf_counter()
            self.engine.step()
            out.append(time.perf_counter() - t0)
        return out


def _live_server(engine: Any) -> Any:
    """The endpoint as it was: a thread per connection, figures read live at every scrape."""
    import prometheus_client

    from pagedkv.metrics import PagedKVCollector, snapshot

    collector = PagedKVCollector(engine.manager, engine.scheduler)
    m, s = engine.manager, engine.scheduler
    collector._snapshots.get = lambda: snapshot(m, s)  # type: ignore[method-assign]
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    return server, thread


def _snapshot_server(engine: Any) -> Any:
    from pagedkv.metrics import start_metrics_server

    server, thread, _ = start_metrics_server(0, engine.manager, engine.scheduler)
    return server, thread


def _run(work: _Workload, steps: int, start: Optional[Callable[[Any], Any]],
         scraper: str) -> Dict[str, Any]:
    if start is None:
        return {"times": work.time_steps(steps), "scrapes": 0, "wall_s": 0.0}
    server, thread = start(work.engine)
    port = server.server_port
    assert _scrape_once(port)
    work.time_steps(20)  # warm the path with the endpoint up
    t0 = time.perf_counter()
    scrapes = [0]
    if scraper == "process":
        proc = subprocess.Popen([sys.executable, "-c", SCRAPER, str(port)],
                                stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)  # the scraper's interpreter starts
        t0 = time.perf_counter()
        times = work.time_steps(steps)
        wall = time.perf_counter() - t0
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
        scrapes[0] = int(out.strip() or 0)
    else:
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                if _scrape_once(port):
                    scrapes[0] += 1

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        t0 = time.perf_counter()
        times = work.time_steps(steps)
        wall = time.perf_counter() - t0
        stop.set()
        t.join(10)
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)
    return {"times": times, "scrapes": scrapes[0], "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--scraper", choices=("process", "thread", "both"), default="both")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)  # the step's own figure, not the machine's spare cores
    from pagedkv import LLM

    with tempfile.TemporaryDirectory() as d:
        llm = LLM(_tiny_model(d), device="cpu", block_size=16, num_blocks=1024,
                  max_num_seqs=args.seqs, max_num_batched_tokens=1024, progress=False)
    engine = llm.llm_engine
    work = _Workload(engine, args.seqs)
    work.time_steps(100)  # warm-up: prefills done, caches hot

    scrapers = ("process", "thread") if args.scraper == "both" else (args.scraper,)
    configs = [("none", "-", None)] + [
        (name, sc, fn) for sc in scrapers for name, fn in (("live", _live_server),
                                                           ("snapshot", _snapshot_server))]
    acc: Dict[tuple, Dict[str, Any]] = {(n, sc): {"times": [], "scrapes": 0, "wall_s": 0.0}
                                        for n, sc, _ in configs}
    for _ in range(args.rounds):
        for name, sc, fn in configs:
            r = _run(work, args.steps, fn, sc)
            a = acc[(name, sc)]
            a["times"] += r["times"]
            a["scrapes"] += r["scrapes"]
            a["wall_s"] += r["wall_s"]

    rows = []
    base = statistics.median(acc[("none", "-")]["times"])
    for (name, sc), a in acc.items():
        ts = sorted(a["times"])
        med = statistics.median(ts)
        rows.append({
            "endpoint": name, "scraper": sc, "steps": len(ts),
            "median_ms": med * 1e3, "p90_ms": ts[int(0.9 * (len(ts) - 1))] * 1e3,
            "vs_none": med / base,
            "scrapes_per_s": a["scrapes"] / a["wall_s"] if a["wall_s"] else 0.0,
        })
    print(f"engine step on the CPU, {args.seqs} decoding sequences, tiny Llama, "
          f"{args.rounds} x {args.steps} steps per row")
    print(f"{'endpoint':<10} {'scraper':<8} {'median ms':>10} {'p90 ms':>8} {'x none':>7} "
          f"{'scrapes/s':>10}")
    for r in rows:
        print(f"{r['endpoint']:<10} {r['scraper']:<8} {r['median_ms']:>10.3f} {r['p90_ms']:>8.3f} "
              f"{r['vs_none']:>7.2f} {r['scrapes_per_s']:>10.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seqs": args.seqs, "steps": args.steps, "rounds": args.rounds,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
