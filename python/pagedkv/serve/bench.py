"""``pagedkv bench serve``: load an OpenAI-compatible server the way users do, and time it.

Owns the workload (a seeded dataset of prompts and Poisson arrivals), the streaming client and the
report. Each request is a streaming ``POST /v1/completions`` (token-id prompts, ``max_tokens`` the
output length, ``stream_options.include_usage``) sent at its arrival time; the client records when
it was sent, when each chunk with new text or tokens arrived, and how it ended. From those:

* TTFT: send to first chunk; ITL: between consecutive chunks of one request; TPOT: (end - first
  chunk) / (output tokens - 1) per request; E2E: send to end;
* throughput: completed requests, output tokens and prompt + output tokens over the wall time from
  the first send to the last end.

Datasets: ``random`` (prompt lengths uniform within ``--range-ratio`` of ``--input-len``, random
token ids) and ``prefix`` (every prompt starts with one of ``--num-prefixes`` shared prefixes of
``--prefix-len`` tokens, then a random part): the second exercises the prefix cache. Token ids are
drawn from ``[0, vocab)``, where vocab is what ``/v1/models`` reports (``vocab_size``) or
``--vocab-size``.

The flags and the result file follow ``vllm bench serve``'s where they exist (``--base-url``,
``--dataset-name``, ``--random-input-len`` / ``--random-output-len``, ``--num-warmups``,
``--save-result --result-dir``, ``--percentile-metrics``, ``--metric-percentiles``,
``--extra-body``), and the summary carries vLLM's flat keys (``completed``,
``total_input_tokens``, ``request_throughput``, ``output_throughput``, ``mean_ttft_ms``,
``median_ttft_ms``, ``std_ttft_ms``, ``p99_ttft_ms``, ... for each metric and percentile asked
for) beside its own nested ``ttft_ms`` / ``tpot_ms`` / ``itl_ms`` / ``e2e_ms`` tables. Warm-up
requests run before the clock starts and count nowhere. A progress bar (requests done) is drawn
on stderr only when it is a terminal.

Invariants: the workload depends only on the flags and ``--seed`` (the same command sends the same
prompts at the same offsets); a request that fails (a 503 when the server's queue is full, an error,
a timeout) is counted as failed with its status, never folded into the latency figures; the client
opens no connection beyond ``--url``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["add_arguments", "run_from_args", "BenchConfig", "RequestResult", "build_workload",
           "result_filename", "METRICS",
           "run_bench", "summarize", "format_report"]


@dataclass
class BenchConfig:
    url: str = "http://127.0.0.1:8000"
    model: Optional[str] = None
    num_prompts: int = 100
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: Optional[int] = None
    dataset: str = "random"
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    prefix_len: int = 256
    num_prefixes: int = 1
    vocab_size: Optional[int] = None
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int = 0
    timeout_s: float = 600.0
    api_key: Optional[str] = None
    #: Requests sent (at most ``max_concurrency`` at a time) before the measured run; not counted.
    num_warmups: int = 0
    #: Merged into every request's JSON body (``--extra-body``).
    extra_body: Dict[str, Any] = field(default_factory=dict)
    #: Metrics and percentiles of the flat vLLM-style keys (``p99_ttft_ms``...).
    percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl")
    metric_percentiles: Sequence[float] = (99.0,)
    #: A progress bar on stderr: ``None`` draws it only on a terminal, ``False`` never.
    progress: Optional[bool] = None


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0
    ok: bool = False
    status: Optional[int] = None
    error: str = ""
    sent: float = 0.0
    ttft: Optional[float] = None
    itl: List[float] = field(default_factory=list)
    e2e: Optional[float] = None


# ------------------------------------------------------------------------------------ workload

def build_workload(cfg: BenchConfig, vocab: int) -> tuple[List[List[int]], List[float]]:
    """The prompts (token ids) and their send offsets (seconds from the start)."""
    import numpy as np

    rng = np.random.default_rng(cfg.seed)
    lo = max(1, int(cfg.input_len * (1 - cfg.range_ratio)))
    hi = max(lo, int(cfg.input_len * (1 + cfg.range_ratio)))
    lens = rng.integers(lo, hi + 1, cfg.num_prompts)
    prompts: List[List[int]] = []
    prefixes = [rng.integers(0, vocab, cfg.prefix_len).tolist() for _ in range(cfg.num_prefixes)]
    for i, n in enumerate(lens):
        body = rng.integers(0, vocab, int(n)).tolist()
        if cfg.dataset == "prefix":
            body = prefixes[i % cfg.num_prefixes] + body
        prompts.append(body)
    if math.isinf(cfg.request_rate):
        offsets = [0.0] * cfg.num_prompts
    else:
        # Gamma inter-arrivals with mean 1/rate; shape 1 is a Poisson process, smaller is burstier.
        shape = cfg.burstiness
        gaps = rng.gamma(shape, 1.0 / (cfg.request_rate * shape), cfg.num_prompts)
        gaps[0] = 0.0
        offsets = np.cumsum(gaps).tolist()
    return prompts, offsets


# -------------------------------------------------------------------------------------- client

async def _one(client: Any, url: str, payload: Dict[str, Any], result: RequestResult,
               headers: Dict[str, str]) -> None:
    result.sent = time.perf_counter()
    last = result.sent
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                try:
                    result.error = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    result.error = body[:200]
                return
            chunks = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    result.ok = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    result.error = str(obj["error"].get("message", obj["error"]))
                    return
                usage = obj.get("usage")
                if usage:
                    result.output_len = int(usage.get("completion_tokens", 0))
                choices = obj.get("choices") or []
                if not any(c.get("text") or (c.get("logprobs") or {}).get("tokens")
                           for c in choices):
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - result.sent
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
            if not result.output_len:
                result.output_len = chunks
            result.e2e = time.perf_counter() - result.sent
    except Exception as exc:  # a timeout or a dropped connection: this request failed
        result.error = f"{type(exc).__name__}: {exc}"
        result.ok = False


async def _model_info(client: Any, base: str, headers: Dict[str, str]) -> Dict[str, Any]:
    resp = await client.get(f"{base}/v1/models", headers=headers)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base}/v1/models lists no model")
    return dict(data[0])


async def run_bench(cfg: BenchConfig) -> Dict[str, Any]:
    """Runs the benchmark; returns :func:`summarize`'s dict (plus the configuration)."""
    import httpx

    base = cfg.url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limit = cfg.max_concurrency or cfg.num_prompts
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        info = await _model_info(client, base, headers)
        model = cfg.model or str(info["id"])
        vocab = cfg.vocab_size or int(info.get("vocab_size") or 0)
        if vocab < 2:
            raise RuntimeError("the server does not report vocab_size: pass --vocab-size")
        prompts, offsets = build_workload(cfg, vocab)
        results = [RequestResult(prompt_len=len(p)) for p in prompts]
        gate = asyncio.Semaphore(limit)
        url = f"{base}/v1/completions"

        def payload(prompt: List[int]) -> Dict[str, Any]:
            body: Dict[str, Any] = {"model": model, "prompt": prompt,
                                    "max_tokens": cfg.output_len,
                                    "temperature": cfg.temperature, "stream": True,
                                    "stream_options": {"include_usage": True}}
            if cfg.ignore_eos:
                body["ignore_eos"] = True
            body.update(cfg.extra_body)
            return body

        if cfg.num_warmups:
            warm = [RequestResult(prompt_len=len(prompts[i % len(prompts)]))
                    for i in range(cfg.num_warmups)]

            async def warmup(i: int) -> None:
                async with gate:
                    await _one(client, url, payload(prompts[i % len(prompts)]), warm[i], headers)

            await asyncio.gather(*(warmup(i) for i in range(cfg.num_warmups)))
            bad = [w for w in warm if not w.ok]
            if len(bad) == len(warm):
                raise RuntimeError(f"every warm-up request failed: {bad[0].error or bad[0].status}")

        bar = _progress_bar(cfg.progress, len(prompts))

        async def launch(i: int) -> None:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            async with gate:
                await _one(client, url, payload(prompts[i]), results[i], headers)
            if bar is not None:
                bar.update(1)

        start = time.perf_counter()
        try:
            await asyncio.gather(*(launch(i) for i in range(len(prompts))))
        finally:
            if bar is not None:
                bar.close()
        ends = [r.sent + r.e2e for r in results if r.ok and r.e2e is not None]
        duration = (max(ends) if ends else time.perf_counter()) - start
    summary = summarize(results, duration, percentile_metrics=cfg.percentile_metrics,
                        metric_percentiles=cfg.metric_percentiles)
    summary["config"] = {**asdict(cfg), "model": model, "vocab_size": vocab,
                         "request_rate": None if math.isinf(cfg.request_rate)
                         else cfg.request_rate}
    summary.update({"model_id": model, "num_prompts": cfg.num_prompts,
                    "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
                    "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency,
                    "num_warmups": cfg.num_warmups})
    return summary


