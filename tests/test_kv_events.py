"""KV events on the wire: the publisher's frames, replay, the subscriber's ordering rules.

Real ZeroMQ sockets on loopback (wildcard ports), synthetic events in the core's tuple shape.
Waits are bounded polls, never timed assertions.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from pagedkv.errors import InvalidArgumentError  # noqa: E402
from pagedkv.events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSink,
    EventSubscriber,
    KVEventBatch,
    SequenceTracker,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
    hash_from_wire,
)
from pagedkv.events.publisher import END_SEQ  # noqa: E402
from polling import wait_for  # noqa: E402


def stored(h: int) -> KVEventBatch:
    sink = EventSink()
    sink.add_stored([h], None, [1, 2], 2)
    return KVEventBatch(ts=0.0, events=sink.take())


def test_sink_converts_core_tuples_in_order() -> None:
    sink = EventSink()
    sink.add_core([("stored", "GPU", [2**128 - 1, 5], None, [1, 2, 3, 4], 2),
                   ("removed", "CPU", [5], None, [], 2), ("cleared", "GPU", [], None, [], 2)])
    sink.add_stored([9], 5, [7, 7], 2, medium="STORAGE", locality="REMOTE")
    events = sink.take()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved, AllBlocksCleared, BlockStored]
    assert [hash_from_wire(h) for h in events[0].block_hashes] == [2**128 - 1, 5]
    assert events[0].block_hashes[0] == b"\xff" * 16 and events[0].medium == "GPU"
    assert events[1].medium == "CPU"
    assert events[3].medium == "STORAGE" and events[3].locality == "REMOTE"
    assert hash_from_wire(events[3].parent_block_hash) == 5
    assert sink.take() == [] and len(sink) == 0
    batch = decode_batch(encode_batch(KVEventBatch(ts=1.0, events=events)))
    assert batch.events == events


@pytest.mark.parametrize("call, what", [
    (lambda s: s.add_stored([2**128], None, [1], 1), "block_hash"),
    (lambda s: s.add_stored([-1], None, [1], 1), "block_hash"),
    (lambda s: s.add_stored([1], None, [1, 2, 3], 2), "token_ids"),
    (lambda s: s.add_stored([1], None, [1], 0), "block_size"),
    (lambda s: s.add_removed([True]), "block_hash"),
    (lambda s: s.add_core([("moved", "GPU", [1], None, [], 1)]), "kind"),
    (lambda s: s.add_removed([1], group_idx=-1), "group_idx"),
    (lambda s: s.add_stored([1], None, [1], 1, group_idx=True), "group_idx"),
])
def test_sink_refuses_bad_events(call: Callable[[EventSink], None], what: str) -> None:
    sink = EventSink()
    sink.add_cleared()
    with pytest.raises(InvalidArgumentError) as err:
        call(sink)
    assert err.value.fields["what"] == what
    assert len(sink) == 1  # what was there stays


def test_sink_names_groups_only_for_a_grouped_manager() -> None:
    """With the manager's groups, core events carry vLLM's group fields (the spec on stores);
    without (one group), the bytes are exactly the ungrouped ones, whatever the tuple's length."""
    from pagedkv import KVCacheGroup

    core = [("stored", "GPU", [7, 8], None, [1, 2, 3, 4], 2, 0),
            ("stored", "GPU", [7], None, [1, 2], 2, 1),
            ("stored", "GPU", [8], 7, [3, 4], 2, 2),
            ("removed", "GPU", [7], None, [], 2, 1),
            ("cleared", "GPU", [], None, [], 2, 0)]
    sink = EventSink([KVCacheGroup.full(), KVCacheGroup.sliding(512), ("chunked", 64)])
    sink.add_core(core)
    ev = sink.take()
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
            for e in ev[:3]] == [(0, "full_attention", None), (1, "sliding_window", 512),
                                 (2, "chunked_local_attention", None)]
    assert isinstance(ev[3], BlockRemoved) and ev[3].group_idx == 1
    assert isinstance(ev[4], AllBlocksCleared)
    wire = decode_batch(encode_batch(KVEventBatch(ts=0.0, events=ev))).events
    assert wire == ev
    # One group: the seven-field tuples encode as the six-field ones always did.
    plain, seven = EventSink(), EventSink()
    plain.add_core([c[:6] for c in core[:1]] + [core[3][:6]])
    seven.add_core([core[0], ("removed", "GPU", [7], None, [], 2, 0)])
    a, b = plain.take(), seven.take()
    assert encode_batch(KVEventBatch(ts=0.0, events=a)) == encode_batch(
        KVEventBatch(ts=0.0, events=b))
    assert a[0].group_idx is None and b"group_idx" not in encode_batch(
        KVEventBatch(ts=0.0, events=b))
    # A group the manager does not have is refused; what came before stays.
    sink = EventSink([KVCacheGroup.full(), KVCacheGroup.sliding(8)])
    with pytest.raises(InvalidArgumentError) as err:
        sink.add_core([core[0], ("removed", "GPU", [7], None, [], 2, 2)])
    assert err.value.fields["what"] == "group" and len(sink) == 1


