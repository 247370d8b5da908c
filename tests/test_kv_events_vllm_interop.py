"""pagedkv's KV-event batches read by vLLM 0.33.0's own classes, and vLLM's read by pagedkv.

vLLM is not in the project venv: scripts/test_vllm.sh installs it into .vllm-test/site and runs
this file with that folder on PYTHONPATH. Elsewhere the test skips, unless
PAGEDKV_REQUIRE_VLLM=1 says vLLM must be importable (then its absence fails).
"""

from __future__ import annotations

import os
import time

import pytest

try:
    import msgspec

    from pagedkv.events import EventSink, KVEventBatch, decode_batch, encode_batch, hash_to_wire
    from vllm.distributed import kv_events as vk
except ImportError as exc:  # pragma: no cover - depends on the environment
    if os.environ.get("PAGEDKV_REQUIRE_VLLM") == "1":
        raise
    pytest.skip(f"vLLM is not importable ({exc}); scripts/test_vllm.sh runs this test",
                allow_module_level=True)


def sample_batch() -> KVEventBatch:
    sink = EventSink()
    sink.add_core([
        ("stored", "GPU", [2**128 - 1, 12345], None, list(range(8)), 4),
        ("stored", "CPU", [7], 12345, [9, 9, 9, 9], 4),
        ("removed", "GPU", [2**127], None, [], 4),
        ("cleared", "GPU", [], None, [], 4),
    ])
    sink.add_stored([99], 7, [1, 2, 3, 4], 4, medium="STORAGE", locality="LOCAL")
    sink.add_removed([99], medium="STORAGE", locality="REMOTE")
    # A manager with KV cache groups: group_idx and the group's spec fields, as vLLM sets them.
    grouped = EventSink([("full", 0), ("sliding", 1024), ("chunked", 64)])
    grouped.add_core([
        ("stored", "GPU", [5, 6], None, list(range(8)), 4, 0),
        ("stored", "GPU", [6], 5, [4, 5, 6, 7], 4, 1),
        ("stored", "GPU", [6], 5, [4, 5, 6, 7], 4, 2),
        ("removed", "GPU", [6], None, [], 4, 1),
    ])
    return KVEventBatch(ts=1234.5, events=sink.take() + grouped.take(), data_parallel_rank=0)


def test_vllm_decodes_pagedkv_batches_field_for_field() -> None:
    ours = sample_batch()
    theirs = msgspec.msgpack.Decoder(vk.KVEventBatch).decode(encode_batch(ours))
    assert theirs.ts == ours.ts and theirs.data_parallel_rank == 0
    assert [type(e).__name__ for e in theirs.events] == [type(e).__name__ for e in ours.events]
    for a, b in zip(ours.events, theirs.events):
        assert set(a.__struct_fields__) == set(b.__struct_fields__)
        for f in a.__struct_fields__:
            assert getattr(a, f) == getattr(b, f), f
    first = theirs.events[0]
    assert first.block_hashes == [hash_to_wire(2**128 - 1), hash_to_wire(12345)]
    assert int.from_bytes(first.block_hashes[0], "big") == 2**128 - 1


def test_same_bytes_as_vllm_for_the_same_batch() -> None:
    ours = sample_batch()
    events = []
    for e in ours.events:
        cls = getattr(vk, type(e).__name__)
        events.append(cls(**{f: getattr(e, f) for f in e.__struct_fields__}))
    theirs = vk.KVEventBatch(ts=ours.ts, events=events, data_parallel_rank=0)
    assert msgspec.msgpack.Encoder().encode(theirs) == encode_batch(ours)


def test_pagedkv_decodes_vllm_batches() -> None:
    stored = vk.BlockStored(block_hashes=[b"\x01" * 32, 2**63 - 1], parent_block_hash=None,
                            token_ids=[1, 2, 3, 4], block_size=2, lora_id=None, medium="GPU",
                            lora_name=None, extra_keys=[("salt",), None], group_idx=1)
    batch = vk.KVEventBatch(ts=time.time(), events=[stored, vk.BlockRemoved([5], "CPU"),
                                                    vk.AllBlocksCleared()])
    ours = decode_batch(msgspec.msgpack.Encoder().encode(batch))
    assert ours.events[0].block_hashes == [b"\x01" * 32, 2**63 - 1]
    assert ours.events[0].extra_keys == [("salt",), None]
    assert ours.events[0].group_idx == 1
    assert ours.events[1].block_hashes == [5] and ours.events[1].medium == "CPU"
    assert type(ours.events[2]).__name__ == "AllBlocksCleared"


def test_vllm_publisher_wire_is_what_our_subscriber_reads() -> None:
    """vLLM's own ZmqEventPublisher (PUB + replay) feeds pagedkv's subscriber."""
    from pagedkv.events import EventSubscriber

    got: list = []
    pub = vk.ZmqEventPublisher(0, endpoint="tcp://127.0.0.1:*",
                               replay_endpoint="tcp://127.0.0.1:*")
    try:
        import zmq

        endpoint = pub._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        replay = pub._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        pub.publish(vk.KVEventBatch(ts=1.0, events=[vk.BlockRemoved([1], "GPU")]))
        deadline = time.monotonic() + 10
        while not pub._buffer and time.monotonic() < deadline:
            time.sleep(0.02)
        # Joining after batch 0 was sent: the subscriber replays it when batch 1 arrives.
        sub = EventSubscriber(endpoint, replay, on_batch=got.append, on_reset=lambda: None)
        try:
            time.sleep(0.3)
            pub.publish(vk.KVEventBatch(ts=2.0, events=[vk.BlockRemoved([2], "GPU")]))
            while len(got) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            sub.close()
    finally:
        pub.shutdown()
    assert [b.events[0].block_hashes for b in got] == [[1], [2]]
