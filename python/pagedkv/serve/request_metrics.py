"""Request-level signals of a served engine, as a Prometheus collector.

Owns :class:`RequestMetrics`, an :class:`~pagedkv.engine.async_llm.RequestObserver` that the engine
thread of :class:`~pagedkv.AsyncLLM` tells about every request, and that a ``prometheus_client``
registry scrapes. The names follow :mod:`pagedkv.metrics` (``pagedkv_*``) with the meanings vLLM
gives its ``vllm:*`` counterparts:

======================================================  =========================================
``pagedkv_time_to_first_token_seconds``                 arrival to first generated token
``pagedkv_inter_token_latency_seconds``                 between a request's consecutive steps
                                                        that produced tokens
``pagedkv_e2e_request_latency_seconds``                 arrival to finish (or abort)
``pagedkv_prompt_tokens_total``                         prompt tokens of requests that started
                                                        generating
``pagedkv_generation_tokens_total``                     tokens generated, over all samples
``pagedkv_request_success_total{finished_reason}``      requests ended: ``stop``, ``length`` or
                                                        ``abort``
``pagedkv_request_cached_prompt_tokens``                histogram: per request, the prompt tokens
                                                        the prefix cache served (any tier)
``pagedkv_cached_prompt_tokens_total``                  their sum (with
                                                        ``pagedkv_prompt_tokens_total``: the share
                                                        of prompt tokens not recomputed)
======================================================  =========================================

The running / waiting request gauges (``pagedkv_num_requests_running`` / ``_waiting``) come from
:class:`pagedkv.metrics.PagedKVCollector` given the engine's scheduler; a server registers both.

Invariants: observations only add (histograms and counters never go down); the engine thread
writes and the scrape thread reads under one lock, so a scrape sees each observation whole; nothing
here needs ``prometheus_client`` until :meth:`RequestMetrics.collect` runs.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

__all__ = ["RequestMetrics", "Histogram", "TTFT_BUCKETS", "ITL_BUCKETS", "E2E_BUCKETS",
           "CACHED_TOKENS_BUCKETS"]

#: Upper bounds, seconds. Roughly 1-2.5-5 per decade, from what a GPU step costs to what a long
#: generation on a loaded CPU costs.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0,
                100.0, 250.0, 500.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0,
               1000.0)

#: Upper bounds, tokens: none, then powers of 4 from one small block to a long context.
CACHED_TOKENS_BUCKETS = (0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0)

FINISH_REASONS = ("stop", "length", "abort")


class Histogram:
    """Counts per bucket (upper bound inclusive, as Prometheus' ``le``), plus sum and count."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> List[Tuple[str, float]]:
        """``(le, cumulative count)`` per bucket, ``+Inf`` last (Prometheus' exposition)."""
        out: List[Tuple[str, float]] = []
        acc = 0
        for bound, n in zip(self.bounds, self.counts):
            acc += n
            out.append((repr(bound), float(acc)))
        out.append(("+Inf", float(self.count)))
        return out


class RequestMetrics:
    """Request-level histograms and counters, fed by :class:`~pagedkv.AsyncLLM`, read by scrapes.

    Args:
        labels: Constant labels on every sample (a server sets ``{"model_name": ...}``).
    """

    def __init__(self, labels: Optional[Dict[str, str]] = None) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.cached = Histogram(CACHED_TOKENS_BUCKETS)
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self._label_names = sorted(labels or {})
        self._label_values = [str((labels or {})[k]) for k in self._label_names]

    # ------------------------------------------------------------------ RequestObserver

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        with self._lock:
            self.ttft.observe(ttft_s)
            self.prompt_tokens += num_prompt_tokens

    def on_cached_tokens(self, num_cached_tokens: int, num_prompt_tokens: int) -> None:
        with self._lock:
            self.cached.observe(float(num_cached_tokens))
            self.cached_prompt_tokens += num_cached_tokens

    def on_tokens(self, num_new_tokens: int, since_last_s: Optional[float]) -> None:
        with self._lock:
            self.generation_tokens += num_new_tokens
            if since_last_s is not None:
                self.itl.observe(since_last_s)

    def on_finished(self, e2e_s: float, finish_reason: str) -> None:
        with self._lock:
            self.e2e.observe(e2e_s)
            self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1

    # ------------------------------------------------------------------ collector

    def snapshot(self) -> Dict[str, Any]:
        """Everything a scrape exports, copied under the lock (also handy in tests)."""
        with self._lock:
            return {
                "ttft": (self.ttft.cumulative(), self.ttft.sum, self.ttft.count),
                "itl": (self.itl.cumulative(), self.itl.sum, self.itl.count),
                "e2e": (self.e2e.cumulative(), self.e2e.sum, self.e2e.count),
                "cached": (self.cached.cumulative(), self.cached.sum, self.cached.count),
                "prompt_tokens": self.prompt_tokens,
                "cached_prompt_tokens": self.cached_prompt_tokens,
                "generation_tokens": self.generation_tokens,
                "finished": dict(self.finished),
            }

    def describe(self) -> List[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client import core

        d = self.snapshot()
        names, values = list(self._label_names), list(self._label_values)
        for key, name, doc in (
            ("ttft", "pagedkv_time_to_first_token_seconds",
             "Time from a request's arrival to its first generated token."),
            ("itl", "pagedkv_inter_token_latency_seconds",
             "Time between two consecutive steps that gave a request new tokens."),
            ("e2e", "pagedkv_e2e_request_latency_seconds",
             "Time from a request's arrival to its end (finished or aborted)."),
            ("cached", "pagedkv_request_cached_prompt_tokens",
             "Prompt tokens of a request served from the prefix cache (any tier)."),
        ):
            buckets, total, _count = d[key]
            h = core.HistogramMetricFamily(name, doc, labels=names)
            h.add_metric(values, buckets, total)
            yield h
        for key, name, doc in (
            ("prompt_tokens", "pagedkv_prompt_tokens_total",
             "Prompt tokens of requests that started generating."),
            ("generation_tokens", "pagedkv_generation_tokens_total",
             "Tokens generated, over all samples."),
            ("cached_prompt_tokens", "pagedkv_cached_prompt_tokens_total",
             "Prompt tokens served from the prefix cache (any tier), of requests that started "
             "generating."),
        ):
            c = core.CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, d[key])
            yield c
        ok = core.CounterMetricFamily("pagedkv_request_success_total",
                                      "Requests ended, by finish reason (abort: cancelled or the "
                                      "client went away).", labels=names + ["finished_reason"])
        for reason, n in sorted(d["finished"].items()):
            ok.add_metric(values + [reason], n)
        yield ok
