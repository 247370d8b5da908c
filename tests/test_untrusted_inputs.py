"""Input a remote party controls, by property: KV-event frames, block records, the router's events.

Three surfaces, each fed hostile input and held to its contract (not merely "does not crash"):

* the KV-event wire (:mod:`pagedkv.events`): ``decode_batch`` answers a batch or
  :class:`~pagedkv.errors.InvalidArgumentError`, whatever the bytes; the subscriber counts
  malformed frames and keeps applying the stream; a replay peer can neither hold its thread nor
  inject batches under malformed sequence numbers; the publisher ignores malformed replay requests;
* the block record (:mod:`pagedkv.tiers.record`), read back from a buffer, a disk slot or a real
  Redis: every single fault (wrong magic, version, fingerprint, identity, oversized length fields,
  truncation, flipped bytes), even with a recomputed checksum, is a miss with its ``Reason``; the
  payload served is only ever the one stored for that identity;
* the router's index (:mod:`pagedkv.router`): it follows a reference model under any event
  sequence, a replica cannot touch another's entries nor grow the index past its bound, and the
  subscriber -> router path survives malformed frames.

Sockets are real (loopback, wildcard ports); waits are bounded polls, never timed assertions.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.errors import InvalidArgumentError
from pagedkv.tiers import BlockMeta, DiskStore, Reason, fingerprint
from pagedkv.tiers.record import (
    CHECKSUM_BYTES,
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    decode,
    decode_checked,
    encode,
    TRAILER_BYTES,
    parse_header,
    verify_split,
)
from pagedkv.tiers.secret import TierSecret
from polling import wait_for  # noqa: E402

FP = fingerprint("test/untrusted", "bfloat16", 16, 2, 2, 8)
SECRET = TierSecret(b"test fleet secret of at least 32 bytes", source="test")
U32 = (1 << 32) - 1
U64 = (1 << 64) - 1
U128 = (1 << 128) - 1


def _events() -> Any:
    pytest.importorskip("msgspec")
    import pagedkv.events as events

    return events


# ====================================================================== KV-event payloads

_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 63), U64), st.floats(), st.text(max_size=8),
    st.binary(max_size=20),
)
#: Any msgpack value (nested arrays and maps of the above).
_msgpack_values = st.recursive(
    _leaves,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=16,
)
_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
           "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "locality",
           "lookahead_token_ids")
_field_values = st.one_of(
    _msgpack_values,
    st.lists(st.one_of(st.binary(max_size=24), st.integers(-(1 << 63), U64)), max_size=4),
    st.lists(st.integers(-(1 << 63), U64), max_size=6),
)
#: Maps shaped like events (a known tag or not, known field names with any values).
_event_like = st.builds(
    lambda tag, fields: {"type": tag, **fields},
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Nope", ""]),
    st.dictionaries(st.sampled_from(_FIELDS), _field_values, max_size=len(_FIELDS)),
)
#: Envelopes: a valid batch's outer shape ``[ts, events, rank?]`` around garbage, or garbage.
_envelopes = st.one_of(
    st.tuples(st.one_of(st.floats(), _leaves), st.lists(st.one_of(_event_like, _msgpack_values),
                                                        max_size=4)).map(list),
    st.tuples(st.floats(), st.lists(_event_like, max_size=4), _leaves).map(list),
    _msgpack_values,
)


def _check_decodes_or_refuses(events: Any, payload: bytes) -> Optional[Any]:
    """``decode_batch(payload)``: a batch that re-encodes stably, or InvalidArgumentError naming the
    payload's size; anything else fails the test."""
    try:
        batch = events.decode_batch(payload)
    except InvalidArgumentError as err:
        assert err.fields["what"] == "payload" and err.fields["value"] == len(payload)
        assert f"<{len(payload)} bytes>" in str(err)
        return None
    assert isinstance(batch, events.KVEventBatch)
    for event in batch.events:
        assert isinstance(event, (events.BlockStored, events.BlockRemoved, events.AllBlocksCleared))
        for h in getattr(event, "block_hashes", ()):
            assert isinstance(h, (bytes, int)) and not isinstance(h, bool)
    again = events.encode_batch(batch)
    assert events.encode_batch(events.decode_batch(again)) == again
    return batch


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(max_size=256))
def test_decode_batch_any_bytes_is_a_batch_or_a_typed_error(payload: bytes) -> None:
    _check_decodes_or_refuses(_events(), payload)


@settings(max_examples=200, deadline=None)
@given(envelope=_envelopes)
def test_decode_batch_garbage_inside_a_valid_envelope_is_a_batch_or_a_typed_error(
        envelope: Any) -> None:
    import msgspec

    _check_decodes_or_refuses(_events(), msgspec.msgpack.encode(envelope))


def _stored_with_extra_keys(extra: bytes) -> bytes:
    """A valid BlockStored batch whose ``extra_keys`` msgpack bytes are ``extra`` (raw)."""
    import msgspec

    event = {"type": "BlockStored", "block_hashes": [b"\x01" * 16], "parent_block_hash": None,
             "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
             "lora_name": None, "extra_keys": "@@"}
    payload = msgspec.msgpack.encode([0.0, [event]])
    marker = msgspec.msgpack.encode("@@")
    assert payload.count(marker) == 1
    return payload.replace(marker, extra)