def _progress_bar(enabled: Optional[bool], total: int) -> Any:
    """A tqdm bar on stderr (``enabled=None``: only on a terminal), or ``None``."""
    if enabled is False:
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True,
                disable=None if enabled is None else not enabled, leave=False)


# -------------------------------------------------------------------------------------- report

def _stats(values: Sequence[float]) -> Dict[str, Optional[float]]:
    import numpy as np

    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=float) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


#: The metrics of ``--percentile-metrics`` and the samples each is taken over.
METRICS = ("ttft", "tpot", "itl", "e2el")


def _pkey(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _flat(name: str, values: Sequence[float], percentiles: Sequence[float]) -> Dict[str, float]:
    """vLLM's flat keys of one metric, in milliseconds: mean, median, std and each percentile
    (0.0 where there are no samples, as vLLM reports)."""
    import numpy as np

    a = np.asarray(values, dtype=float) * 1e3 if len(values) else np.zeros(1)
    out = {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
           f"std_{name}_ms": float(a.std())}
    for p in percentiles:
        out[f"p{_pkey(p)}_{name}_ms"] = float(np.percentile(a, p))
    return out


def summarize(results: Sequence[RequestResult], duration_s: float, *,
              percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
              metric_percentiles: Sequence[float] = (99.0,)) -> Dict[str, Any]:
    """Throughput and latency figures (latencies in milliseconds), nested tables and vLLM's flat
    keys for ``percentile_metrics`` at ``metric_percentiles``."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) for r in done
            if r.e2e is not None and r.ttft is not None and r.output_len > 1]
    by_status: Dict[str, int] = {}
    for r in failed:
        key = str(r.status) if r.status is not None else "error"
        by_status[key] = by_status.get(key, 0) + 1
    d = max(duration_s, 1e-9)
    samples = {"ttft": [r.ttft for r in done if r.ttft is not None], "tpot": tpot,
               "itl": [x for r in done for x in r.itl],
               "e2el": [r.e2e for r in done if r.e2e is not None]}
    flat: Dict[str, Any] = {}
    for name in percentile_metrics:
        flat.update(_flat(name, samples[name], metric_percentiles))
    return {
        **flat,
        "duration": duration_s,
        "input_lens": [r.prompt_len for r in done],
        "output_lens": [r.output_len for r in done],
        "errors": [r.error for r in failed],
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(failed),
        "failed_by_status": by_status,
        "first_errors": sorted({r.error for r in failed if r.error})[:3],
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / d,
        "output_throughput": out_tokens / d,
        "total_token_throughput": (in_tokens + out_tokens) / d,
        "ttft_ms": _stats(samples["ttft"]),
        "tpot_ms": _stats(samples["tpot"]),
        "itl_ms": _stats(samples["itl"]),
        "e2e_ms": _stats(samples["e2el"]),
    }


def format_report(s: Dict[str, Any]) -> str:
    cfg = s.get("config", {})
    rate = cfg.get("request_rate")
    lines = [
        f"pagedkv bench serve: {cfg.get('num_prompts')} prompts, "
        f"rate {'inf' if rate is None else rate} req/s, dataset {cfg.get('dataset')}, "
        f"model {cfg.get('model')} at {cfg.get('url')}",
        f"{'completed / failed':<28}{s['completed']} / {s['failed']}"
        + (f"  {s['failed_by_status']}" if s["failed"] else ""),
        f"{'duration':<28}{s['duration_s']:.2f} s",
        f"{'input / output tokens':<28}{s['total_input_tokens']} / {s['total_output_tokens']}",
        f"{'request throughput':<28}{s['request_throughput']:.2f} req/s",
        f"{'output token throughput':<28}{s['output_throughput']:.1f} tok/s",
        f"{'total token throughput':<28}{s['total_token_throughput']:.1f} tok/s",
        "",
        f"{'ms':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                       ("e2e_ms", "E2E")):
        st = s[key]
        cells = "".join(f"{'-' if st[k] is None else format(st[k], '.1f'):>10}"
                        for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{label:<8}{cells}")
    for e in s.get("first_errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- command

def _positive(kind: Any) -> Any:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return v
    return parse


def _ratio(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return v


def _metrics(text: str) -> List[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a comma-separated list of {', '.join(METRICS)}")
    return names


def _percentiles(text: str) -> List[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers like 50,90,99") from None
    if not values or not all(0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: percentiles must be in (0, 100]")
    return values


def _json_object(text: str) -> Dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``pagedkv bench serve``; vLLM's names are the aliases they have there."""
    d = BenchConfig()
    g = p.add_argument_group("server")
    g.add_argument("--base-url", "--url", dest="url", default=None,
                   help=f"the server's base URL (default: http://HOST:PORT, {d.url})")
    g.add_argument("--host", default="127.0.0.1", help="with --port, the server (default: "
                   "127.0.0.1; ignored with --base-url)")
    g.add_argument("--port", type=_positive(int), default=8000, help="the server's port "
                   "(default: 8000)")
    g.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions",),
                   help="the API route; streaming completions (default)")
    g.add_argument("--backend", default="openai", choices=("openai", "vllm", "pagedkv"),
                   help="accepted for vLLM compatibility: every backend is an OpenAI-compatible "
                        "completions server")
    g.add_argument("--model", default=None,
                   help="model name to send (default: the first of /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--timeout", type=_positive(float), default=d.timeout_s, metavar="S",
                   help=f"per-request timeout, seconds (default: {d.timeout_s:g})")
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=_positive(int), default=d.num_prompts, metavar="N",
                   help=f"requests to send (default: {d.num_prompts})")
    g.add_argument("--request-rate", type=_positive(float), default=d.request_rate, metavar="R",
                   help="mean arrivals per second, Poisson (default: inf, all at once)")
    g.add_argument("--burstiness", type=_positive(float), default=d.burstiness, metavar="X",
                   help="gamma shape of the inter-arrival times: 1 is Poisson, < 1 burstier "
                        "(default: 1)")
    g.add_argument("--max-concurrency", type=_positive(int), default=None, metavar="N",
                   help="most requests in flight (default: no limit)")
    g.add_argument("--num-warmups", type=_nonneg_int, default=0, metavar="N",
                   help="requests sent before the measured run, not counted (default: 0)")
    g.add_argument("--extra-body", type=_json_object, default=None, metavar="JSON",
                   help="a JSON object merged into every request body, e.g. '{\"top_p\": 0.9}'")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", "--dataset", dest="dataset", choices=("random", "prefix"),
                   default=d.dataset,
                   help="random token prompts, or prompts behind shared prefixes (default: random)")
    g.add_argument("--random-input-len", "--input-len", dest="input_len", type=_positive(int),
                   default=d.input_len, metavar="N",
                   help=f"prompt tokens (the random part with --dataset-name prefix; default: "
                        f"{d.input_len})")
    g.add_argument("--random-output-len", "--output-len", dest="output_len", type=_positive(int),
                   default=d.output_len, metavar="N",
                   help=f"max_tokens of every request (default: {d.output_len})")
    g.add_argument("--random-range-ratio", "--range-ratio", dest="range_ratio", type=_ratio,
                   default=d.range_ratio, metavar="X",
                   help="prompt lengths uniform in input-len * [1 - X, 1 + X] (default: 0)")
    g.add_argument("--prefix-len", type=_positive(int), default=d.prefix_len, metavar="N",
                   help=f"tokens of each shared prefix (--dataset-name prefix; default: "
                        f"{d.prefix_len})")
    g.add_argument("--num-prefixes", type=_positive(int), default=d.num_prefixes, metavar="N",
                   help=f"distinct shared prefixes (default: {d.num_prefixes})")
    g.add_argument("--vocab-size", type=_positive(int), default=None, metavar="N",
                   help="token ids are drawn below this (default: the server's vocab_size)")
    g.add_argument("--temperature", type=float, default=d.temperature,
                   help="sampling temperature (default: 0, greedy)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --random-output-len tokens (the server's ignore_eos)")
    g.add_argument("--seed", type=int, default=d.seed, help=f"workload seed (default: {d.seed})")
    g = p.add_argument_group("output")
    g.add_argument("--percentile-metrics", type=_metrics, default=list(d.percentile_metrics),
                   metavar="LIST", help="metrics of the percentile keys, comma-separated, of "
                   f"{','.join(METRICS)} (default: {','.join(d.percentile_metrics)})")
    g.add_argument("--metric-percentiles", type=_percentiles,
                   default=list(d.metric_percentiles), metavar="LIST",
                   help="percentiles reported, comma-separated, e.g. 50,90,99 (default: 99)")
    g.add_argument("--save-result", action="store_true",
                   help="write the result JSON to --result-dir/--result-filename")
    g.add_argument("--result-dir", default=None, metavar="DIR",
                   help="directory of --save-result (default: the current one)")
    g.add_argument("--result-filename", default=None, metavar="NAME",
                   help="file name of --save-result (default: "
                        "BACKEND-RATEqps-MODEL-YYYYmmdd-HHMMSS.json)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def result_filename(backend: str, summary: Dict[str, Any], now: Optional[float] = None) -> str:
    """vLLM's default result file name: ``BACKEND-RATEqps-MODEL-YYYYmmdd-HHMMSS.json`` (the
    model's last path component)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    model = str(summary.get("model_id") or "model").rstrip("/").split("/")[-1]
    return f"{backend}-{summary.get('request_rate', 'inf')}qps-{model}-{stamp}.json"


def run_from_args(args: argparse.Namespace) -> int:
    url = args.url or f"http://{args.host}:{args.port}"
    cfg = BenchConfig(url=url, model=args.model, num_prompts=args.num_prompts,
                      request_rate=args.request_rate, burstiness=args.burstiness,
                      max_concurrency=args.max_concurrency, dataset=args.dataset,
                      input_len=args.input_len, output_len=args.output_len,
                      range_ratio=args.range_ratio, prefix_len=args.prefix_len,
                      num_prefixes=args.num_prefixes, vocab_size=args.vocab_size,
                      temperature=args.temperature, ignore_eos=args.ignore_eos, seed=args.seed,
                      timeout_s=args.timeout, api_key=args.api_key,
                      num_warmups=args.num_warmups, extra_body=dict(args.extra_body or {}),
                      percentile_metrics=tuple(args.percentile_metrics),
                      metric_percentiles=tuple(args.metric_percentiles),
                      progress=False if args.disable_tqdm or args.json else None)
    try:
        summary = asyncio.run(run_bench(cfg))
    except Exception as exc:
        import httpx

        if isinstance(exc, (httpx.HTTPError, RuntimeError, OSError)):
            from ..errors import InvalidConfigError

            raise InvalidConfigError(f"cannot benchmark {cfg.url}: {exc}", field="url",
                                     value=cfg.url, reason=str(exc)) from None
        raise
    summary.update({"date": time.strftime("%Y%m%d-%H%M%S"), "backend": args.backend,
                    "endpoint": args.endpoint})
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_report(summary))
    if args.save_result:
        import os

        directory = args.result_dir or "."
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, args.result_filename
                            or result_filename(args.backend, summary))
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
        import sys

        print(f"result saved to {path}", file=sys.stderr)
    return 0 if summary["completed"] else 1
