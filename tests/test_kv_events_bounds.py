"""The publisher under hostile or careless peers: replays never starve the live stream, a slow
replay peer is bounded and dropped, a fixed-port publisher can listen on loopback only.

Real ZeroMQ sockets on loopback; waits are bounded polls.
"""

from __future__ import annotations

import socket
import time
from typing import Any, List

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from pagedkv.errors import InvalidArgumentError  # noqa: E402
from pagedkv.events import EventSink, KVEventBatch, ZmqEventPublisher  # noqa: E402
from pagedkv.events.publisher import END_SEQ  # noqa: E402
from polling import wait_for  # noqa: E402


def stored(h: int, n: int = 1) -> KVEventBatch:
    sink = EventSink()
    sink.add_stored(list(range(h, h + n)), None, [7] * n, 1)
    return KVEventBatch(ts=0.0, events=sink.take())


def sub_socket(endpoint: str) -> Any:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    return sub


def dealer(endpoint: str, rcvhwm: int = 1000) -> Any:
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.RCVHWM, rcvhwm)
    d.connect(endpoint)
    return d


def test_replay_peers_that_never_read_do_not_stop_live_publishing() -> None:
    """100 peers each ask for a full 10 000-batch replay and read nothing; a batch published
    after their requests reaches a live subscriber at once (within a bounded wait far below the
    time all those replays take)."""
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        for k in range(10_000):
            assert pub.publish(stored(k))
        wait_for(lambda: pub.sent_batches == 10_000, 60)
        sub = sub_socket(pub.endpoint)
        time.sleep(0.3)  # the subscription reaches the PUB
        peers = [dealer(pub.replay_endpoint) for _ in range(100)]
        try:
            for d in peers:
                d.send_multipart((b"", (0).to_bytes(8, "big")))
            time.sleep(0.3)  # the requests reach the publisher
            assert pub.publish(stored(1 << 40))
            assert sub.poll(5000), "the live batch waited behind the replays"
            frames = sub.recv_multipart()
            assert int.from_bytes(frames[1], "big") == 10_000
            # At most max_replay_peers replays run at once; the others were answered empty.
            wait_for(lambda: pub.replays_refused == 100 - 32, 10)
            empty = 0
            for d in peers:  # the refused ones got the end marker alone, the others batches
                assert d.poll(5000)
                first = d.recv_multipart()
                empty += first == [b"", b"", END_SEQ, b""]
                assert first[2] in (END_SEQ, (0).to_bytes(8, "big"))
            assert empty == 100 - 32
        finally:
            for d in peers:
                d.close()
            sub.close()


def test_a_replay_peer_that_stops_reading_is_bounded_and_dropped() -> None:
    big = 2_000  # hashes per batch: ~50 KB a batch, a replay far beyond the kernel's buffers
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", replay_hwm=4,
                           replay_stall_s=0.3, buffer_steps=400) as pub:
        for k in range(400):
            assert pub.publish(stored(k * big, big))
        wait_for(lambda: pub.sent_batches == 400, 60)
        slow = dealer(pub.replay_endpoint, rcvhwm=4)
        good = dealer(pub.replay_endpoint)
        try:
            slow.send_multipart((b"", (0).to_bytes(8, "big")))
            wait_for(lambda: pub.replays_aborted == 1, 20)
            sent_to_slow = pub.replay_messages_sent
            assert sent_to_slow < 400  # it was never sent the whole replay
            # A peer that reads gets its whole replay, and live batches flow meanwhile.
            good.send_multipart((b"", (390).to_bytes(8, "big")))
            seqs: List[int] = []
            while True:
                assert good.poll(5000)
                frames = good.recv_multipart()
                if frames[2] == END_SEQ:
                    break
                seqs.append(int.from_bytes(frames[2], "big"))
            assert seqs == list(range(390, 400))
        finally:
            slow.close()
            good.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_bind_listens_on_loopback_at_a_fixed_port() -> None:
    port = free_port()
    with ZmqEventPublisher(None, bind=f"tcp://127.0.0.1:{port}") as pub:
        assert pub.bind == pub.endpoint == f"tcp://127.0.0.1:{port}"
        # Bound on loopback: the port is taken there (a second bind fails) ...
        with pytest.raises(InvalidArgumentError) as err:
            ZmqEventPublisher(None, bind=f"tcp://127.0.0.1:{port}")
        assert err.value.fields["what"] == "bind"
        # ... and a subscriber connecting to it receives the batches.
        sub = sub_socket(pub.endpoint)
        try:
            time.sleep(0.3)
            assert pub.publish(stored(5))
            assert sub.poll(5000)
            assert int.from_bytes(sub.recv_multipart()[1], "big") == 0
        finally:
            sub.close()
    # The same endpoint through vLLM's rule connects instead (nothing listens on the port).
    with ZmqEventPublisher(f"tcp://127.0.0.1:{port}") as pub:
        probe = socket.socket()
        try:
            assert probe.connect_ex(("127.0.0.1", port)) != 0
        finally:
            probe.close()
    with pytest.raises(InvalidArgumentError) as err:
        ZmqEventPublisher(None)
    assert err.value.fields["what"] == "endpoint"