@pytest.mark.parametrize("depth", [2_000, 100_000])
def test_decode_batch_deep_nesting_is_a_typed_error(depth: int) -> None:
    """``extra_keys`` is ``Any``-typed: msgpack arrays nested past the recursion limit used to
    escape as RecursionError (not ValueError: the subscriber did not count it as a bad payload)."""
    events = _events()
    payload = _stored_with_extra_keys(b"\x91" + b"\x91" * depth + b"\xc0")
    with pytest.raises(InvalidArgumentError) as err:
        events.decode_batch(payload)
    assert err.value.fields["what"] == "payload" and err.value.fields["value"] == len(payload)
    assert "recursion limit" in str(err.value)
    # Shallow nesting is a valid batch, not over-refused.
    batch = events.decode_batch(_stored_with_extra_keys(b"\x91" + b"\x91" * 20 + b"\xc0"))
    assert batch.events[0].extra_keys is not None


@pytest.mark.parametrize("body", [
    b"\xdd\xff\xff\xff\xff",                   # events: array32 of 2**32-1
    b"\x91\xdf\xff\xff\xff\xff",               # one event: map32 of 2**32-1 pairs
    b"\x91\xc6\xff\xff\xff\xff",               # one event: bin32 of 4 GiB
    b"\x91\xdb\xff\xff\xff\xff",               # one event: str32 of 4 GiB
    b"\x91\x82\xa4type\xabBlockStored\xacblock_hashes\xdd\xff\xff\xff\xff",  # 2**32-1 hashes
], ids=["array32", "map32", "bin32", "str32", "hashes"])
def test_decode_batch_huge_declared_counts_are_refused(body: bytes) -> None:
    """A length field promising far more than the payload holds is a typed error (msgspec checks
    the bytes left before it allocates: this test would run out of memory otherwise)."""
    events = _events()
    payload = b"\x92\xcb" + b"\x00" * 8 + body
    with pytest.raises(InvalidArgumentError) as err:
        events.decode_batch(payload)
    assert err.value.fields["value"] == len(payload) and "truncated" in str(err.value)


# ====================================================================== subscriber and replay

def _xpub(zmq: Any) -> Any:
    """An XPUB on loopback: like the engine's PUB, but it reports subscriptions, so a test knows
    when the subscriber's subscription has arrived instead of sleeping."""
    sock = zmq.Context.instance().socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    return sock


def _await_subscription(xpub: Any) -> None:
    assert xpub.poll(10_000), "the subscriber never subscribed"
    assert xpub.recv()[:1] == b"\x01"


def _stored_payload(events: Any, h: int) -> bytes:
    sink = events.EventSink()
    sink.add_stored([h], None, [1, 2], 2)
    return events.encode_batch(events.KVEventBatch(ts=0.0, events=sink.take()))


