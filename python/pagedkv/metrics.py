"""The cache's signals as Prometheus metrics, and the bounded HTTP endpoint that serves them.

Owns :class:`PagedKVCollector`, a ``prometheus_client`` custom collector over one
:class:`~pagedkv.BlockManager` (and optionally the :class:`~pagedkv.scheduler.Scheduler` driving it),
:class:`MetricsServer`, a single-threaded HTTP endpoint with a connection cap and a per-request
deadline, and :func:`start_metrics_server`, which serves the collector through it.
``prometheus_client`` is an optional dependency (the ``pagedkv[metrics]`` extra), imported only when a
collector is built; without it :class:`MetricsUnavailableError` says which extra to install, in one
line.

A scrape reads a snapshot, never the live structures while a step uses them. With a scheduler, the
scrape asks for one and the step thread takes it at the start of its next
:meth:`~pagedkv.scheduler.Scheduler.schedule` (one :meth:`BlockManager.stats` call and three queue
counts, only when a scrape is waiting), so the manager's lock is never contended and the
scheduler's queues are never read while they change; if no step starts within ``step_wait_s`` (the
engine is idle, or inside a long forward pass that holds neither), the scrape reads them itself.
Snapshots are reused for ``max_age_s``, so a scrape storm costs the engine at most a few snapshots
a second. Names are ``pagedkv_*`` with the meanings vLLM gives its ``vllm:*`` counterparts:

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

The endpoint (:class:`MetricsServer`) listens on 127.0.0.1 unless told otherwise and runs in one
thread whatever its clients do: it holds at most ``max_connections`` sockets (a new connection
beyond that closes the oldest), answers one request per connection, and closes any connection
that has not sent a complete request and received the answer within ``request_timeout_s`` of
being accepted (a client sending a byte a second is cut off like one sending nothing). It
answers at most ``max_requests_per_s`` requests a second and reuses a rendered answer for
``max_age_s``, so even a tight scrape loop costs the engine's process a small, bounded share of
the interpreter. Requests are ``GET`` / ``HEAD`` of ``/metrics`` with headers of at most 8 KiB.
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple

from .errors import InvalidArgumentError, PagedKVError

if TYPE_CHECKING:
    from .manager import BlockManager
    from .scheduler import Scheduler

__all__ = ["PagedKVCollector", "MetricsServer", "MetricsUnavailableError", "start_metrics_server",
           "snapshot"]

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
        from ._optional import install_hint

        raise MetricsUnavailableError(
            f"metrics need prometheus_client: {install_hint('metrics')}") from None
    return core


def snapshot(manager: "BlockManager", scheduler: Optional["Scheduler"] = None,
             bytes_per_block: Optional[int] = None,
             tiers: Optional[Callable[[], Dict[str, Dict[str, Any]]]] = None) -> Dict[str, Any]:
    """The figures one scrape exports, as a plain dict (also what the collector reads).

    Keys: ``kv_cache_usage``, ``num_blocks``, ``num_free_blocks``, ``prefix_queries``,
    ``prefix_hits``, ``preemptions`` (``{"swap": n, "recompute": n}``), ``evictions``,
    ``swapped_out_blocks``, ``swapped_in_blocks``, ``swapped_out_bytes``, ``swapped_in_bytes``
    (``None`` without ``bytes_per_block``), ``num_host_blocks``, ``host_used_blocks``,
    ``blocks_per_seq`` (bucket counts), ``blocks_per_seq_sum`` (``None`` when the core does not
    report it), ``running``, ``waiting``, ``swapped`` (request counts; ``None`` without a scheduler),
    ``tiers`` (``tiers()``'s dict of per-tier ``hits``, ``bytes_read``, ``bytes_written``,
    ``usage``; ``None`` without).
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
        "tiers": tiers() if tiers is not None else None,
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