def test_decode_refuses_garbage() -> None:
    with pytest.raises(InvalidArgumentError):
        decode_batch(b"\x93\x01")
    with pytest.raises(InvalidArgumentError):
        decode_batch(b"\x92\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x91\x81\xa4type\xa4Nope")


def test_publisher_frames_and_replay() -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv") as pub:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(pub.endpoint)
        time.sleep(0.2)  # a SUB only receives after its subscription reached the PUB
        for h in (10, 11, 12):
            assert pub.publish(stored(h))
        frames = [sub.recv_multipart() for _ in range(3)]
        sub.close()
        assert [f[0] for f in frames] == [b"kv"] * 3
        assert [int.from_bytes(f[1], "big", signed=True) for f in frames] == [0, 1, 2]
        assert [len(f[1]) for f in frames] == [8] * 3
        assert decode_batch(frames[2][2]).data_parallel_rank == 0

        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        replies = []
        while True:
            assert dealer.poll(5000)
            reply = dealer.recv_multipart()
            replies.append(reply)
            if reply[2] == END_SEQ:
                break
        dealer.close()
        assert [r[0] for r in replies] == [b""] * 3
        assert [(r[1], int.from_bytes(r[2], "big", signed=True)) for r in replies[:2]] == \
            [(b"kv", 1), (b"kv", 2)]
        assert replies[0][3] == frames[1][2]
        assert replies[2] == [b"", b"", END_SEQ, b""]
        assert pub.sent_batches == 3 and pub.dropped_batches == 0


def test_full_queue_drops_and_counts_without_blocking() -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", max_queue_size=1)
    # Stop the thread taking from the queue: the queue then fills.
    pub._queue.put(None)
    pub._thread.join(5)
    assert pub.publish(stored(1))
    assert not pub.publish(stored(2))
    assert not pub.publish(stored(3))
    assert pub.dropped_batches == 2
    pub._closed = True
    pub._close_sockets()


def test_publisher_refuses_bad_settings() -> None:
    with pytest.raises(InvalidArgumentError):
        ZmqEventPublisher("tcp://127.0.0.1:*", buffer_steps=0)
    with pytest.raises(InvalidArgumentError) as err:
        ZmqEventPublisher("bogus://x")
    assert err.value.fields["what"] == "endpoint"


class Recorder:
    def __init__(self, replay: Optional[List[Tuple[int, bytes]]] = None) -> None:
        self.applied: List[int] = []
        self.resets = 0
        self.replay_from: List[int] = []
        self.buffer = replay

    def tracker(self, with_replay: bool = True) -> SequenceTracker:
        return SequenceTracker(lambda seq, _p: self.applied.append(seq), self._reset,
                               self._replay if with_replay else None)

    def _reset(self) -> None:
        self.resets += 1
        self.applied.clear()

    def _replay(self, start: int) -> Optional[List[Tuple[int, bytes]]]:
        self.replay_from.append(start)
        if self.buffer is None:
            return None
        return [(s, p) for s, p in self.buffer if s >= start]


def test_tracker_replays_a_gap_and_skips_duplicates() -> None:
    rec = Recorder(replay=[(s, b"") for s in range(10)])
    t = rec.tracker()
    t.on_live(0, b"")
    t.on_live(1, b"")
    t.on_live(4, b"")  # 2, 3 lost
    assert rec.replay_from == [2]
    # The replay returned up to 9: the live 5..9 that follow are duplicates.
    for s in range(5, 10):
        t.on_live(s, b"")
    t.on_live(10, b"")
    assert rec.applied == list(range(11)) and rec.resets == 0


def test_tracker_resets_when_a_gap_cannot_be_filled() -> None:
    rec = Recorder(replay=[(s, b"") for s in range(5, 8)])  # the buffer rolled past 2..4
    t = rec.tracker()
    t.on_live(0, b"")
    t.on_live(1, b"")
    t.on_live(7, b"")
    assert rec.resets == 1 and t.lost_resets == 1
    assert rec.applied == [5, 6, 7]
    rec2 = Recorder()
    t2 = rec2.tracker(with_replay=False)
    t2.on_live(0, b"")
    t2.on_live(3, b"")
    assert rec2.resets == 1 and rec2.applied == [3]