def _replay_rig(zmq: Any, events: Any, got: List[int], timeout_s: float,
                on_reset: Any = None) -> Tuple[Any, Any, Any]:
    """An XPUB and a ROUTER on loopback playing one replica's live and replay endpoints, and a
    subscriber to both that appends each applied batch's first hash to ``got``."""
    xpub = _xpub(zmq)
    replay = zmq.Context.instance().socket(zmq.ROUTER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.bind("tcp://127.0.0.1:*")
    sub = events.EventSubscriber(
        xpub.getsockopt_string(zmq.LAST_ENDPOINT), replay.getsockopt_string(zmq.LAST_ENDPOINT),
        on_batch=lambda b: got.append(events.hash_from_wire(b.events[0].block_hashes[0])),
        on_reset=on_reset or (lambda: None), replay_timeout_s=timeout_s)
    return xpub, replay, sub


def _seq(n: int, width: int = 8) -> bytes:
    return n.to_bytes(width, "big", signed=True)


def _hostile_messages(events: Any) -> Tuple[List[List[bytes]], int, int]:
    """Messages a hostile or broken publisher sends before a valid batch (seq 3): the list, how
    many are dropped for their frame shape, how many reach the decoder and fail there."""
    shape = [
        [b""],                                           # topic only
        [b"", _seq(0)],                                  # no payload
        [b"", _seq(0), _stored_payload(events, 1), b""],  # a fourth frame
        [b"", b"\x00" * 7, _stored_payload(events, 1)],  # a 7-byte seq
        [b"", b"\x00" * 9, _stored_payload(events, 1)],  # a 9-byte seq
    ]
    decode = [
        [b"", _seq(0), b"\xc1garbage"],
        [b"", _seq(1), _stored_with_extra_keys(b"\x91" * 50_000 + b"\xc0")],
        [b"", _seq(2), b"\x92\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff"],
    ]
    return shape + decode, len(shape), len(decode)


def test_subscriber_counts_malformed_frames_and_keeps_applying() -> None:
    zmq = pytest.importorskip("zmq")
    events = _events()
    xpub = _xpub(zmq)
    got: List[int] = []
    resets: List[int] = []
    sub = events.EventSubscriber(
        xpub.getsockopt_string(zmq.LAST_ENDPOINT),
        on_batch=lambda b: got.append(events.hash_from_wire(b.events[0].block_hashes[0])),
        on_reset=lambda: resets.append(1))
    try:
        _await_subscription(xpub)
        hostile, n_shape, n_decode = _hostile_messages(events)
        for frames in hostile:
            xpub.send_multipart(frames)
        xpub.send_multipart([b"", _seq(3), _stored_payload(events, 77)])
        wait_for(lambda: got == [77])
        # Every malformed message was counted (the deep one too), none reached on_batch, seqs
        # 0..2 (refused payloads) were taken as applied: no gap, no reset before 3.
        assert sub.bad_payloads == n_shape + n_decode
        assert not resets and sub.tracker.applied == 3 and sub.tracker.lost_resets == 0
        assert sub._thread.is_alive()
    finally:
        sub.close()
        xpub.close()


def test_replay_that_never_ends_is_abandoned_within_the_timeout() -> None:
    """A replay peer that answers forever (malformed frames and batches, never the end marker)
    used to hold the subscriber's thread, and grow its list, for as long as it kept sending."""
    zmq = pytest.importorskip("zmq")
    events = _events()
    got: List[int] = []
    resets: List[int] = []
    xpub, replay, sub = _replay_rig(zmq, events, got, 0.3, lambda: resets.append(1))
    try:
        _await_subscription(xpub)
        xpub.send_multipart([b"", _seq(3), _stored_payload(events, 33)])  # 0..2 missing
        assert replay.poll(10_000)
        client, _, start = replay.recv_multipart()
        assert int.from_bytes(start, "big", signed=True) == 0
        junk = _stored_payload(events, 666)
        deadline = time.monotonic() + 10
        k = 0
        while not got and time.monotonic() < deadline:  # flood until the live batch is applied
            replay.send_multipart([client, b"", b"x"] if k % 2 else
                                  [client, b"", b"", _seq(1000 + k), junk])
            k += 1
            time.sleep(0.002)
        # The replay counted as unanswered: nothing was applied before, so no reset; the live
        # batch went through and none of the flood did.
        assert got == [33]
        assert not resets and sub.tracker.replays == 1 and sub.tracker.applied == 3
    finally:
        sub.close()
        xpub.close()
        replay.close()


def test_replay_frames_with_a_malformed_seq_are_ignored() -> None:
    """A replay answer whose seq frame is not 8 bytes (the live stream's rule) used to be applied
    under whatever number its bytes made: a 9-byte one put ``applied`` past every live seq, so the
    stream was skipped for good (and the next continuity check raised OverflowError)."""
    zmq = pytest.importorskip("zmq")
    events = _events()
    got: List[int] = []
    xpub, replay, sub = _replay_rig(zmq, events, got, 5.0)
    try:
        _await_subscription(xpub)
        xpub.send_multipart([b"", _seq(2), _stored_payload(events, 2)])
        assert replay.poll(10_000)
        client, _, _start = replay.recv_multipart()
        replay.send_multipart([client, b"", b"", (1 << 70).to_bytes(9, "big"),
                               _stored_payload(events, 900)])
        replay.send_multipart([client, b"", b"", b"\x00" * 7, _stored_payload(events, 901)])
        replay.send_multipart([client, b"", b"", b"", _stored_payload(events, 902)])
        replay.send_multipart([client, b"", b"", _seq(-1), b""])  # the end marker
        wait_for(lambda: got == [2])
        xpub.send_multipart([b"", _seq(3), _stored_payload(events, 3)])
        wait_for(lambda: got == [2, 3])
        assert sub.tracker.applied == 3
    finally:
        sub.close()
        xpub.close()
        replay.close()


def test_publisher_ignores_malformed_replay_requests() -> None:
    zmq = pytest.importorskip("zmq")
    events = _events()
    with events.ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv") as pub:
        for h in (10, 11):
            assert pub.publish(events.KVEventBatch(
                ts=0.0, events=[events.BlockRemoved(block_hashes=[events.hash_to_wire(h)],
                                                    medium="GPU")]))
        wait_for(lambda: pub.sent_batches == 2)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        try:
            for frames in ([b""], [_seq(0)], [b"", b"\x00" * 7], [b"", b"\x00" * 9],
                           [b"", _seq(0), b"extra"], [b"", b""]):
                dealer.send_multipart(frames)
            dealer.send_multipart([b"", _seq(1)])
            replies = []
            while not replies or replies[-1][2] != events.publisher.END_SEQ:
                assert dealer.poll(10_000)
                replies.append(dealer.recv_multipart())
            # Only the well-formed request was answered: batch 1, then the end marker.
            assert [(r[1], int.from_bytes(r[2], "big", signed=True)) for r in replies] == \
                [(b"kv", 1), (b"", -1)]
            assert not dealer.poll(200)
        finally:
            dealer.close()
        assert pub.publish(events.KVEventBatch(ts=0.0, events=[events.AllBlocksCleared()]))
        wait_for(lambda: pub.sent_batches == 3)


_live_seq = st.one_of(st.integers(-2, 40), st.integers(-(1 << 63), (1 << 63) - 1))
_tracker_ops = st.lists(st.one_of(
    st.tuples(st.just("live"), _live_seq, st.binary(max_size=2)),
    st.just(("disconnect",)), st.just(("resync",))), max_size=30)
_replay_answers = st.one_of(st.none(), st.lists(
    st.tuples(st.one_of(st.integers(-2, 45), _live_seq), st.binary(max_size=2)), max_size=6))


@settings(max_examples=200, deadline=None)
@given(ops=_tracker_ops, data=st.data())
def test_tracker_applies_each_batch_once_in_order_whatever_the_peer_says(
        ops: List[Tuple[Any, ...]], data: Any) -> None:
    """Any live sequence numbers, any replay answers (out of order, duplicated, unrelated): the
    tracker never raises, applies strictly increasing seqs between two resets, and after a live
    batch has applied it or something past it."""
    events = _events()
    log: List[Tuple[str, Optional[int]]] = []

    def replay(start: int) -> Optional[List[Tuple[int, bytes]]]:
        return data.draw(_replay_answers)

    tracker = events.SequenceTracker(lambda seq, _p: log.append(("apply", seq)),
                                     lambda: log.append(("reset", None)), replay)
    for op in ops:
        if op[0] == "live":
            tracker.on_live(op[1], op[2])
            assert tracker.applied is not None and tracker.applied >= op[1]
        elif op[0] == "disconnect":
            tracker.on_disconnect()
        else:
            tracker.resync()
            assert tracker.applied is None
    last: Optional[int] = None
    for kind, seq in log:
        if kind == "reset":
            last = None
            continue
        assert seq is not None and (last is None or seq > last)
        last = seq
    assert tracker.applied == last
    assert tracker.applied_batches == sum(kind == "apply" for kind, _ in log)


# ====================================================================== block records

_FAULTS = ("none", "trailing", "magic", "version", "fingerprint", "hash", "salt", "token_count",
           "group", "payload_len", "token_value", "unchecked_header", "payload_byte",
           "checksum_byte", "truncate", "mac_byte")
#: Faults the identity checks see: the same reason whether or not the checksum was recomputed.
_EXPECTED = {
    "none": Reason.OK, "trailing": Reason.OK, "magic": Reason.BAD_MAGIC,
    "version": Reason.BAD_VERSION, "fingerprint": Reason.FOREIGN, "hash": Reason.HASH_MISMATCH,
    "salt": Reason.SALT_MISMATCH, "token_count": Reason.TOKENS_MISMATCH,
    "group": Reason.GROUP_MISMATCH,
    "payload_len": Reason.LENGTH_MISMATCH, "token_value": Reason.TOKENS_MISMATCH,
    "payload_byte": Reason.CHECKSUM, "checksum_byte": Reason.CHECKSUM,
    "truncate": Reason.TRUNCATED, "mac_byte": Reason.UNAUTHENTICATED,
}


def _other(draw: Any, strategy: Any, not_this: Any) -> Any:
    return draw(strategy.filter(lambda v: v != not_this))


@st.composite
def faulty_records(draw: Any, payload_size: Optional[int] = None, max_tokens: int = 8
                   ) -> Tuple[BlockMeta, bytes, bytes, str, Reason]:
    """``(meta, payload, record bytes, fault, expected reason)``: a record of ``meta`` with one
    fault; ``forge`` (drawn) recomputes the checksum, as a writer with access to the store but
    not to the tier secret could: the MAC then refuses what the checksum no longer does."""
    n = draw(st.integers(0, max_tokens))
    tokens = draw(st.lists(st.integers(0, U32), min_size=n, max_size=n))
    size = payload_size or draw(st.integers(1, 96))
    payload = draw(st.binary(min_size=size, max_size=size))
    meta = BlockMeta(draw(st.integers(0, U128)), draw(st.none() | st.integers(0, U128)),
                     draw(st.integers(0, U128)), tokens)
    rec = bytearray(encode(FP, meta, payload, secret=SECRET))
    end = len(rec) - TRAILER_BYTES
    fault = draw(st.sampled_from(_FAULTS))
    if fault == "token_value" and n == 0:
        fault = "token_count"
    forge = draw(st.booleans())
    expected = _EXPECTED.get(fault)
    if fault == "trailing":
        rec += draw(st.binary(min_size=1, max_size=32))
    elif fault == "magic":
        rec[0:4] = _other(draw, st.binary(min_size=4, max_size=4), MAGIC)
    elif fault == "version":
        rec[4:6] = _other(draw, st.integers(0, 0xFFFF), FORMAT_VERSION).to_bytes(2, "little")
    elif fault == "fingerprint":
        rec[8:24] = _other(draw, st.binary(min_size=16, max_size=16), FP)
    elif fault == "hash":
        rec[24:40] = _other(draw, st.integers(0, U128), meta.block_hash).to_bytes(16, "little")
    elif fault == "salt":
        rec[56:72] = _other(draw, st.integers(0, U128), meta.salt_digest).to_bytes(16, "little")
    elif fault == "token_count":  # up to 2**32-1: a reader must compare, never allocate
        bad = _other(draw, st.one_of(st.just(U32), st.integers(0, U32)), n)
        rec[72:76] = bad.to_bytes(4, "little")
    elif fault == "group":  # the KV cache group the record names (bytes 76..80)
        rec[76:80] = _other(draw, st.integers(0, U32), meta.group).to_bytes(4, "little")
    elif fault == "payload_len":  # up to 2**64-1
        rec[80:88] = _other(draw, st.one_of(st.just(U64), st.integers(0, U64)), size).to_bytes(
            8, "little")
    elif fault == "token_value":
        i = draw(st.integers(0, n - 1))
        off = HEADER_BYTES + 4 * i
        rec[off:off + 4] = _other(draw, st.integers(0, U32), tokens[i]).to_bytes(4, "little")
    elif fault == "unchecked_header":  # flags, parent hash: covered by the checksum only
        off = draw(st.sampled_from([6, 7, *range(40, 56)]))
        rec[off] ^= draw(st.integers(1, 255))
        expected = Reason.UNAUTHENTICATED if forge else Reason.CHECKSUM
    elif fault == "payload_byte":
        rec[HEADER_BYTES + 4 * n + draw(st.integers(0, size - 1))] ^= draw(st.integers(1, 255))
        # Other KV under a recomputed checksum: only the MAC tells it from the stored block.
        expected = Reason.UNAUTHENTICATED if forge else Reason.CHECKSUM
    elif fault == "checksum_byte":
        rec[end + draw(st.integers(0, CHECKSUM_BYTES - 1))] ^= draw(st.integers(1, 255))
        forge = False
    elif fault == "truncate":
        del rec[draw(st.integers(0, len(rec) - 1)):]
        forge = False
    elif fault == "mac_byte":
        rec[end + CHECKSUM_BYTES + draw(st.integers(0, TRAILER_BYTES - CHECKSUM_BYTES - 1))] ^= \
            draw(st.integers(1, 255))
        forge = False
    if forge and fault != "trailing":
        rec[end:end + CHECKSUM_BYTES] = xxhash.xxh3_128_digest(bytes(rec[:end]))
    assert expected is not None
    return meta, payload, bytes(rec), fault, expected


def _expect(meta: BlockMeta, payload_len: int) -> Dict[str, Any]:
    return dict(fingerprint=FP, block_hash=meta.block_hash, token_ids=list(meta.token_ids),
                salt_digest=meta.salt_digest, payload_len=payload_len, secret=SECRET)


@settings(max_examples=200, deadline=None)
@given(case=faulty_records())
def test_record_single_faults_are_refused_with_their_reason(case: Any) -> None:
    """Every fault is a miss with its reason, checksum recomputed or not; oversized length fields
    are refused by comparison; the only payload ever returned is the one stored."""
    meta, payload, rec, fault, expected = case
    out, reason = decode_checked(rec, **_expect(meta, len(payload)))
    assert reason is expected, fault
    if expected is Reason.OK:
        assert out is not None and bytes(out) == payload
    else:
        assert out is None and decode(rec, **_expect(meta, len(payload))) is None
    # parse_header (the disk scan's) reads any bytes: None exactly for a short or foreign format.
    header = parse_header(rec)
    if fault in ("magic", "version") or len(rec) < HEADER_BYTES:
        assert header is None
    else:
        assert header is not None
        assert header.record_size == HEADER_BYTES + 4 * header.token_count + \
            header.payload_len + TRAILER_BYTES
    # The disk reader's path: the record read as three pieces of the expected sizes.
    if fault not in ("trailing", "truncate"):
        t = HEADER_BYTES + 4 * len(meta.token_ids)
        args = _expect(meta, len(payload))
        del args["payload_len"]
        got = verify_split(rec[:t], rec[t:t + len(payload)], rec[t + len(payload):], **args)
        assert got is expected, fault


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, U32), max_size=8), size=st.integers(1, 64),
       tail=st.binary(max_size=160), cut=st.integers(0, 200))