class FakeManager:
    """What StepEventPublisher reads of a block manager: its drained events."""

    kv_events_dropped = 0

    def __init__(self) -> None:
        self.events: List[Any] = []

    def drain_kv_events(self) -> List[Any]:
        out, self.events = self.events, []
        return out


def test_engine_config_kv_events_bind_reaches_the_publisher() -> None:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.errors import ConfigArgumentError
    from pagedkv.events.engine import StepEventPublisher, kv_events_enabled

    port = free_port()
    config = EngineConfig(kv_events_bind=f"tcp://127.0.0.1:{port}",
                          kv_events_replay_endpoint="tcp://127.0.0.1:*")
    assert kv_events_enabled(config) and not kv_events_enabled(EngineConfig())
    assert StepEventPublisher.from_config(FakeManager(), EngineConfig()) is None
    manager = FakeManager()
    step = StepEventPublisher.from_config(manager, config)
    assert step is not None
    sub = sub_socket(f"tcp://127.0.0.1:{port}")
    try:
        assert step.publisher.bind == f"tcp://127.0.0.1:{port}"
        time.sleep(0.3)
        manager.events.append(("stored", "GPU", [9], None, [1, 2], 2))
        step.flush()
        assert sub.poll(5000)
        assert int.from_bytes(sub.recv_multipart()[1], "big") == 0
    finally:
        sub.close()
        step.close()
    with pytest.raises(ConfigArgumentError) as err:
        EngineConfig(kv_events_bind="127.0.0.1:5557")
    assert err.value.fields["field"] == "kv_events_bind"


def test_an_endless_replay_answer_is_capped_by_bytes() -> None:
    """A replay peer that answers without end (never the end marker): the subscriber abandons the
    answer once it passes max_replay_bytes, long before its time limit, and forgets the
    publisher rather than apply a partial history."""
    from pagedkv.events import EventSubscriber, encode_batch

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    replay = ctx.socket(zmq.ROUTER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.bind("tcp://127.0.0.1:*")
    resets: List[int] = []
    applied: List[int] = []
    sub = EventSubscriber(pub.getsockopt_string(zmq.LAST_ENDPOINT),
                          replay.getsockopt_string(zmq.LAST_ENDPOINT),
                          on_batch=lambda b: applied.append(1), on_reset=lambda: resets.append(1),
                          replay_timeout_s=60.0, max_replay_bytes=4 << 20)
    try:
        time.sleep(0.3)
        one = encode_batch(stored(1))
        pub.send_multipart((b"", (0).to_bytes(8, "big"), one))
        wait_for(lambda: applied == [1])
        pub.send_multipart((b"", (5).to_bytes(8, "big"), one))  # a gap: 1..4 are asked for
        assert replay.poll(10_000)
        client, _, start = replay.recv_multipart()
        assert int.from_bytes(start, "big") == 1
        filler = encode_batch(stored(2, 20_000))  # ~0.4 MB a batch
        sent = 0
        while sub.oversized_replays == 0 and sent < 200:  # 80 MB if never capped
            replay.send_multipart((client, b"", b"", (1 + sent).to_bytes(8, "big"), filler))
            sent += 1
            time.sleep(0.01)
        wait_for(lambda: sub.oversized_replays == 1)
        assert sent < 40
        wait_for(lambda: sub.tracker.lost_resets == 1 and resets == [1])
    finally:
        sub.close()
        pub.close()
        replay.close()