def test_tracker_late_join_and_restart() -> None:
    rec = Recorder(replay=[(s, b"") for s in range(4)])
    t = rec.tracker()
    t.on_live(3, b"")  # joined late: 0..2 come from the replay, nothing to reset
    assert rec.applied == [0, 1, 2, 3] and rec.resets == 0
    rec.buffer = [(0, b""), (1, b"")]  # the publisher restarted: its count starts again
    t.on_live(1, b"")
    assert t.restarts == 1 and rec.resets == 1
    assert rec.applied == [0, 1]


def test_tracker_checks_continuity_after_a_disconnect() -> None:
    rec = Recorder(replay=[(0, b"a"), (1, b"b"), (2, b"c")])
    t = rec.tracker()
    for s, p in ((0, b"a"), (1, b"b")):
        t.on_live(s, p)
    t.on_disconnect()
    t.on_live(2, b"c")  # the same publisher: its buffer still holds batch 1 as applied
    assert rec.resets == 0 and rec.applied == [0, 1, 2]
    rec.buffer = [(s, b"new") for s in range(6)]  # a new process, already past seq 2
    t.on_disconnect()
    t.on_live(5, b"new")
    assert t.restarts == 1 and rec.resets == 1 and rec.applied == list(range(6))


def test_subscriber_over_real_sockets_replays_a_lost_batch() -> None:
    """A hand-driven publisher loses batch 1 on the live stream; its replay socket has it."""
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    payloads = [encode_batch(stored(100 + s)) for s in range(3)]
    got: List[int] = []
    resets: List[int] = []
    sub = EventSubscriber(pub.getsockopt_string(zmq.LAST_ENDPOINT),
                          router.getsockopt_string(zmq.LAST_ENDPOINT),
                          on_batch=lambda b: got.append(hash_from_wire(b.events[0].block_hashes[0])),
                          on_reset=lambda: resets.append(1))
    try:
        time.sleep(0.3)
        pub.send_multipart((b"", (0).to_bytes(8, "big"), payloads[0]))
        wait_for(lambda: got == [100])
        pub.send_multipart((b"", (2).to_bytes(8, "big"), payloads[2]))
        assert router.poll(5000)
        client, _, start = router.recv_multipart()
        assert int.from_bytes(start, "big") == 1
        for s in (1, 2):
            router.send_multipart((client, b"", b"", s.to_bytes(8, "big"), payloads[s]))
        router.send_multipart((client, b"", b"", END_SEQ, b""))
        wait_for(lambda: len(got) == 3)
        assert got == [100, 101, 102] and not resets
        assert sub.tracker.replays == 1
    finally:
        sub.close()
        pub.close()
        router.close()


def rebind(endpoint: str, replay: str) -> ZmqEventPublisher:
    """A new publisher on the endpoints a closed one had (ZeroMQ releases them asynchronously)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return ZmqEventPublisher(endpoint, replay)
        except InvalidArgumentError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_subscriber_sees_a_restarted_publisher() -> None:
    got: List[int] = []
    resets: List[int] = []
    pub = ZmqEventPublisher("tcp://*:*", "tcp://127.0.0.1:*")
    port = pub.endpoint.rsplit(":", 1)[1]
    # A specific host:port connects (vLLM's rule): a restarted process binds the wildcard again.
    endpoint, replay = f"tcp://*:{port}", pub.replay_endpoint
    sub = EventSubscriber(f"tcp://127.0.0.1:{port}", replay,
                          on_batch=lambda b: got.append(hash_from_wire(b.events[0].block_hashes[0])),
                          on_reset=lambda: (resets.append(1), got.clear()))
    try:
        time.sleep(0.3)
        for h in (1, 2, 3):
            pub.publish(stored(h))
        wait_for(lambda: got == [1, 2, 3])
        pub.close()
        pub = rebind(endpoint, replay)  # the same endpoints; seq starts at 0 again
        # Published until one gets through (the SUB reconnects on its own schedule): the new
        # process's count may already be past the old one's when the subscriber sees it.
        wait_for(lambda: (pub.publish(stored(7)), time.sleep(0.1), 7 in got)[2])
        assert sub.tracker.restarts == 1 and resets == [1]
        assert set(got) == {7}
    finally:
        sub.close()
        pub.close()