def test_record_valid_header_then_any_bytes_is_a_miss(
        tokens: List[int], size: int, tail: bytes, cut: int) -> None:
    """The expected identity's header (and some of its tokens) followed by arbitrary bytes: the
    identity checks pass, so only the tokens, the lengths or the checksum can refuse it, and they
    do, unless the bytes are the real record."""
    meta = BlockMeta(5, None, 6, tokens)
    payload = bytes(range(size))
    real = encode(FP, meta, payload, secret=SECRET)
    rec = real[:min(cut, len(real))] + tail
    out, reason = decode_checked(rec, **_expect(meta, size))
    if rec[:len(real)] == real:
        assert reason is Reason.OK and bytes(out) == payload
    else:
        assert out is None and reason is not Reason.OK
        assert parse_header(rec) is None or len(rec) >= HEADER_BYTES


DISK_BLOCK = 256
DISK_TOKENS = 8
GENUINE = BlockMeta(0x0123456789ABCDEF0123456789ABCDEF, None, 3, list(range(DISK_TOKENS)))
GENUINE_PAYLOAD = bytes(range(256))


@settings(max_examples=100, deadline=None)
@given(case=faulty_records(payload_size=DISK_BLOCK, max_tokens=DISK_TOKENS))
def test_disk_slot_holding_a_faulty_record_is_a_miss_after_restart(
        tmp_path_factory: pytest.TempPathFactory, case: Any) -> None:
    """A record written into a slot behind the store's back (a crash, another process, an
    attacker with the directory): the restart scan and the read treat it as a miss, and the
    genuine block beside it still reads back."""
    meta, payload, rec, fault, expected = case
    if meta.block_hash == GENUINE.block_hash:
        return
    path = tmp_path_factory.mktemp("disk")
    s = DiskStore(path, 4 * 4096, FP, DISK_BLOCK, max_tokens=DISK_TOKENS, secret=SECRET)
    assert s.slot_bytes == 4096 and s.put(GENUINE, GENUINE_PAYLOAD)
    s.close()
    (name,) = [p for p in path.iterdir() if p.suffix == ".pkv"]
    with open(name, "r+b") as f:
        f.seek(s.slot_bytes)
        f.write(rec)
    # The slot's unwritten bytes are zeros: a record cut where the real one held zeros is whole.
    real = encode(FP, meta, payload, secret=SECRET)
    if (rec + bytes(len(real)))[:len(real)] == real:
        expected = Reason.OK
    s = DiskStore(path, 4 * 4096, FP, DISK_BLOCK, max_tokens=DISK_TOKENS, secret=SECRET)
    try:
        got = s.get(meta)
        if expected is Reason.OK:
            assert got == payload
        else:
            assert got is None, fault
            # Corrupt slots are freed; a mismatch (another identity's valid block) is kept. A cut
            # record reads as zeros past the cut, which may be either.
            if fault != "truncate":
                kept = fault in ("salt", "group", "token_value") or (
                    # The scan indexes no record claiming more tokens than a slot holds.
                    fault == "token_count" and int.from_bytes(rec[72:76], "little") <= DISK_TOKENS)
                assert s.contains(meta.block_hash) == kept, fault
        assert s.get(GENUINE) == GENUINE_PAYLOAD
    finally:
        s.close()


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=faulty_records(payload_size=DISK_BLOCK, max_tokens=DISK_TOKENS))
def test_remote_value_holding_a_faulty_record_is_a_counted_miss(redis_server: Any,
                                                               case: Any) -> None:
    """Any fault in the value a real Redis holds under the block's key: a miss counted under its
    reason; corrupt and foreign values are deleted, another identity's (mismatched) kept."""
    import redis

    from pagedkv.tiers import RemoteStore

    meta, payload, rec, fault, expected = case
    client = redis.Redis.from_url(redis_server.url)
    with RemoteStore(redis_server.url, FP, DISK_BLOCK, timeout_s=2.0, secret=SECRET) as s:
        key = s.key(meta.block_hash)
        client.set(key, rec)
        before = s.stats()
        got = s.get(meta)
        after = s.stats()
        if expected is Reason.OK:
            assert got == payload and after.hits == before.hits + 1
            return
        assert got is None, fault
        counter = expected.counter
        assert getattr(after, counter) == getattr(before, counter) + 1
        assert after.misses == before.misses + 1 and after.hits == before.hits
        assert client.exists(key) == (counter == "mismatched")
    client.close()


