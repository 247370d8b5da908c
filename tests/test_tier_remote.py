"""The remote tier (pagedkv.tiers.RemoteStore) against a real redis-server on loopback.

The ``redis_server`` fixture (tests/conftest.py, tests/redis_server.py) starts a fresh server per
test; the tests kill, pause and restart it to check that a failing server only ever costs counted
misses, never an exception or wrong bytes, and that the store comes back with the server.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from pagedkv.errors import InvalidArgumentError, InvalidConfigError
from pagedkv.tiers import BlockMeta, Reason, RemoteStore, fingerprint
from pagedkv.tiers.record import encode, record_size

from pagedkv.tiers.secret import TierSecret

FP = fingerprint("test/tiny-llama", "bfloat16", 16, 2, 2, 8)
SECRET = TierSecret(b"test fleet secret of at least 32 bytes", source="test")
OTHER_FP = fingerprint("test/tiny-llama", "bfloat16", 16, 2, 2, 8, tp_rank=1, tp_size=2)
BLOCK = 8192
TOKENS = 16


def meta(i: int, salt: int = 7) -> BlockMeta:
    return BlockMeta(
        block_hash=(0x9E3779B97F4A7C15 * (i + 1)) % (1 << 128), parent_hash=None, salt_digest=salt,
        token_ids=[(i * TOKENS + t) % 50_000 for t in range(TOKENS)],
    )


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def raw_client(server):
    import redis

    return redis.Redis.from_url(server.url)


def wait_until(predicate, limit_s: float = 10.0) -> bool:
    """Poll ``predicate`` (a recovery, not a timing assertion) until true or ``limit_s`` passed."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_round_trip_keys_and_ttl(redis_server):
    with RemoteStore(redis_server.url, FP, BLOCK, secret=SECRET) as s:
        assert s.get(meta(0)) is None and s.stats().misses == 1
        assert s.put(meta(0), payload(0))
        assert s.put_async(meta(1), np.frombuffer(payload(1), np.uint8)).result()
        assert s.get(meta(0)) == payload(0) and s.get_async(meta(1)).result() == payload(1)
        out = np.zeros(BLOCK, np.uint8)
        assert s.get_into(meta(1), out) and out.tobytes() == payload(1)
        assert s.get_into_async(meta(0), out).result() and out.tobytes() == payload(0)
        assert s.contains(meta(0).block_hash) and not s.contains(meta(2).block_hash)
        assert s.longest_prefix([meta(0).block_hash, meta(1).block_hash, meta(2).block_hash]) == 2
        assert s.longest_prefix([meta(2).block_hash, meta(0).block_hash]) == 0
        st = s.stats()
        assert (st.hits, st.misses, st.puts, st.errors, st.timeouts) == (4, 1, 2, 0, 0)
        assert st.bytes_written == 2 * record_size(TOKENS, BLOCK) and st.usage_bytes is None
        key = s.key(meta(0).block_hash)
        assert key == f"pagedkv:{FP.hex()}:{SECRET.key_id}:{meta(0).block_hash:032x}".encode()
        client = raw_client(redis_server)
        assert client.get(key) == encode(FP, meta(0), payload(0), secret=SECRET)
        assert client.ttl(key) == -1  # no expiry unless asked
        assert s.remove(meta(0).block_hash) and not s.contains(meta(0).block_hash)
    with RemoteStore(redis_server.url, FP, BLOCK, secret=SECRET, ttl_s=30) as s:
        s.put(meta(5), payload(5))
        assert 0 < raw_client(redis_server).pttl(s.key(meta(5).block_hash)) <= 30_000


