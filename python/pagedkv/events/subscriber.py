"""Consuming KV events: one publisher's stream, in order, with gaps replayed and restarts seen.

Owns :class:`SequenceTracker` (the ordering rules, no I/O) and :class:`EventSubscriber` (a SUB
socket, a DEALER for replay requests, and the thread that reads them and calls the handlers).

Rules (``docs/kv-events.md``, "Consuming"):

* batches are applied in sequence order, each once: a live batch already applied through a replay
  is skipped;
* a live batch whose sequence number is past the next one expected means batches were lost (the
  PUB socket drops at its high-water mark, or the subscriber joined late): the missing range is
  asked of the replay socket, and what comes back is applied first;
* a live sequence number at or below the previous live one means the publisher restarted (its
  count starts again at 0): everything known of it is dropped (``on_reset``) and its stream is
  taken from its start (a replay from 0 fetches what the new process sent before this batch);
* after the connection dropped (a ZeroMQ disconnect), a restart may not show in the numbers (the
  new process may already be past them), so the first batch after it is checked: the replay
  socket is asked for the last batch applied, and unless it returns the same bytes the publisher
  is taken as restarted (without a replay socket, always);
* when batches are lost for good (no replay socket, no answer, or the replay buffer no longer
  holds them) after something was applied, the index may hold blocks whose removal was missed, so
  it is dropped too (``on_reset``) rather than kept stale; a consumer that joins late only misses
  what was cached before it came.

The handlers run on the subscriber's thread; they must be quick and thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

from .publisher import END_SEQ
from .schema import KVEventBatch, decode_batch

__all__ = ["SequenceTracker", "EventSubscriber", "Replay", "DEFAULT_MAX_REPLAY_BYTES",
           "DEFAULT_MAX_REPLAY_BATCHES"]

logger = logging.getLogger("pagedkv.events")

#: Fetches the buffered batches from a sequence number on: ``[(seq, payload), ...]`` in order, or
#: None when no replay is possible (no socket, no answer in time).
Replay = Callable[[int], Optional[List[Tuple[int, bytes]]]]

#: The most one replay answer may hold (payload bytes, batches): an answer past either is
#: abandoned (counted as unanswered), so a publisher that answers without end cannot make the
#: consumer hold more. The batch bound is twice vLLM's ``buffer_steps``.
DEFAULT_MAX_REPLAY_BYTES = 64 << 20
DEFAULT_MAX_REPLAY_BATCHES = 20_000


class SequenceTracker:
    """Orders one publisher's batches (the rules of the module doc); no sockets.

    ``apply(seq, payload)`` is called for each batch to apply, in order; ``reset()`` when what
    was applied must be forgotten; ``replay(start)`` fetches missed batches.
    """

    def __init__(self, apply: Callable[[int, bytes], None], reset: Callable[[], None],
                 replay: Optional[Replay] = None) -> None:
        self._apply = apply
        self._reset = reset
        self._replay = replay
        #: The last sequence number applied (None: nothing yet, or since the last reset).
        self.applied: Optional[int] = None
        #: The last sequence number seen on the live stream.
        self.live: Optional[int] = None
        #: Counters: batches applied, replays asked, restarts seen, resets for lost batches.
        self.applied_batches = 0
        self.replays = 0
        self.restarts = 0
        self.lost_resets = 0
        self._last_payload: Optional[bytes] = None
        self._suspect = False

    def on_disconnect(self) -> None:
        """The connection to the publisher dropped: check continuity at the next batch."""
        self._suspect = True

    def resync(self) -> None:
        """Forgets the publisher (it may have restarted unseen, e.g. it was down): drops what was
        applied and takes the stream from its start (a replay from 0 at the next batch)."""
        self._reset()
        self.applied = None
        self.live = None

    def on_live(self, seq: int, payload: bytes) -> None:
        """One batch from the live stream."""
        if self._suspect:
            self._suspect = False
            if self.applied is not None and not self._same_publisher():
                self.restarts += 1
                self._reset()
                self.applied = None
                self.live = None
        if self.live is not None and seq <= self.live:
            self.restarts += 1
            self._reset()
            self.applied = None
        self.live = seq
        if self.applied is not None and seq <= self.applied:
            return  # already applied through a replay
        expected = 0 if self.applied is None else self.applied + 1
        if seq > expected:
            self._fill(expected, seq)
        if self.applied is None or seq > self.applied:
            self._apply_one(seq, payload)

    def _same_publisher(self) -> bool:
        assert self.applied is not None
        got = self._replay(self.applied) if self._replay is not None else None
        return bool(got) and got[0] == (self.applied, self._last_payload)  # type: ignore[index]

    def _fill(self, start: int, live_seq: int) -> None:
        got = self._replay(start) if self._replay is not None else None
        self.replays += self._replay is not None
        covered = bool(got) and got[0][0] <= start
        if not covered and self.applied is not None:
            self.lost_resets += 1
            logger.warning("kv events: batches %d..%d lost for good; dropping the index of this "
                           "publisher", start, live_seq - 1)
            self._reset()
            self.applied = None
        for seq, payload in got or ():
            if seq >= start and (self.applied is None or seq > self.applied):
                if self.applied is not None and seq != self.applied + 1:
                    # A hole inside the answer: what follows it cannot be applied in order.
                    self.lost_resets += 1
                    self._reset()
                    self.applied = None
                    break
                self._apply_one(seq, payload)

    def _apply_one(self, seq: int, payload: bytes) -> None:
        self.applied = seq
        self._last_payload = payload
        self.applied_batches += 1
        self._apply(seq, payload)


class EventSubscriber:
    """Reads one publisher's KV events on a thread and hands decoded batches to ``on_batch``.

    Args:
        endpoint: The publisher's PUB endpoint (connected; a wildcard-host endpoint is bound, so a
            publisher that connects can reach this subscriber).
        replay_endpoint: The publisher's replay endpoint, or None (gaps are then lost).
        on_batch: Called with each batch, in sequence order, once.
        on_reset: Called when everything applied so far must be forgotten (restart, lost batches,
            :meth:`resync`).
        topic: Prefix of the topics to receive ("" for all).
        replay_timeout_s: How long a replay may take before it counts as unanswered.
        max_replay_bytes, max_replay_batches: The most one replay answer may hold; a longer one
            counts as unanswered.
    """

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None, *,
                 on_batch: Callable[[KVEventBatch], None], on_reset: Callable[[], None],
                 topic: str = "", replay_timeout_s: float = 2.0,
                 max_replay_bytes: int = DEFAULT_MAX_REPLAY_BYTES,
                 max_replay_batches: int = DEFAULT_MAX_REPLAY_BATCHES) -> None:
        import zmq

        from .publisher import is_bind_endpoint

        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        if is_bind_endpoint(endpoint):
            self._sub.bind(endpoint)
            endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._sub.connect(endpoint)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._on_batch = on_batch
        self._timeout_ms = int(replay_timeout_s * 1000)
        self._max_replay_bytes = max_replay_bytes
        self._max_replay_batches = max_replay_batches
        #: Replay answers abandoned for exceeding a bound.
        self.oversized_replays = 0
        self._dealer: Optional["zmq.Socket[bytes]"] = None
        self._resync = threading.Event()
        self._stop = threading.Event()
        #: Payloads that did not decode (logged and skipped).
        self.bad_payloads = 0
        self.tracker = SequenceTracker(self._apply, on_reset,
                                       self._request_replay if replay_endpoint else None)
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-sub", daemon=True)
        self._thread.start()

    def resync(self) -> None:
        """Asks the thread to forget the publisher and take its stream from the start (see
        :meth:`SequenceTracker.resync`); safe from any thread."""
        self._resync.set()

    def close(self) -> None:
        """Stops the thread and closes the sockets. Idempotent."""
        self._stop.set()
        self._thread.join(2.0)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except ValueError as exc:
            self.bad_payloads += 1
            logger.warning("kv events: batch %d from %s does not decode: %s", seq, self.endpoint,
                           exc)
            return
        self._on_batch(batch)

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(50))
                # After the poll: a batch that arrived after resync() was asked is applied after
                # the resync, never wiped by it.
                if self._resync.is_set():
                    self._resync.clear()
                    self.tracker.resync()
                if self._monitor in ready:
                    self._monitor.recv_multipart()
                    self.tracker.on_disconnect()
                if self._sub not in ready:
                    continue
                frames = self._sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.bad_payloads += 1
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                try:
                    self.tracker.on_live(seq, frames[2])
                except Exception:  # a handler's bug must not end the stream
                    logger.exception("kv events: handling batch %d from %s failed", seq,
                                     self.endpoint)
        finally:
            self._sub.disable_monitor()
            self._monitor.close(linger=0)
            self._sub.close(linger=0)
            if self._dealer is not None:
                self._dealer.close(linger=0)
            del zmq

    def _request_replay(self, start: int) -> Optional[List[Tuple[int, bytes]]]:
        zmq = self._zmq
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self.replay_endpoint)  # type: ignore[arg-type]
        self._dealer.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
        out: List[Tuple[int, bytes]] = []
        held = 0
        # The whole replay is bounded, not each message: a peer that keeps sending (anything but
        # the end marker) must not hold this thread, nor make ``out`` grow, for ever.
        deadline = time.monotonic() + self._timeout_ms / 1000
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._dealer.poll(left_ms):
                # No answer: a late one must not be read as the next request's, so start afresh.
                self._dealer.close(linger=0)
                self._dealer = None
                return None
            frames: Sequence[bytes] = self._dealer.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                continue  # malformed (the live stream's rule): a seq is 8 bytes
            _, _topic, seq_bytes, payload = frames
            if seq_bytes == END_SEQ:
                return out
            out.append((int.from_bytes(seq_bytes, "big", signed=True), payload))
            held += len(payload)
            if held > self._max_replay_bytes or len(out) > self._max_replay_batches:
                self.oversized_replays += 1
                logger.warning("kv events: a replay answer from %s passed %d bytes or %d "
                               "batches; abandoned", self.replay_endpoint,
                               self._max_replay_bytes, self._max_replay_batches)
                self._dealer.close(linger=0)
                self._dealer = None
                return None