class _FakeRedis:
    """A TCP peer speaking enough RESP3 for redis-py's handshake that answers every GET with
    ``reply`` (a non-bulk reply: what a hostile or broken server may send)."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @staticmethod
    def _commands(buf: bytes) -> Tuple[List[List[bytes]], bytes]:
        out: List[List[bytes]] = []
        while buf.startswith(b"*"):
            try:
                i = buf.index(b"\r\n")
                pos, args = i + 2, []
                for _ in range(int(buf[1:i])):
                    j = buf.index(b"\r\n", pos)
                    n = int(buf[pos + 1:j])
                    if len(buf) < j + 2 + n + 2:
                        return out, buf
                    args.append(buf[j + 2:j + 2 + n])
                    pos = j + 2 + n + 2
            except ValueError:
                return out, buf
            out.append(args)
            buf = buf[pos:]
        return out, buf

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(0.1)
                buf = b""
                while not self.stop.is_set():
                    try:
                        data = conn.recv(65536)
                    except socket.timeout:
                        continue
                    except OSError:
                        break
                    if not data:
                        break
                    commands, buf = self._commands(buf + data)
                    for args in commands:
                        name = args[0].upper()
                        conn.sendall(b"%1\r\n$5\r\nproto\r\n:3\r\n" if name == b"HELLO" else
                                     self.reply if name == b"GET" else b"+OK\r\n")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.listener.close()


@pytest.mark.parametrize("reply", [b":5\r\n", b"*1\r\n$1\r\na\r\n", b"%1\r\n+a\r\n+b\r\n"],
                         ids=["integer", "array", "map"])
def test_remote_non_bulk_reply_is_a_counted_miss(reply: bytes) -> None:
    pytest.importorskip("redis")
    from pagedkv.tiers import RemoteStore

    server = _FakeRedis(reply)
    try:
        with RemoteStore(server.url, FP, DISK_BLOCK, timeout_s=2.0, backoff_s=0,
                         secret=SECRET) as s:
            assert s.get_async(GENUINE).result(10) is None
            assert s.get(GENUINE) is None
            st_ = s.stats()
            assert st_.misses == 2 and st_.hits == 0 and st_.corrupt == 2
    finally:
        server.close()


# ====================================================================== the router's index

#: Hashes the model tracks; the wire forms below spell each of them several ways.
_POOL = [0, 1, 7, (1 << 64) - 1, (1 << 64), U128]
#: Hashes no prompt can have (outside [0, 2**128)): the index must not keep them.
_OUTSIDE = [-1, -(1 << 63), 1 << 128, (1 << 200) + 5]


@st.composite
def _wire_hash(draw: Any) -> Tuple[Any, Optional[int]]:
    """``(wire form, index key or None)``."""
    if draw(st.integers(0, 5)) == 0:
        h = draw(st.sampled_from(_OUTSIDE))
        if h >= 0 and draw(st.booleans()):
            return h.to_bytes((h.bit_length() + 7) // 8, "big"), None
        return h, None
    h = draw(st.sampled_from(_POOL))
    form = draw(st.integers(0, 2))
    if form == 0:
        return h, h
    pad = draw(st.integers(0, 4)) if form == 2 else 0  # leading zero bytes: the same number
    return b"\x00" * pad + h.to_bytes(16, "big"), h


_media = st.one_of(st.none(), st.sampled_from(["", "GPU", "CPU", "STORAGE"]), st.text(max_size=4))


@st.composite
def _index_ops(draw: Any) -> List[Tuple[Any, ...]]:
    ops = []
    for _ in range(draw(st.integers(0, 25))):
        kind = draw(st.sampled_from(["stored", "removed", "cleared", "clear"]))
        replica = draw(st.integers(0, 2))
        hashes = draw(st.lists(_wire_hash(), max_size=5))
        ops.append((kind, replica, hashes, draw(_media), draw(st.integers(-3, 1 << 40))))
    return ops


def _model_apply(model: Dict[Tuple[int, int], Set[str]], op: Tuple[Any, ...]) -> None:
    kind, r, hashes, medium, _bs = op
    keys = [k for _, k in hashes if k is not None]
    if kind == "stored":
        from pagedkv.router.index import MAX_TIERS_PER_REPLICA

        live = {t for (mr, _h), ts in model.items() if mr == r for t in ts}
        if (medium or "GPU") not in live and len(live) >= MAX_TIERS_PER_REPLICA:
            return  # one tier too many: not indexed
        for h in keys:
            model.setdefault((r, h), set()).add(medium or "GPU")
    elif kind == "removed":
        for h in keys:
            tiers = model.get((r, h))
            if tiers is None:
                continue
            if medium is None:
                tiers.clear()
            else:
                tiers.discard(medium or "GPU")
            if not tiers:
                del model[(r, h)]
    else:
        for key in [k for k in model if k[0] == r]:
            del model[key]


def _event(events: Any, op: Tuple[Any, ...]) -> Any:
    kind, _r, hashes, medium, block_size = op
    wires = [w for w, _ in hashes]
    if kind == "stored":
        return events.BlockStored(block_hashes=wires, parent_block_hash=None, token_ids=[],
                                  block_size=block_size, lora_id=None, medium=medium,
                                  lora_name=None)
    if kind == "removed":
        return events.BlockRemoved(block_hashes=wires, medium=medium)
    return events.AllBlocksCleared()


def _check_against_model(index: Any, model: Dict[Tuple[int, int], Set[str]]) -> None:
    for r in range(3):
        assert index.blocks(r) == sum(1 for (mr, _h) in model if mr == r)
        for h in _POOL + _OUTSIDE:
            assert index.tiers(r, h) == model.get((r, h), set())
    for start in range(len(_POOL)):
        chain = _POOL[start:]
        want: Dict[int, int] = {}
        for r in range(3):
            n = 0
            while n < len(chain) and (r, chain[n]) in model:
                n += 1
            if n:
                want[r] = n
        assert index.match(chain) == want
    # Nothing left behind by add/remove cycles (no empty tier maps).
    assert all(all(rep.tiers.values()) for rep in index._replicas.values())


@settings(max_examples=200, deadline=None)
@given(ops=_index_ops(), batch_size=st.integers(1, 4))
def test_index_follows_its_model_under_any_events(ops: List[Tuple[Any, ...]],
                                                  batch_size: int) -> None:
    """Any mix of stored/removed/cleared events in any wire form of a hash, any medium (None,
    empty, unknown), removals of blocks never stored: the index equals a reference model, keeps no
    hash outside [0, 2**128), and never leaves empty entries behind."""
    events = _events()
    from pagedkv.router import PrefixIndex

    index = PrefixIndex()
    model: Dict[Tuple[int, int], Set[str]] = {}
    i = 0
    while i < len(ops):
        if ops[i][0] == "clear":
            index.clear(ops[i][1])
            _model_apply(model, ops[i])
            i += 1
        else:  # consecutive events of one replica go in one batch
            r = ops[i][1]
            batch = []
            while (i < len(ops) and len(batch) < batch_size and ops[i][0] != "clear"
                   and ops[i][1] == r):
                batch.append(_event(events, ops[i]))
                _model_apply(model, ops[i])
                i += 1
            index.apply(r, events.KVEventBatch(ts=0.0, events=batch))
        _check_against_model(index, model)


def test_index_growth_is_bounded_per_replica() -> None:
    """A replica that stores and never removes fills its own bound and no more: the oldest entries
    make room (so its latest blocks are indexed), the other replica keeps its own, hashes no
    prompt has and tiers past the bound are never kept."""
    events = _events()
    from pagedkv.router import PrefixIndex
    from pagedkv.router.index import ENTRY_BYTES, MAX_TIERS_PER_REPLICA

    with pytest.raises(InvalidArgumentError) as err:
        PrefixIndex(max_bytes_per_replica=ENTRY_BYTES - 1)
    assert err.value.fields["what"] == "max_bytes_per_replica" and str(ENTRY_BYTES - 1) in str(
        err.value)

    def stored(hashes: List[Any], medium: str = "GPU") -> Any:
        return events.KVEventBatch(ts=0.0, events=[events.BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=1, lora_id=None,
            medium=medium, lora_name=None)])

    index = PrefixIndex(max_bytes_per_replica=50 * ENTRY_BYTES)
    index.apply(1, stored(list(range(10_000_000, 10_000_010))))
    # Replica 0 stores 10 000 new blocks, one block in 1 000 tiers, and hashes no prompt has.
    index.apply(0, stored(list(range(10_000))))
    assert index.blocks(0) == 50 and index.match(list(range(9_950, 10_000))) == {0: 50}
    assert index.match([0]) == {}  # the oldest made room
    index.apply(0, events.KVEventBatch(ts=0.0, events=[events.BlockStored(
        block_hashes=[5_000_000], parent_block_hash=None, token_ids=[], block_size=1,
        lora_id=None, medium=f"T{k}", lora_name=None) for k in range(1_000)]))
    index.apply(0, stored([b"\x01" * 1_000, -1, 1 << 128]))
    # At the bound, each new lower-tier entry evicts the previous one, never a GPU entry twice.
    assert index.entries(0) == 50 and index.tiers(0, 5_000_000) == {"T999"}
    assert index.match(list(range(9_951, 10_000))) == {0: 49} and index.match([9_950]) == {}
    assert not index.refused
    # Below the bound, a replica has at most MAX_TIERS_PER_REPLICA tiers.
    roomy = PrefixIndex()
    roomy.apply(0, events.KVEventBatch(ts=0.0, events=[events.BlockStored(
        block_hashes=[5_000_000], parent_block_hash=None, token_ids=[], block_size=1,
        lora_id=None, medium=f"T{k}", lora_name=None) for k in range(1_000)]))
    assert len(roomy.tiers(0, 5_000_000)) == MAX_TIERS_PER_REPLICA
    assert roomy.refused[0] == 1_000 - MAX_TIERS_PER_REPLICA
    # The other replica is untouched and still has its own room.
    assert index.blocks(1) == 10 and not index.evicted.get(1)
    index.apply(1, stored(list(range(20_000_000, 20_000_005))))
    assert index.blocks(1) == 15
    # AllBlocksCleared frees all of it.
    index.apply(0, events.KVEventBatch(ts=0.0, events=[events.AllBlocksCleared()]))
    index.apply(0, stored(list(range(40_000, 40_050))))
    assert index.blocks(0) == 50 and index.blocks(1) == 15
    assert index.match(list(range(40_000, 40_050))) == {0: 50}


# ====================================================================== the router's event path

def _router(n: int = 2, **kw: Any) -> Any:
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    _events()
    from pagedkv.router import ReplicaSpec, Router

    specs = kw.pop("specs", None) or [ReplicaSpec(f"http://127.0.0.1:{9 + i}") for i in range(n)]
    return Router(specs, block_size=4, hash_seed=0x5EED, **kw)


PROMPT = [5 + (i % 40) for i in range(25)]


@settings(max_examples=150, deadline=None)
@given(envelopes=st.lists(_envelopes, max_size=4), ops=_index_ops())
def test_router_hostile_batches_of_one_replica_leave_the_other_and_placement_alone(
        envelopes: List[Any], ops: List[Tuple[Any, ...]]) -> None:
    """Whatever replica 0 publishes (decoded garbage, hostile structs: any block size, hash form,
    medium), replica 1's entries and the placement of a prompt only it caches do not move."""
    import msgspec

    from pagedkv import hash_prompt

    events = _events()
    router = _router()
    hashes = hash_prompt(PROMPT, 4, 0x5EED)
    sink = events.EventSink()
    sink.add_stored(hashes, None, PROMPT[:len(hashes) * 4], 4)
    router._on_batch(1, events.KVEventBatch(ts=0.0, events=sink.take()))
    before = (router.index.match(hashes), router.index.blocks(1),
              [router.index.tiers(1, h) for h in hashes])
    assert before[0] == {1: len(hashes)}
    batches = [b for b in (_check_decodes_or_refuses(events, msgspec.msgpack.encode(e))
                           for e in envelopes) if b is not None]
    batches += [events.KVEventBatch(ts=0.0, events=[_event(events, op)])
                for op in ops if op[0] != "clear"]
    last_size = None
    for batch in batches:
        router._on_batch(0, batch)
        for event in batch.events:
            if isinstance(event, events.BlockStored) and event.block_size != 4:
                last_size = event.block_size
    assert router.replicas[0].block_size_seen == last_size
    assert (router.index.match(hashes), router.index.blocks(1),
            [router.index.tiers(1, h) for h in hashes]) == before
    assert router.choose(PROMPT, None)[0] == 1
    assert router.replicas[1].block_size_seen is None