def test_two_engines_share_one_server(redis_url):
    a = RemoteStore(redis_url, FP, BLOCK, secret=SECRET)
    b = RemoteStore(redis_url, FP, BLOCK, secret=SECRET)
    other = RemoteStore(redis_url, OTHER_FP, BLOCK, secret=SECRET)
    try:
        for i in range(4):
            a.put(meta(i), payload(i))
        assert b.longest_prefix([meta(i).block_hash for i in range(6)]) == 4
        assert [b.get(meta(i)) == payload(i) for i in range(4)] == [True] * 4
        b.put(meta(9), payload(9))
        assert a.get(meta(9)) == payload(9)
        # Another layout (here: another TP rank) has its own namespace.
        assert other.get(meta(0)) is None and other.longest_prefix([meta(0).block_hash]) == 0
        # Another tenant's salt under the same hash is a mismatch, and the block survives it.
        assert b.get(meta(0, salt=8)) is None and b.stats().mismatched == 1
        assert a.get(meta(0)) == payload(0)
    finally:
        a.close(), b.close(), other.close()


def test_corrupted_value_is_a_miss_and_is_deleted(redis_server):
    client = raw_client(redis_server)
    with RemoteStore(redis_server.url, FP, BLOCK, secret=SECRET) as s:
        s.put(meta(0), payload(0))
        s.put(meta(1), payload(1))
        key = s.key(meta(0).block_hash)
        value = bytearray(client.get(key))
        value[5000] ^= 0x01
        client.set(key, bytes(value))
        assert s.get(meta(0)) is None
        assert s.stats().corrupt == 1 and client.exists(key) == 0
        client.set(s.key(meta(1).block_hash), encode(FP, meta(1), payload(1), secret=SECRET)[:-300])  # truncated
        assert s.get(meta(1)) is None and s.stats().corrupt == 2
        client.set(s.key(meta(2).block_hash), encode(OTHER_FP, meta(2), payload(2), secret=SECRET))
        assert s.get(meta(2)) is None and s.stats().foreign == 1
        client.set(s.key(meta(3).block_hash), b"not a record")
        assert s.get(meta(3)) is None and s.stats().corrupt == 3
        assert (s.stats().hits, s.stats().errors) == (0, 0)


def test_killed_server_degrades_to_misses_then_recovers_on_restart(redis_server):
    with RemoteStore(redis_server.url, FP, BLOCK, secret=SECRET, timeout_s=0.05, backoff_s=0.2) as s:
        s.put(meta(0), payload(0))
        assert s.get(meta(0)) == payload(0)
        redis_server.kill()
        assert s.get(meta(0)) is None  # the failing call: an error, not an exception
        st = s.stats()
        assert st.errors + st.timeouts == 1 and st.misses == 1
        # Backing off: nothing touches the network, every call is a counted miss.
        assert not s.put(meta(1), payload(1))
        assert not s.contains(meta(0).block_hash) and s.longest_prefix([meta(0).block_hash]) == 0
        assert s.get_async(meta(0)).result() is None
        st = s.stats()
        assert st.errors + st.timeouts == 1 and st.unavailable == 4 and st.dropped == 1
        redis_server.start()  # same port, empty (no persistence)
        assert wait_until(lambda: s.put(meta(2), payload(2)))
        assert s.get(meta(2)) == payload(2) and s.get(meta(0)) is None


def test_paused_server_times_out_within_the_bound(redis_server):
    """A server that accepts connections but never answers: a timeout, then back-off."""
    with RemoteStore(redis_server.url, FP, BLOCK, secret=SECRET, timeout_s=0.05, backoff_s=0.2) as s:
        s.put(meta(0), payload(0))
        redis_server.pause()
        try:
            assert s.get(meta(0)) is None
            assert s.stats().timeouts == 1
            assert s.get(meta(0)) is None and s.stats().unavailable == 1
        finally:
            redis_server.resume()
        assert wait_until(lambda: s.get(meta(0)) == payload(0))


