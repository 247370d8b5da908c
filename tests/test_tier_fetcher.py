"""TierFetcher: a request's prefix located and fetched across real tiers (two disk stores, and a
disk store in front of a real redis-server)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pagedkv.errors import InvalidArgumentError, InvalidConfigError
from pagedkv.tiers import BlockMeta, DiskStore, RemoteStore, TierFetcher, fingerprint
from pagedkv.tiers.secret import TierSecret

FP = fingerprint("test/tiny-llama", "bfloat16", 16, 2, 2, 8)
BLOCK = 8192
TOKENS = 16
SECRET = TierSecret(b"test fleet secret of at least 32 bytes", source="test")


def meta(i: int) -> BlockMeta:
    return BlockMeta((0x9E3779B97F4A7C15 * (i + 1)) % (1 << 128), None, 7, [i * TOKENS + t for t in range(TOKENS)])


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def disk(path: "os.PathLike[str]") -> DiskStore:
    return DiskStore(path, 32 * 12288, FP, BLOCK, max_tokens=TOKENS)


def buffers(n: int) -> list[np.ndarray]:
    return [np.zeros(BLOCK, np.uint8) for _ in range(n)]


def test_prefix_split_across_tiers_is_fetched_and_promoted(tmp_path):
    fast, slow = disk(tmp_path / "fast"), disk(tmp_path / "slow")
    for i in (0, 1, 2, 5):
        fast.put(meta(i), payload(i))
    for i in (2, 3, 4, 5, 7):
        slow.put(meta(i), payload(i))
    metas = [meta(i) for i in range(8)]
    with TierFetcher([fast, slow]) as f:
        # The slow tier's run from block 3 covers 5 too; 6 is missing everywhere.
        assert f.locate([m.block_hash for m in metas]) == [0, 0, 0, 1, 1, 1]
        outs = buffers(8)
        assert f.fetch_into(metas, outs).result() == 6
        assert all(outs[i].tobytes() == payload(i) for i in range(6))
        assert not outs[6].any() and not outs[7].any()  # past the prefix: nothing read
        st = f.stats()
        assert (st.fetched, st.failed, st.promoted) == ([3, 3], 0, 3)
    fast.close()  # finishes the promotions' writes
    with disk(tmp_path / "fast") as again:
        assert again.longest_prefix([m.block_hash for m in metas]) == 6
    slow.close()


def test_a_block_that_fails_its_check_ends_the_prefix(tmp_path):
    with disk(tmp_path / "d") as d:
        for i in range(4):
            d.put(meta(i), payload(i))
        seg = [n for n in os.listdir(tmp_path / "d") if n.endswith(".pkv")][0]
        with open(tmp_path / "d" / seg, "r+b") as fh:  # corrupt block 1's payload (slot 1)
            fh.seek(12288 + 500)
            fh.write(b"\xde\xad")
        with TierFetcher([d], promote=False) as f:
            outs = buffers(4)
            assert f.fetch_into([meta(i) for i in range(4)], outs).result() == 1
            assert outs[0].tobytes() == payload(0)
            assert f.stats().failed == 1 and d.stats().corrupt == 1
            # The corrupt block is gone, so the next lookup stops before it.
            assert f.locate([meta(i).block_hash for i in range(4)]) == [0]


def test_disk_in_front_of_a_shared_remote(tmp_path, redis_server):
    other_engine = RemoteStore(redis_server.url, FP, BLOCK, secret=SECRET)
    for i in range(5):
        other_engine.put(meta(i), payload(i))
    local = disk(tmp_path / "d")
    local.put(meta(0), payload(0))
    remote = RemoteStore(redis_server.url, FP, BLOCK, timeout_s=0.05, backoff_s=60, secret=SECRET)
    with TierFetcher([local, remote]) as f:
        outs = buffers(6)
        assert f.fetch_into([meta(i) for i in range(6)], outs).result() == 5
        assert all(outs[i].tobytes() == payload(i) for i in range(5))
        assert f.stats().fetched == [1, 4]
        local.close()
        local = disk(tmp_path / "d")
        f.tiers[0] = local
        redis_server.kill()
        # The server is gone; the promoted blocks are now local, and nothing raises.
        outs = buffers(6)
        assert f.fetch_into([meta(i) for i in range(6)], outs).result() == 5
        assert all(outs[i].tobytes() == payload(i) for i in range(5))
        assert remote.stats().errors + remote.stats().timeouts >= 1
    local.close(), remote.close(), other_engine.close()


def test_spill_writes_every_tier_and_arguments_are_checked(tmp_path):
    a, b = disk(tmp_path / "a"), disk(tmp_path / "b")
    with TierFetcher([a, b]) as f:
        assert [x.result() for x in f.spill(meta(3), payload(3))] == [True, True]
        assert a.get(meta(3)) == payload(3) == b.get(meta(3))
        with pytest.raises(InvalidArgumentError, match=r"one buffer per block: 2 blocks, 1 buffers"):
            f.fetch_into([meta(0), meta(1)], buffers(1))
        with pytest.raises(InvalidArgumentError, match=r"each out must be a writable buffer of 8192 bytes, got 10"):
            f.fetch_into([meta(0)], [bytearray(10)])
        with pytest.raises(InvalidArgumentError, match=r"read-only"):
            f.fetch_into([meta(0)], [payload(0)])
    with pytest.raises(InvalidConfigError, match=r"at least one tier"):
        TierFetcher([])
    with DiskStore(tmp_path / "c", 1 << 20, FP, 4096) as c:
        with pytest.raises(InvalidConfigError, match=r"one size, got \[4096, 8192\]"):
            TierFetcher([a, c])
    a.close(), b.close()


def test_fetch_after_close_raises_store_closed(tmp_path):
    from pagedkv.tiers import StoreClosedError

    with disk(tmp_path / "d") as d:
        f = TierFetcher([d])
        f.close()
        with pytest.raises(StoreClosedError, match=r"is closed"):
            f.fetch_into([meta(0)], buffers(1))


def test_host_pool_blocks_round_trip_through_the_tiers(tmp_path):
    """A real host tier: blocks spilled from HostKVPool slots come back verbatim into other slots."""
    torch = pytest.importorskip("torch")
    from pagedkv.config import CacheSpec
    from pagedkv.swap import HostKVPool
    from pagedkv.tiers import fingerprint_for_spec

    spec = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_size=16)
    host = HostKVPool(spec, 8, pin_memory=False)
    torch.manual_seed(0)
    host.kv.copy_(torch.randn(host.kv.shape).to(host.kv.dtype))
    fp = fingerprint_for_spec("test/tiny-llama", spec)
    metas = [BlockMeta(1000 + i, 999 + i if i else None, 7, list(range(16 * i, 16 * i + 16))) for i in range(3)]
    with DiskStore(tmp_path / "d", 1 << 20, fp, spec.bytes_per_block, max_tokens=16) as d, TierFetcher([d]) as f:
        for i, m in enumerate(metas):
            assert all(x.result() for x in f.spill(m, host.raw[i].numpy()))
        outs = [host.raw[5 + i].numpy() for i in range(3)]
        assert f.fetch_into(metas, outs).result() == 3
        assert torch.equal(host.kv[5:8].view(torch.int16), host.kv[0:3].view(torch.int16))
