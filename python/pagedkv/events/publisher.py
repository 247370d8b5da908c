"""Publishing KV events: collect a step's events, send them over ZeroMQ as vLLM does.

Owns :class:`EventSink` (one step's events, from the core's drain and from the lower tiers) and
:class:`ZmqEventPublisher` (a PUB socket, an optional ROUTER replay socket, and the thread that
owns both).

Wire protocol (vLLM 0.33's, ``docs/kv-events.md``):

* PUB sends one multipart message per batch: ``(topic, seq, payload)``, ``seq`` the batch's
  sequence number as 8 bytes big-endian (0, 1, 2, ... from the publisher's start; a consumer that
  sees it go backwards knows the publisher restarted), ``payload`` the msgpack
  :class:`~pagedkv.events.schema.KVEventBatch`;
* the replay socket (ROUTER) takes ``(b"", start_seq)`` from a DEALER and answers every buffered
  batch with ``seq >= start_seq`` as ``(b"", topic, seq, payload)``, then ``(b"", b"", -1, b"")``
  (``-1`` as 8 bytes big-endian signed). The buffer keeps the last ``buffer_steps`` batches;
  a replay covers the batches sent up to its request.

Invariants: the engine thread never blocks on the network: :meth:`ZmqEventPublisher.publish`
encodes nothing and only appends to a bounded queue; a full queue drops the batch and counts it
(:attr:`ZmqEventPublisher.dropped_batches`), and the sequence numbers stay dense (a dropped batch
takes none), so a consumer's gap check only sees what was lost on the network. Only the publisher
thread touches the sockets, and it never waits on a replay peer: live batches go first, replays
are sent a bounded slice per round without blocking (at most ``replay_hwm`` messages queued per
peer, ``max_replay_peers`` replays at once, a peer that reads nothing for ``replay_stall_s`` loses
its replay). ``endpoint`` follows vLLM's rule (bound when it names a wildcard host, ``*`` or
``::``, or is ``ipc://`` / ``inproc://``; connected otherwise); ``bind`` is always bound, so a
fixed port can listen on loopback only; the replay endpoint is always bound. Nothing is pickled.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from .schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode_batch,
    hash_to_wire,
)

__all__ = ["EventSink", "ZmqEventPublisher", "CoreEvent", "SPEC_KINDS", "group_specs", "END_SEQ", "DEFAULT_BUFFER_STEPS",
           "DEFAULT_HWM", "DEFAULT_MAX_QUEUE_SIZE", "DEFAULT_REPLAY_HWM", "DEFAULT_MAX_REPLAY_PEERS",
           "DEFAULT_REPLAY_STALL_S"]

logger = logging.getLogger("pagedkv.events")

#: vLLM's defaults (``KVEventsConfig``): batches kept for replay, PUB high-water mark, queue bound.
DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000
DEFAULT_MAX_QUEUE_SIZE = 100_000
#: Replay bounds: messages queued towards one peer, replays in progress, seconds a replay may
#: stall (a subscriber gives up on an answer after 2 s).
DEFAULT_REPLAY_HWM = 1_000
DEFAULT_MAX_REPLAY_PEERS = 32
DEFAULT_REPLAY_STALL_S = 2.0
#: Per round of the publisher thread: live batches sent, replay requests taken, replay messages
#: sent (shared among the peers). A live batch waits for one round's replay slice at most.
_LIVE_PER_ROUND = 1_024
_REQUESTS_PER_ROUND = 64
_REPLAY_PER_ROUND = 64
#: The replay stream's end marker: -1 as 8 bytes big-endian signed.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

#: What ``BlockManager.drain_kv_events()`` returns per event:
#: ``(kind, medium, block_hashes, parent_hash, token_ids, block_size, group)`` (the six-field
#: form without ``group`` is read as group 0).
CoreEvent = Union[Tuple[str, str, List[int], Optional[int], List[int], int],
                  Tuple[str, str, List[int], Optional[int], List[int], int, int]]

#: A KV cache group's attention kind as vLLM's ``KVCacheSpecKind`` spells it in
#: ``kv_cache_spec_kind`` (pagedkv's kinds: full, sliding, chunked).
SPEC_KINDS = {"full": "full_attention", "sliding": "sliding_window",
              "chunked": "chunked_local_attention"}


def group_specs(groups: Sequence[object]) -> List[Tuple[str, Optional[int]]]:
    """``(kv_cache_spec_kind, kv_cache_spec_sliding_window)`` per KV cache group, from a
    manager's ``groups`` (:class:`~pagedkv.KVCacheGroup` objects or the core's ``(kind, size)``
    tuples): the window for a sliding group, None otherwise (vLLM carries no chunk size).

    Raises:
        InvalidArgumentError: A group of an unknown kind.
    """
    out: List[Tuple[str, Optional[int]]] = []
    for g in groups:
        kind, size = ((getattr(g, "kind"), getattr(g, "size")) if hasattr(g, "kind")
                      else tuple(g))  # type: ignore[call-overload]
        spec = SPEC_KINDS.get(kind)
        if spec is None:
            raise _bad("groups", kind, f"a KV cache group's kind must be one of "
                       f"{', '.join(SPEC_KINDS)}")
        out.append((spec, int(size) if kind == "sliding" else None))
    return out

_KINDS = ("stored", "removed", "cleared")


def _bad(what: str, value: object, reason: str) -> Exception:
    from ..errors import InvalidArgumentError

    return InvalidArgumentError(f"invalid argument: {what} = {value!r}: {reason}", what=what,
                                value=value, reason=reason)


def _check_group(group_idx: Optional[int]) -> None:
    if group_idx is not None and (isinstance(group_idx, bool) or not isinstance(group_idx, int)
                                  or group_idx < 0):
        raise _bad("group_idx", group_idx, "must be None or an int >= 0")


def is_bind_endpoint(endpoint: str) -> bool:
    """Whether a publisher binds ``endpoint`` (wildcard host, ipc, inproc) or connects to it."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventSink:
    """The events of one step, in order, as wire structs; :meth:`take` empties it.

    The engine feeds it the core's drained tuples (:meth:`add_core`); a lower tier (a disk or
    Redis store, ``medium="STORAGE"``, ``locality`` ``"LOCAL"`` or ``"REMOTE"``) calls
    :meth:`add_stored` / :meth:`add_removed` from Python. Hashes are the 128-bit ints of
    ``docs/prefix-hash.md``; they become 16 big-endian bytes here. Thread-safe (a lock), so a tier's
    own thread may add events while the engine thread takes them.

    Args:
        groups: The manager's KV cache groups (as :func:`group_specs` reads them) when it has
            more than one: the core's events then carry vLLM's ``group_idx`` (stored and
            removed) and ``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window`` (stored).
            None (a one-group manager): those fields stay unset, the bytes exactly as without
            groups.
    """

    def __init__(self, groups: Optional[Sequence[object]] = None) -> None:
        self._events: List[KVEvent] = []
        self._lock = threading.Lock()
        self._specs = None if groups is None else group_specs(groups)

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    def add_stored(self, block_hashes: Sequence[int], parent_hash: Optional[int],
                   token_ids: Sequence[int], block_size: int, *, medium: str = "GPU",
                   locality: Optional[str] = None, group_idx: Optional[int] = None,
                   kv_cache_spec_kind: Optional[str] = None,
                   kv_cache_spec_sliding_window: Optional[int] = None) -> None:
        """Blocks ``block_hashes`` (chain order, after ``parent_hash``) now hold ``token_ids``;
        with ``group_idx``, they are that KV cache group's blocks (of the given spec kind and
        sliding window).

        Raises:
            InvalidArgumentError: A hash is not a 128-bit unsigned int, ``block_size`` is not
                positive, ``token_ids`` is not ``len(block_hashes) * block_size`` long, or
                ``group_idx`` is not None or an int >= 0.
        """
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise _bad("block_size", block_size, "must be an int >= 1")
        _check_group(group_idx)
        hashes = [hash_to_wire(h) for h in block_hashes]
        tokens = [int(t) for t in token_ids]
        if len(tokens) != len(hashes) * block_size:
            raise _bad("token_ids", len(tokens),
                       f"must hold len(block_hashes) * block_size = {len(hashes) * block_size} "
                       f"tokens")
        parent = None if parent_hash is None else hash_to_wire(parent_hash)
        event = BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                            block_size=block_size, lora_id=None, medium=medium, lora_name=None,
                            group_idx=group_idx, kv_cache_spec_kind=kv_cache_spec_kind,
                            kv_cache_spec_sliding_window=kv_cache_spec_sliding_window,
                            locality=locality)
        with self._lock:
            self._events.append(event)

    def add_removed(self, block_hashes: Sequence[int], *, medium: str = "GPU",
                    locality: Optional[str] = None, group_idx: Optional[int] = None) -> None:
        """Blocks ``block_hashes`` (of KV cache group ``group_idx``, when given) left tier
        ``medium``.

        Raises:
            InvalidArgumentError: A hash is not a 128-bit unsigned int, or ``group_idx`` is not
                None or an int >= 0.
        """
        _check_group(group_idx)
        event = BlockRemoved(block_hashes=[hash_to_wire(h) for h in block_hashes],
                             medium=medium, group_idx=group_idx, locality=locality)
        with self._lock:
            self._events.append(event)

    def add_cleared(self) -> None:
        """Every block of every tier was dropped."""
        with self._lock:
            self._events.append(AllBlocksCleared())

    def add_core(self, events: Iterable[CoreEvent]) -> None:
        """The tuples ``BlockManager.drain_kv_events()`` returned, in order. The core's tiers (GPU,
        CPU) carry no ``locality``, as vLLM's own device-tier events. With ``groups`` given to
        the sink, each stored / removed event names its group (and a stored one the group's
        spec); without, a group other than 0 is still named by ``group_idx`` alone.

        Raises:
            InvalidArgumentError: An event's kind is not ``stored`` / ``removed`` / ``cleared``,
                its group is not one of the sink's ``groups``, or its fields are out of range
                (see :meth:`add_stored`); events before it stay.
        """
        specs = self._specs
        for event in events:
            kind, medium, hashes, parent, tokens, block_size = event[:6]
            group = event[6] if len(event) > 6 else 0  # type: ignore[misc]
            idx: Optional[int] = None
            spec: Tuple[Optional[str], Optional[int]] = (None, None)
            if specs is not None:
                if not 0 <= group < len(specs):
                    raise _bad("group", group, f"the manager has {len(specs)} KV cache groups")
                idx, spec = group, specs[group]
            elif group:
                idx = group
            if kind == "stored":
                self.add_stored(hashes, parent, tokens, block_size, medium=medium, group_idx=idx,
                                kv_cache_spec_kind=spec[0],
                                kv_cache_spec_sliding_window=spec[1])
            elif kind == "removed":
                self.add_removed(hashes, medium=medium, group_idx=idx)
            elif kind == "cleared":
                self.add_cleared()
            else:
                raise _bad("kind", kind, f"must be one of {', '.join(_KINDS)}")

    def take(self) -> List[KVEvent]:
        """Every event added since the last call, in order; the sink is then empty."""
        with self._lock:
            events, self._events = self._events, []
        return events


