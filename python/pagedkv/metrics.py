"""The cache's signals as Prometheus metrics, read when scraped.

Owns :class:`PagedKVCollector`, a ``prometheus_client`` custom collector over one
:class:`~pagedkv.BlockManager` (and optionally the :class:`~pagedkv.scheduler.Scheduler` driving it),
and :func:`start_metrics_server`, which serves it over HTTP. ``prometheus_client`` is an optional
dependency (the ``pagedkv[metrics]`` extra), imported only when a collector is built; without it
:class:`MetricsUnavailableError` says which extra to install, in one line.

Nothing here runs per step: every scrape takes one :meth:`BlockManager.stats` snapshot (the core's
counters, read under the manager's lock, so a scrape from the HTTP thread during a step waits for
the step and never fails) and reads a few scheduler attributes. Names are ``pagedkv_*`` with the
meanings vLLM gives its ``vllm:*`` counterparts:

=====================================================  ===========================================
``pagedkv_kv_cache_usage_ratio``                        used blocks / total (cached-free = free), 0..1
``pagedkv_prefix_cache_queries_total``                  prompt tokens looked up in the prefix cache
``pagedkv_prefix_cache_hits_total``                     of those, tokens served from cached blocks
``pagedkv_preemptions_total{mode="swap"|"recompute"}``  sequences preempted, by how they were reclaimed
``pagedkv_evictions_total``                             cached-free blocks evicted for an allocation
``pagedkv_swapped_out_blocks_total`` / ``_in_``         blocks copied device→host / host→device
``pagedkv_swapped_out_bytes_total`` / ``_in_``          the same in bytes (needs ``bytes_per_block``)
``pagedkv_host_kv_cache_usage_ratio``                   host blocks in use / host blocks (swap tier)
``pagedkv_blocks_per_seq``                              live sequences by block count (gauge histogram)
``pagedkv_num_requests_running`` / ``_waiting`` /       requests (distinct request ids) in each queue
``_swapped``
``pagedkv_num_blocks`` / ``pagedkv_num_free_blocks``    the pool and what an allocation could take
=====================================================  ===========================================

``pagedkv_blocks_per_seq`` describes the live sequences at scrape time, not accumulated
observations: its buckets go up and down (Prometheus' histogram type is used for its shape; apply
``histogram_quantile`` to the buckets directly, never ``rate``). Its upper bounds are the core's
power-of-two buckets (``le`` = 1, 2, 4, ..., 16384, +Inf).

Preemptions by mode come from the scheduler when one is given (it decides every preemption,
whichever core calls reclaim the blocks: ``Scheduler.num_preemptions_by_mode``), else from the
core's ``Stats.preemptions_swap`` / ``preemptions_recompute``. Swap counters read zero on a core
without a host pool. Invariants: a scrape never changes the manager or the scheduler, and
never raises because a step is running.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

from .errors import InvalidArgumentError, PagedKVError

if TYPE_CHECKING:
    from .manager import BlockManager
    from .scheduler import Scheduler

__all__ = ["PagedKVCollector", "MetricsUnavailableError", "start_metrics_server", "snapshot"]

logger = logging.getLogger("pagedkv")

#: Upper bounds (blocks) of ``Stats.blocks_per_seq``'s buckets but the last: bucket 0 holds 0-1
#: blocks, bucket k holds (2**(k-1), 2**k]; the last (16th) is everything above 2**14.
_BUCKET_BOUNDS = tuple(float(2**k) for k in range(15))


class MetricsUnavailableError(PagedKVError, ImportError):
    """``prometheus_client`` is not installed (install the ``pagedkv[metrics]`` extra)."""


def _prometheus() -> Any:
    try:
        import prometheus_client  # noqa: F401
        from prometheus_client import core
    except ImportError:
        raise MetricsUnavailableError(
            "metrics need prometheus_client: pip install 'pagedkv[metrics]'") from None
    return core


def snapshot(manager: "BlockManager", scheduler: Optional["Scheduler"] = None,
             bytes_per_block: Optional[int] = None) -> Dict[str, Any]:
    """The figures one scrape exports, as a plain dict (also what the collector reads).

    Keys: ``kv_cache_usage``, ``num_blocks``, ``num_free_blocks``, ``prefix_queries``,
    ``prefix_hits``, ``preemptions`` (``{"swap": n, "recompute": n}``), ``evictions``,
    ``swapped_out_blocks``, ``swapped_in_blocks``, ``swapped_out_bytes``, ``swapped_in_bytes``
    (``None`` without ``bytes_per_block``), ``num_host_blocks``, ``host_used_blocks``,
    ``blocks_per_seq`` (bucket counts), ``blocks_per_seq_sum`` (``None`` when the core does not
    report it), ``running``, ``waiting``, ``swapped`` (request counts; ``None`` without a scheduler).
    """
    s = manager.stats()
    usage = getattr(s, "kv_cache_usage", None)
    if usage is None:
        usage = s.used_blocks / s.num_blocks if s.num_blocks else 0.0
    by_mode = _preemptions(s, scheduler)
    out_blocks = int(getattr(s, "swapped_out_blocks", 0) or 0)
    in_blocks = int(getattr(s, "swapped_in_blocks", 0) or 0)
    host_total = int(getattr(s, "num_host_blocks", 0) or 0)
    host_free = int(getattr(s, "host_free_blocks", host_total) or 0)
    d: Dict[str, Any] = {
        "kv_cache_usage": float(usage),
        "num_blocks": s.num_blocks,
        "num_free_blocks": s.free_blocks + s.cached_free_blocks,
        "prefix_queries": s.prefix_query_tokens,
        "prefix_hits": s.prefix_hit_tokens,
        "preemptions": by_mode,
        "evictions": s.evictions,
        "swapped_out_blocks": out_blocks,
        "swapped_in_blocks": in_blocks,
        "swapped_out_bytes": out_blocks * bytes_per_block if bytes_per_block else None,
        "swapped_in_bytes": in_blocks * bytes_per_block if bytes_per_block else None,
        "num_host_blocks": host_total,
        "host_used_blocks": host_total - host_free,
        "blocks_per_seq": tuple(s.blocks_per_seq),
        "blocks_per_seq_sum": getattr(s, "blocks_per_seq_sum", None),
        "running": None, "waiting": None, "swapped": None,
    }
    if scheduler is not None:
        d["running"] = _num_requests(scheduler, "running")
        d["waiting"] = _num_requests(scheduler, "waiting")
        d["swapped"] = _num_requests(scheduler, "swapped")
    return d


def _preemptions(s: Any, scheduler: Any) -> Dict[str, int]:
    # The scheduler decides every preemption, whichever core calls it makes, so its counts win;
    # without one, the core's per-mode counters; a core without those only ever recomputed.
    modes = getattr(scheduler, "num_preemptions_by_mode", None) if scheduler is not None else None
    if modes is not None:
        return {"swap": int(modes.get("swap", 0)), "recompute": int(modes.get("recompute", 0))}
    if scheduler is not None and hasattr(scheduler, "num_preemptions"):
        return {"swap": 0, "recompute": int(scheduler.num_preemptions)}
    if hasattr(s, "preemptions_swap"):
        return {"swap": int(s.preemptions_swap), "recompute": int(s.preemptions_recompute)}
    return {"swap": 0, "recompute": int(getattr(s, "preemptions", 0))}


def _num_requests(scheduler: Any, queue: str) -> int:
    """Distinct requests in one of the scheduler's queues, read from another thread if need be.

    ``tuple(deque)`` runs in C under the GIL, so it sees the queue between two mutations; should a
    mutation still interleave (another interpreter build), the read is retried.
    """
    for _ in range(8):
        try:
            seqs = tuple(getattr(scheduler, queue, ()) or ())
            break
        except RuntimeError:  # "deque mutated during iteration"
            continue
    else:
        return 0
    return len({s.request_id or ("seq", s.seq_id) for s in seqs})


class PagedKVCollector:
    """A ``prometheus_client`` collector reading one manager (and scheduler) at scrape time.

    Args:
        manager: The :class:`~pagedkv.BlockManager` to read.
        scheduler: Its :class:`~pagedkv.scheduler.Scheduler`, for the queue gauges and (with a core
            lacking per-mode counters) the preemptions by mode. Optional.
        bytes_per_block: Bytes of one block in every layer's K and V
            (:attr:`pagedkv.CacheSpec.bytes_per_block`), for the swapped-bytes counters; without
            it those counters are not exported.
        labels: Constant labels added to every sample (e.g. ``{"model": "smollm2"}``).

    Register it with ``prometheus_client.REGISTRY.register(collector)`` or pass it to
    :func:`start_metrics_server`.

    Raises:
        MetricsUnavailableError: ``prometheus_client`` is not installed.
        InvalidArgumentError: ``manager`` has no ``stats()``, or ``bytes_per_block`` is not a
            positive int.
    """

    def __init__(self, manager: "BlockManager", scheduler: Optional["Scheduler"] = None, *,
                 bytes_per_block: Optional[int] = None,
                 labels: Optional[Dict[str, str]] = None) -> None:
        self._core = _prometheus()
        if not callable(getattr(manager, "stats", None)):
            raise InvalidArgumentError(
                f"invalid argument: manager = {type(manager).__name__}: must be a BlockManager",
                what="manager", value=type(manager).__name__, reason="must be a BlockManager")
        if bytes_per_block is not None and (isinstance(bytes_per_block, bool)
                                            or not isinstance(bytes_per_block, int)
                                            or bytes_per_block < 1):
            raise InvalidArgumentError(
                f"invalid argument: bytes_per_block = {bytes_per_block!r}: must be an int >= 1",
                what="bytes_per_block", value=bytes_per_block, reason="must be an int >= 1")
        self.manager = manager
        self.scheduler = scheduler
        self.bytes_per_block = bytes_per_block
        self._label_names = tuple(sorted(labels or {}))
        self._label_values = tuple(str((labels or {})[k]) for k in self._label_names)

    def describe(self) -> List[Any]:
        # Returning nothing here makes the registry skip its collision check; describing by
        # collecting once would take a snapshot at registration, which is also fine but not needed.
        return []

    def collect(self) -> Iterator[Any]:
        c = self._core
        d = snapshot(self.manager, self.scheduler, self.bytes_per_block)
        names, values = list(self._label_names), list(self._label_values)

        def gauge(name: str, doc: str, value: float) -> Any:
            g = c.GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> Any:
            m = c.CounterMetricFamily(name, doc, labels=names)
            m.add_metric(values, value)
            return m

        yield gauge("pagedkv_kv_cache_usage_ratio",
                    "KV cache usage: blocks in use / blocks in the pool (cached-free blocks count as "
                    "free). 1 means no free block.", d["kv_cache_usage"])
        yield gauge("pagedkv_num_blocks", "KV blocks in the device pool.", d["num_blocks"])
        yield gauge("pagedkv_num_free_blocks",
                    "KV blocks an allocation could take now (free plus cached-free).",
                    d["num_free_blocks"])
        yield counter("pagedkv_prefix_cache_queries_total",
                      "Prefix cache queries, in prompt tokens looked up.", d["prefix_queries"])
        yield counter("pagedkv_prefix_cache_hits_total",
                      "Prefix cache hits, in prompt tokens served from cached blocks.",
                      d["prefix_hits"])
        pre = c.CounterMetricFamily("pagedkv_preemptions_total",
                                    "Sequences preempted, by reclamation mode (swap to host memory "
                                    "or recompute from token ids).", labels=names + ["mode"])
        for mode in ("swap", "recompute"):
            pre.add_metric(values + [mode], d["preemptions"][mode])
        yield pre
        yield counter("pagedkv_evictions_total",
                      "Cached-free KV blocks evicted to satisfy an allocation.", d["evictions"])
        yield counter("pagedkv_swapped_out_blocks_total",
                      "KV blocks copied from the device pool to host memory.",
                      d["swapped_out_blocks"])
        yield counter("pagedkv_swapped_in_blocks_total",
                      "KV blocks copied from host memory back to the device pool.",
                      d["swapped_in_blocks"])
        if d["swapped_out_bytes"] is not None:
            yield counter("pagedkv_swapped_out_bytes_total",
                          "Bytes of KV copied from the device pool to host memory.",
                          d["swapped_out_bytes"])
            yield counter("pagedkv_swapped_in_bytes_total",
                          "Bytes of KV copied from host memory back to the device pool.",
                          d["swapped_in_bytes"])
        host = d["num_host_blocks"]
        yield gauge("pagedkv_host_kv_cache_usage_ratio",
                    "Host (swap) KV blocks in use / host blocks; 0 without a host pool.",
                    d["host_used_blocks"] / host if host else 0.0)
        yield self._histogram(d)
        if self.scheduler is not None:
            yield gauge("pagedkv_num_requests_running", "Requests with sequences running.",
                        d["running"])
            yield gauge("pagedkv_num_requests_waiting", "Requests waiting to be (re)admitted.",
                        d["waiting"])
            yield gauge("pagedkv_num_requests_swapped",
                        "Requests with sequences swapped out to host memory.", d["swapped"])

    def _histogram(self, d: Dict[str, Any]) -> Any:
        counts = d["blocks_per_seq"]
        buckets: List[Tuple[str, float]] = []
        acc = 0
        for bound, n in zip(_BUCKET_BOUNDS, counts):
            acc += n
            buckets.append((_le(bound), acc))
        buckets.append(("+Inf", sum(counts)))
        doc = ("Live sequences by the number of KV blocks in their block table (a snapshot: "
               "buckets rise and fall).")
        h = self._core.HistogramMetricFamily("pagedkv_blocks_per_seq", doc,
                                             labels=list(self._label_names))
        h.add_metric(list(self._label_values), buckets, d["blocks_per_seq_sum"])
        return h


def _le(bound: float) -> str:
    return str(int(bound)) + ".0"


def start_metrics_server(port: int, manager: "BlockManager",
                         scheduler: Optional["Scheduler"] = None, *, addr: str = "127.0.0.1",
                         bytes_per_block: Optional[int] = None) -> Tuple[Any, Any, Any]:
    """Serves ``manager``'s (and ``scheduler``'s) metrics at ``http://addr:port/metrics``.

    The server runs in a daemon thread with a registry of its own (holding only this collector, so
    two servers in one process do not collide). Port 0 picks a free port; read it back from
    ``server.server_port``.

    Returns:
        ``(server, thread, registry)``; stop with ``server.shutdown(); server.server_close()``.

    Raises:
        MetricsUnavailableError: ``prometheus_client`` is not installed.
        InvalidArgumentError: ``port`` is not an int in ``[0, 65535]``.
        OSError: The port cannot be bound.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgumentError(
            f"invalid argument: port = {port!r}: must be an int in [0, 65535]", what="port",
            value=port, reason="must be an int in [0, 65535]")
    collector = PagedKVCollector(manager, scheduler, bytes_per_block=bytes_per_block)
    import prometheus_client

    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, thread = prometheus_client.start_http_server(port, addr=addr, registry=registry)
    logger.info("metrics served at http://%s:%d/metrics", addr, server.server_port)
    return server, thread, registry