class _Snapshots:
    """The figures scrapes read: taken by the step thread at a step boundary when a scheduler is
    there to ask, else (or when no step comes) by the scraping thread; reused for ``max_age_s``."""

    def __init__(self, manager: "BlockManager", scheduler: Optional["Scheduler"],
                 bytes_per_block: Optional[int], max_age_s: float, step_wait_s: float,
                 tiers: Optional[Callable[[], Dict[str, Dict[str, Any]]]] = None) -> None:
        self.manager, self.scheduler, self.bytes_per_block = manager, scheduler, bytes_per_block
        self.tiers = tiers
        self.max_age_s, self.step_wait_s = max_age_s, step_wait_s
        self._lock = threading.Lock()  # one scraping thread takes a snapshot at a time
        self._last: Optional[Tuple[float, Dict[str, Any]]] = None

    def _take(self) -> Dict[str, Any]:
        return snapshot(self.manager, self.scheduler, self.bytes_per_block, self.tiers)

    def get(self) -> Dict[str, Any]:
        with self._lock:
            last = self._last
            if last is not None and time.monotonic() - last[0] < self.max_age_s:
                return last[1]
            d = self._from_step() if self.scheduler is not None else None
            if d is None:
                d = self._take()
            self._last = (time.monotonic(), d)
            return d

    def _from_step(self) -> Optional[Dict[str, Any]]:
        sched = self.scheduler
        assert sched is not None
        done = threading.Event()
        box: List[Dict[str, Any]] = []

        def publish() -> None:
            # Runs in the step thread: a failure here must never reach the step.
            try:
                box.append(self._take())
            except Exception:  # pragma: no cover - snapshot() reads plain counters
                logger.exception("metrics snapshot failed")
            done.set()

        sched.metrics_hook = publish
        if done.wait(self.step_wait_s):
            return box[0] if box else None
        # No step began: withdraw the request (a step that takes it meanwhile only wastes one
        # snapshot) and read between steps from here.
        if getattr(sched, "metrics_hook", None) is publish:
            sched.metrics_hook = None
        return None


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
        max_age_s: Reuse a snapshot for this long (seconds, ``>= 0``): scrapes closer together
            than this see the same figures.
        step_wait_s: With a scheduler, how long a scrape waits for the step thread to take the
            snapshot at its next step before reading it itself (seconds, ``>= 0``).
        tiers: With a tiered prefix cache, a callable returning its cumulative figures per tier
            (:meth:`pagedkv.tiers.TierCache.totals`): exported with a ``tier`` label.

    Register it with ``prometheus_client.REGISTRY.register(collector)`` or pass it to
    :func:`start_metrics_server`.

    Raises:
        MetricsUnavailableError: ``prometheus_client`` is not installed.
        InvalidArgumentError: ``manager`` has no ``stats()``, ``bytes_per_block`` is not a
            positive int, or a time is negative or not a number.
    """

    def __init__(self, manager: "BlockManager", scheduler: Optional["Scheduler"] = None, *,
                 bytes_per_block: Optional[int] = None,
                 labels: Optional[Dict[str, str]] = None, max_age_s: float = 0.1,
                 step_wait_s: float = 0.05,
                 tiers: Optional[Callable[[], Dict[str, Dict[str, Any]]]] = None) -> None:
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
        self._snapshots = _Snapshots(manager, scheduler, bytes_per_block,
                                     _seconds("max_age_s", max_age_s),
                                     _seconds("step_wait_s", step_wait_s), tiers)
        self._label_names = tuple(sorted(labels or {}))
        self._label_values = tuple(str((labels or {})[k]) for k in self._label_names)

    def _tier_metrics(self, t: Dict[str, Dict[str, Any]], names: List[str],
                      values: List[str]) -> Iterator[Any]:
        c = self._core
        for key, name, doc, kind in (
                ("hits", "pagedkv_prefix_cache_hits_by_tier_total",
                 "Prompt tokens served from each tier of the prefix cache.", "counter"),
                ("bytes_read", "pagedkv_tier_read_bytes_total",
                 "Bytes of KV served from each tier (host to GPU loads, lower tiers to host).",
                 "counter"),
                ("bytes_written", "pagedkv_tier_written_bytes_total",
                 "Bytes of KV written to each tier (GPU to host offloads, host to lower tiers).",
                 "counter"),
                ("usage", "pagedkv_tier_usage_bytes", "Bytes of KV each tier holds now.",
                 "gauge")):
            cls = c.CounterMetricFamily if kind == "counter" else c.GaugeMetricFamily
            m = cls(name, doc, labels=names + ["tier"])
            for tier, v in sorted(t.get(key, {}).items()):
                if v is not None:
                    m.add_metric(values + [tier], float(v))
            yield m

    def describe(self) -> List[Any]:
        # Returning nothing here makes the registry skip its collision check; describing by
        # collecting once would take a snapshot at registration, which is also fine but not needed.
        return []

    def collect(self) -> Iterator[Any]:
        c = self._core
        d = self._snapshots.get()
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
        if d.get("tiers"):
            yield from self._tier_metrics(d["tiers"], names, values)
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


def _seconds(what: str, value: Any, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum \
            or value == float("inf"):
        raise InvalidArgumentError(
            f"invalid argument: {what} = {value!r}: must be a finite number >= {minimum}",
            what=what, value=value, reason=f"must be a finite number >= {minimum}")
    return float(value)


def _count(what: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(
            f"invalid argument: {what} = {value!r}: must be an int >= {minimum}", what=what,
            value=value, reason=f"must be an int >= {minimum}")
    return value


#: Request line plus headers; a scraper sends a few hundred bytes.
_MAX_REQUEST_BYTES = 8192


class _Conn:
    __slots__ = ("sock", "deadline", "inbuf", "out")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline
        self.inbuf = b""  # the request so far; once complete, its head (waiting for its turn)
        self.out: Optional[memoryview] = None  # the response, once the request is answered


def _response(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8",
              head: bool = False) -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + (
                b"" if head else body)


class MetricsServer:
    """An HTTP endpoint for one registry, in one thread, with bounded sockets and time per client.

    The listening socket is bound by the constructor (so a busy port raises there); call
    :meth:`serve_forever` in a thread, then :meth:`shutdown` and :meth:`server_close` to stop.

    Args:
        registry: What ``GET /metrics`` renders (a ``prometheus_client`` registry or collector).
        addr: Address to listen on (default 127.0.0.1: local processes only).
        port: Port (0: a free one; read it back from :attr:`server_port`).
        max_connections: Most client sockets held at once; accepting one more closes the oldest.
        request_timeout_s: Time from accepting a connection to having answered it; a client
            that has not sent its whole request and read the answer by then is disconnected.
        max_requests_per_s: Most requests answered per second; complete requests beyond that
            wait their turn (within their deadline). A scrape loop then costs the process a
            bounded share of the interpreter, however fast it asks.
        max_age_s: Reuse a rendered answer for this long (seconds, ``>= 0``).

    Raises:
        InvalidArgumentError: ``max_connections`` is below 1, ``request_timeout_s`` or
            ``max_requests_per_s`` is not positive, or ``max_age_s`` is negative.
        OSError: The address cannot be bound.
    """

    def __init__(self, registry: Any, addr: str = "127.0.0.1", port: int = 0, *,
                 max_connections: int = 16, request_timeout_s: float = 2.0,
                 max_requests_per_s: float = 10.0, max_age_s: float = 0.1) -> None:
        from prometheus_client import exposition

        self.max_connections = _count("max_connections", max_connections, 1)
        self.request_timeout_s = _seconds("request_timeout_s", request_timeout_s, 1e-3)
        self._gap = 1.0 / _seconds("max_requests_per_s", max_requests_per_s, 1e-3)
        self.max_age_s = _seconds("max_age_s", max_age_s)
        self._rendered: Dict[str, Tuple[float, bytes]] = {}  # content type -> (when, body)
        self._ready: "collections.deque[_Conn]" = collections.deque()
        self._next_turn = 0.0
        self._registry = registry
        self._choose_encoder = exposition.choose_encoder
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.socket = socket.create_server((addr, port), family=family, backlog=128)
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()[:2]
        self.server_port: int = self.server_address[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._conns: Dict[socket.socket, _Conn] = {}  # in accept order: the first is the oldest
        #: Connections closed for running past the deadline / to stay under the cap.
        self.num_timed_out = 0
        self.num_evicted = 0

    # ------------------------------------------------------------------------------ loop

    def serve_forever(self) -> None:
        """Serves until :meth:`shutdown`; every socket it opened is closed when it returns."""
        sel = selectors.DefaultSelector()
        sel.register(self.socket, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                while self._ready and now >= self._next_turn:
                    conn = self._ready.popleft()
                    if conn.sock in self._conns:  # not closed while it waited
                        self._reply(sel, conn, self._handle(conn.inbuf))
                        self._next_turn = now + self._gap
                timeout = self.request_timeout_s
                if self._conns:
                    oldest = min(c.deadline for c in self._conns.values())
                    timeout = min(timeout, oldest - now)
                if self._ready:
                    timeout = min(timeout, self._next_turn - now)
                for key, mask in sel.select(max(0.0, timeout)):
                    sock = key.fileobj
                    if sock is self.socket:
                        self._accept(sel)
                    elif sock is self._wake_r:
                        try:
                            self._wake_r.recv(64)
                        except BlockingIOError:
                            pass
                    else:
                        conn = self._conns.get(sock)  # type: ignore[call-overload]
                        if conn is not None:
                            if mask & selectors.EVENT_READ:
                                self._read(sel, conn)
                            elif mask & selectors.EVENT_WRITE:
                                self._write(sel, conn)
                now = time.monotonic()
                for conn in [c for c in self._conns.values() if c.deadline <= now]:
                    self.num_timed_out += 1
                    self._close(sel, conn)
        finally:
            for conn in list(self._conns.values()):
                self._close(sel, conn)
            sel.close()
            self._stopped.set()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        # Drain the accept queue each time: a connection left in the kernel's backlog is one the
        # deadline cannot reach, and a full backlog would stall every new client.
        for _ in range(256):
            try:
                sock, _addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. the client reset the connection before it was accepted
                return
            while len(self._conns) >= self.max_connections:
                self.num_evicted += 1
                self._close(sel, next(iter(self._conns.values())))
            sock.setblocking(False)
            conn = _Conn(sock, time.monotonic() + self.request_timeout_s)
            self._conns[sock] = conn
            sel.register(sock, selectors.EVENT_READ, None)

    def _read(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(sel, conn)
            return
        conn.inbuf += data
        end = conn.inbuf.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.inbuf) > _MAX_REQUEST_BYTES:
                self._reply(sel, conn, _response("431 Request Header Fields Too Large",
                                                 b"request headers too large\n"))
            return
        # Complete: nothing more is read from it; it is answered in its turn.
        conn.inbuf = conn.inbuf[:end]
        sel.unregister(conn.sock)
        self._ready.append(conn)

    def _handle(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response("400 Bad Request", b"bad request line\n")
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return _response("405 Method Not Allowed", b"only GET and HEAD\n")
        if target.split("?", 1)[0] != "/metrics":
            return _response("404 Not Found", b"metrics are at /metrics\n")
        accept = ""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        try:
            encoder, content_type = self._choose_encoder(accept)
            now = time.monotonic()
            hit = self._rendered.get(content_type)
            if hit is not None and now - hit[0] < self.max_age_s:
                body = hit[1]
            else:
                body = encoder(self._registry)
                self._rendered[content_type] = (now, body)
        except Exception:
            logger.exception("metrics scrape failed")
            return _response("500 Internal Server Error", b"scrape failed\n")
        return _response("200 OK", body, content_type, head=method == "HEAD")

    def _reply(self, sel: selectors.BaseSelector, conn: _Conn, data: bytes) -> None:
        conn.out = memoryview(data)
        try:
            sel.modify(conn.sock, selectors.EVENT_WRITE, None)
        except KeyError:  # unregistered while it waited for its turn
            sel.register(conn.sock, selectors.EVENT_WRITE, None)
        self._write(sel, conn)

    def _write(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        out = conn.out
        assert out is not None
        try:
            n = conn.sock.send(out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(sel, conn)
            return
        conn.out = out[n:]
        if not len(conn.out):
            self._close(sel, conn)

    def _close(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        try:
            sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # ------------------------------------------------------------------------------ control

    @property
    def num_connections(self) -> int:
        """Client sockets open now."""
        return len(self._conns)

    def shutdown(self) -> None:
        """Stops :meth:`serve_forever` and waits (a few seconds at most) until it has returned."""
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._stopped.wait(5.0)

    def server_close(self) -> None:
        """Closes the listening socket (after :meth:`shutdown`)."""
        for s in (self.socket, self._wake_r, self._wake_w):
            s.close()

    def __repr__(self) -> str:
        return (f"MetricsServer(addr={self.server_address[0]!r}, port={self.server_port}, "
                f"max_connections={self.max_connections}, "
                f"request_timeout_s={self.request_timeout_s})")


def start_metrics_server(port: int, manager: "BlockManager",
                         scheduler: Optional["Scheduler"] = None, *, addr: str = "127.0.0.1",
                         bytes_per_block: Optional[int] = None, max_connections: int = 16,
                         request_timeout_s: float = 2.0, max_requests_per_s: float = 10.0
                         ) -> Tuple["MetricsServer", threading.Thread, Any]:
    """Serves ``manager``'s (and ``scheduler``'s) metrics at ``http://addr:port/metrics``.

    The server (:class:`MetricsServer`: one thread, at most ``max_connections`` client sockets,
    each answered or dropped within ``request_timeout_s``, at most ``max_requests_per_s``
    answers a second) runs in a daemon thread with a registry
    of its own (holding only this collector, so two servers in one process do not collide). Port 0
    picks a free port; read it back from ``server.server_port``.

    Returns:
        ``(server, thread, registry)``; stop with ``server.shutdown(); server.server_close()``.

    Raises:
        MetricsUnavailableError: ``prometheus_client`` is not installed.
        InvalidArgumentError: ``port`` is not an int in ``[0, 65535]``, ``max_connections`` is
            below 1, or ``request_timeout_s`` or ``max_requests_per_s`` is not positive.
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
    server = MetricsServer(registry, addr, port, max_connections=max_connections,
                           request_timeout_s=request_timeout_s,
                           max_requests_per_s=max_requests_per_s)
    thread = threading.Thread(target=server.serve_forever, name="pagedkv-metrics", daemon=True)
    thread.start()
    logger.info("metrics served at http://%s:%d/metrics", addr, server.server_port)
    return server, thread, registry