def test_router_subscriber_survives_malformed_frames() -> None:
    """The router's own path (Router.start -> EventSubscriber -> Router._on_batch -> index):
    malformed frames are counted and dropped, the index holds exactly the valid batch's blocks."""
    zmq = pytest.importorskip("zmq")
    events = _events()
    from pagedkv import hash_prompt
    from pagedkv.router import ReplicaSpec

    xpub = _xpub(zmq)
    router = _router(specs=[ReplicaSpec("http://127.0.0.1:9",
                                        xpub.getsockopt_string(zmq.LAST_ENDPOINT))])
    router.start()
    try:
        _await_subscription(xpub)
        hostile, n_shape, n_decode = _hostile_messages(events)
        for frames in hostile:
            xpub.send_multipart(frames)
        hashes = hash_prompt(PROMPT, 4, 0x5EED)
        sink = events.EventSink()
        sink.add_stored(hashes, None, PROMPT[:len(hashes) * 4], 4)
        xpub.send_multipart([b"", _seq(3), events.encode_batch(
            events.KVEventBatch(ts=0.0, events=sink.take()))])
        wait_for(lambda: router.index.blocks(0) == len(hashes))
        sub = router.replicas[0].subscriber
        assert sub.bad_payloads == n_shape + n_decode and sub.tracker.applied == 3
        assert router.index.match(hashes) == {0: len(hashes)}
    finally:
        router.close()
        xpub.close()