def test_bad_arguments_raise_typed_errors(redis_server):
    with pytest.raises(InvalidConfigError, match=r"timeout_s must be a positive number of seconds, got 0"):
        RemoteStore(redis_server.url, FP, BLOCK, secret=SECRET, timeout_s=0)
    with pytest.raises(InvalidConfigError, match=r"ttl_s"):
        RemoteStore(redis_server.url, FP, BLOCK, secret=SECRET, ttl_s=-1)
    with pytest.raises(InvalidConfigError, match=r"fingerprint must be 16 bytes"):
        RemoteStore(redis_server.url, b"x", BLOCK, secret=SECRET)
    with pytest.raises(InvalidConfigError, match=r"remote url 'http://x' is not a Redis URL"):
        RemoteStore("http://x", FP, BLOCK, secret=SECRET)
    with pytest.raises(InvalidConfigError, match=r"remote url must be a non-empty string .* got None"):
        RemoteStore(None, FP, BLOCK, secret=SECRET)  # type: ignore[arg-type]
    with RemoteStore(redis_server.url, FP, BLOCK, secret=SECRET) as s:
        with pytest.raises(InvalidArgumentError, match=r"data holds 10 bytes; this store's blocks are 8192"):
            s.put(meta(0), b"0123456789")
        with pytest.raises(InvalidArgumentError, match=r"block hash must be an integer"):
            s.contains(1 << 128)
        assert s.stats().puts == 0 and not s.contains(meta(0).block_hash)


def test_reason_counters_cover_every_reason():
    assert {r.counter for r in Reason} == {"hits", "corrupt", "foreign", "mismatched", "unauthenticated"}


def test_without_redis_py_the_error_names_the_extra(monkeypatch, tmp_path):
    import sys

    from pagedkv.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(MissingDependencyError, match=r"pip install '\.\[remote\]' in a clone"):
        RemoteStore("redis://127.0.0.1:1/0", FP, BLOCK, secret=SECRET)


def test_use_after_close_raises_store_closed(redis_server):
    from pagedkv.tiers import StoreClosedError

    s = RemoteStore(redis_server.url, FP, BLOCK, secret=SECRET)
    s.put(meta(0), payload(0))
    s.close()
    s.close()  # idempotent
    for call in (
        lambda: s.put(meta(1), payload(1)), lambda: s.get(meta(0)), lambda: s.get_async(meta(0)),
        lambda: s.contains(meta(0).block_hash), lambda: s.longest_prefix([meta(0).block_hash]),
        lambda: s.remove(meta(0).block_hash),
    ):
        with pytest.raises(StoreClosedError, match=r"RemoteStore\('redis://127.0.0.1:\d+/0'.*\) is closed"):
            call()
    assert raw_client(redis_server).exists(s.key(meta(0).block_hash)) == 1


def test_a_server_answering_garbage_is_a_counted_miss():
    """A TCP peer that is not Redis (it answers every request with bytes no RESP parser accepts)."""
    import socket
    import threading

    pytest.importorskip("redis")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    while conn.recv(65536):
                        conn.sendall(b"?garbage\r\n")
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with RemoteStore(f"redis://127.0.0.1:{port}/0", FP, BLOCK, secret=SECRET, timeout_s=0.5, backoff_s=60) as s:
            assert s.get(meta(0)) is None
            assert not s.put(meta(0), payload(0))
            st = s.stats()
            assert st.errors + st.timeouts == 1 and st.unavailable == 1 and st.misses == 1
    finally:
        stop.set()
        thread.join()
        listener.close()


def test_an_error_reply_fails_only_its_call(redis_server):
    """A full server (maxmemory reached, noeviction) refuses writes with -OOM but still serves reads:
    the put is a counted drop and the store does not back off."""
    with RemoteStore(redis_server.url, FP, BLOCK, secret=SECRET, backoff_s=60) as s:
        s.put(meta(0), payload(0))
        client = raw_client(redis_server)
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", "1")
        assert not s.put(meta(1), payload(1))
        st = s.stats()
        assert (st.errors, st.dropped, st.unavailable) == (1, 1, 0)
        assert s.get(meta(0)) == payload(0) and s.stats().unavailable == 0