class _Replay:
    """One peer's replay in progress: the next batch to send, the last to send, when it last
    moved."""

    __slots__ = ("next_seq", "end_seq", "progress")

    def __init__(self, next_seq: int, end_seq: int, now: float) -> None:
        self.next_seq = next_seq
        self.end_seq = end_seq
        self.progress = now


class ZmqEventPublisher:
    """Sends :class:`KVEventBatch` es on a PUB socket, keeps the last ones for replay.

    Args:
        endpoint: The PUB endpoint, vLLM's rule (``tcp://*:5557`` binds, ``tcp://host:5557``
            connects; a ``tcp://HOST:*`` wildcard port binds a free one, read back from
            :attr:`endpoint`), or None with ``bind``.
        replay_endpoint: The ROUTER endpoint replay requests come to (bound), or None.
        topic: The first frame of every message (subscribers filter on its prefix).
        buffer_steps: Batches kept for replay.
        hwm: The PUB socket's send high-water mark (messages ZeroMQ queues per subscriber before
            it drops for that subscriber).
        max_queue_size: Batches waiting for the thread before :meth:`publish` drops.
        data_parallel_rank: Written into batches that carry none.
        bind: An endpoint the PUB socket always binds, whatever its host
            (``tcp://127.0.0.1:5557``: listen on loopback only); with or instead of ``endpoint``.
        replay_hwm: Replay messages queued towards one peer at most (the ROUTER's high-water
            mark); a peer that reads slower waits, one that reads nothing for ``replay_stall_s``
            loses its replay (it then counts the batches as lost).
        max_replay_peers: Replays in progress at once; a request beyond gets only the end marker
            (an empty answer) at once.
        replay_stall_s: Seconds a replay may make no progress before it is dropped.

    Raises:
        InvalidArgumentError: A size is not a positive int, or an endpoint is malformed or taken
            (ZeroMQ's message is kept).
    """

    def __init__(self, endpoint: Optional[str], replay_endpoint: Optional[str] = None, *,
                 topic: str = "", buffer_steps: int = DEFAULT_BUFFER_STEPS, hwm: int = DEFAULT_HWM,
                 max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE, data_parallel_rank: int = 0,
                 bind: Optional[str] = None, replay_hwm: int = DEFAULT_REPLAY_HWM,
                 max_replay_peers: int = DEFAULT_MAX_REPLAY_PEERS,
                 replay_stall_s: float = DEFAULT_REPLAY_STALL_S) -> None:
        import zmq

        for name, value in (("buffer_steps", buffer_steps), ("hwm", hwm),
                            ("max_queue_size", max_queue_size), ("replay_hwm", replay_hwm),
                            ("max_replay_peers", max_replay_peers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _bad(name, value, "must be an int >= 1")
        if (isinstance(replay_stall_s, bool) or not isinstance(replay_stall_s, (int, float))
                or not 0 < replay_stall_s < float("inf")):
            raise _bad("replay_stall_s", replay_stall_s, "must be a positive number of seconds")
        if not isinstance(topic, str):
            raise _bad("topic", topic, "must be a string")
        if endpoint is None and bind is None:
            raise _bad("endpoint", None, "an endpoint or a bind endpoint is needed")
        for name, value in (("endpoint", endpoint), ("bind", bind)):
            if value is not None and not (isinstance(value, str) and "://" in value):
                raise _bad(name, value, "must be a ZeroMQ endpoint such as 'tcp://127.0.0.1:5557'")
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: Optional[zmq.Socket[bytes]] = None
        failing: Optional[str] = bind
        try:
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if bind is not None:
                self._pub.bind(bind)
                bind = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            failing = endpoint
            if endpoint is not None:
                if is_bind_endpoint(endpoint):
                    self._pub.bind(endpoint)
                    endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
                else:
                    self._pub.connect(endpoint)
            if replay_endpoint is not None:
                failing = replay_endpoint
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # A full peer (or one gone) answers EAGAIN / EHOSTUNREACH instead of dropping
                # silently: the thread then moves on to others, and to live batches.
                self._replay.setsockopt(zmq.SNDHWM, replay_hwm)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._replay.bind(replay_endpoint)
                replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            what = "bind" if failing is not None and failing == bind else "endpoint"
            raise _bad(what, failing, f"ZeroMQ refused it: {exc}") from None
        #: The PUB endpoint (the bind endpoint when only ``bind`` was given), with the port a
        #: wildcard bind chose.
        self.endpoint: str = endpoint if endpoint is not None else bind  # type: ignore[assignment]
        #: The endpoint bound through ``bind`` (None without), with the port a wildcard chose.
        self.bind: Optional[str] = bind
        #: The replay endpoint, with the port a wildcard bind chose (None without replay).
        self.replay_endpoint: Optional[str] = replay_endpoint
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._queue: "queue.Queue[Optional[KVEventBatch]]" = queue.Queue(maxsize=max_queue_size)
        # The replay buffer: a ring, slot seq % buffer_steps holds batch seq (O(1) by seq).
        self._ring: List[Optional[bytes]] = [None] * buffer_steps
        self._buffer_steps = buffer_steps
        self._replays: Dict[bytes, _Replay] = {}
        self._max_replay_peers = max_replay_peers
        self._replay_stall_s = float(replay_stall_s)
        self._next_seq = 0
        self._dropped = 0
        self._sent = 0
        #: Replay messages sent, replays dropped for a stalled or vanished peer, requests
        #: answered empty because ``max_replay_peers`` replays were in progress.
        self.replay_messages_sent = 0
        self.replays_aborted = 0
        self.replays_refused = 0
        self._queued = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()
    @property
    def dropped_batches(self) -> int:
        """Batches :meth:`publish` dropped because the queue was full."""
        return self._dropped

    @property
    def sent_batches(self) -> int:
        """Batches the thread has sent (the next batch's sequence number)."""
        return self._sent

    @property
    def queued_batches(self) -> int:
        """Batches :meth:`publish` accepted: once :attr:`sent_batches` reaches it, every batch
        published so far is on the wire (the thread sends them in order)."""
        return self._queued

    def publish(self, batch: KVEventBatch) -> bool:
        """Queues ``batch`` for sending; never blocks. Returns False (and counts it) when the
        queue is full or the publisher is closed."""
        if self._closed:
            self._dropped += 1
            return False
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._dropped += 1
            return False
        self._queued += 1
        return True

    def publish_events(self, events: List[KVEvent]) -> bool:
        """:meth:`publish` of one batch holding ``events``, stamped now; nothing for no events."""
        if not events:
            return True
        return self.publish(KVEventBatch(ts=time.time(), events=events))

    def close(self, timeout: float = 1.0) -> None:
        """Sends what is queued (for up to ``timeout`` seconds), stops the thread, closes the
        sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def __enter__(self) -> "ZmqEventPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------ the thread

    def _run(self) -> None:
        """Live batches first: each round sends every queued batch (up to a bound), then takes
        new replay requests, then sends a bounded slice of the replays in progress; the thread
        never waits on a replay peer (non-blocking sends, a peer that is full is skipped)."""
        while True:
            busy = False
            for _ in range(_LIVE_PER_ROUND):
                try:
                    batch = self._queue.get_nowait()
                except queue.Empty:
                    break
                if batch is None:
                    return
                self._send_live(batch)
                busy = True
            if self._replay is not None:
                try:
                    busy = self._accept_replays() or busy
                    busy = self._replay_round() or busy
                except Exception:  # a malformed request must not stop publishing
                    logger.exception("kv events: serving a replay failed")
            if busy:
                continue
            try:
                batch = self._queue.get(timeout=0.005 if self._replays else 0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            self._send_live(batch)

    def _send_live(self, batch: KVEventBatch) -> None:
        try:
            payload = encode_batch(batch)
            seq = self._next_seq.to_bytes(8, "big", signed=True)
            self._pub.send_multipart((self._topic, seq, payload))
            self._ring[self._next_seq % self._buffer_steps] = payload
            self._next_seq += 1
            self._sent += 1
        except Exception:
            logger.exception("kv events: publishing a batch failed")
            time.sleep(0.05)

    def _accept_replays(self) -> bool:
        assert self._replay is not None
        accepted = 0
        while accepted < _REQUESTS_PER_ROUND and self._replay.poll(0):
            accepted += 1
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("kv events: ignoring a malformed replay request (%d frames)",
                               len(frames))
                continue
            client, _, start = frames
            start_seq = max(int.from_bytes(start, "big", signed=True),
                            self._next_seq - self._buffer_steps, 0)
            if client not in self._replays and len(self._replays) >= self._max_replay_peers:
                self.replays_refused += 1
                self._send_replay(client, (b"", END_SEQ, b""))
                continue
            # One replay per peer: a new request replaces the one in progress.
            self._replays[client] = _Replay(start_seq, self._next_seq - 1, time.monotonic())
        return accepted > 0

    def _send_replay(self, client: bytes, frames: Tuple[bytes, bytes, bytes]) -> Optional[bool]:
        """Sends one replay message without blocking: True sent, False the peer is full (try
        later), None the peer is gone."""
        import zmq

        assert self._replay is not None
        try:
            self._replay.send_multipart((client, b"") + frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError:  # EHOSTUNREACH: the peer disconnected
            return None
        self.replay_messages_sent += 1
        return True

    def _replay_round(self) -> bool:
        """Sends up to ``_REPLAY_PER_ROUND`` replay messages, shared among the peers."""
        if not self._replays:
            return False
        now = time.monotonic()
        share = max(1, _REPLAY_PER_ROUND // len(self._replays))
        busy = False
        for client, rep in list(self._replays.items()):
            for _ in range(share):
                done = rep.next_seq > rep.end_seq
                if done:
                    sent = self._send_replay(client, (b"", END_SEQ, b""))
                elif rep.next_seq < self._next_seq - self._buffer_steps:
                    sent = None  # the ring moved past it: this replay cannot finish
                else:
                    payload = self._ring[rep.next_seq % self._buffer_steps]
                    assert payload is not None
                    sent = self._send_replay(
                        client, (self._topic, rep.next_seq.to_bytes(8, "big", signed=True),
                                 payload))
                if sent is False:
                    if now - rep.progress > self._replay_stall_s:
                        logger.warning("kv events: a replay peer read nothing for %.1f s; "
                                       "dropping its replay", self._replay_stall_s)
                        self.replays_aborted += 1
                        del self._replays[client]
                    break
                if sent is None or done:
                    self.replays_aborted += sent is None and not done
                    del self._replays[client]
                    break
                rep.next_seq += 1
                rep.progress = now
                busy = True
        return busy
