"""pagedkv.vllm: the pagedkv-backed BlockPool behind vLLM's KVCacheManager.

Skips when vLLM is not importable (the project venv has no vLLM; scripts/test_vllm.sh adds it).
Each test drives the stock pool and the pagedkv pool through the same calls and compares what
vLLM can observe: block ids handed out, free order, cache hits, ref counts, hashes, events.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm.v1.core.block_pool", reason="vLLM is not installed")

from vllm.v1.core import kv_cache_coordinator  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

import pagedkv.vllm as pv  # noqa: E402
from pagedkv import errors  # noqa: E402
from pagedkv.vllm.pool import PagedKVBlockPool, StockBlockPool  # noqa: E402


def both(n: int = 8, caching: bool = True, events: bool = False) -> tuple[BlockPool, BlockPool]:
    return (
        StockBlockPool(n, caching, 16, enable_kv_cache_events=events),
        PagedKVBlockPool(n, caching, 16, enable_kv_cache_events=events),
    )


def observe(p: BlockPool) -> tuple[object, ...]:
    return (
        p.get_num_free_blocks(),
        [b.block_id for b in p.free_block_queue.get_all_free_blocks()],
        [b.ref_cnt for b in p.blocks],
        [b.block_hash for b in p.blocks],
        round(p.get_usage(), 9),
    )


def key(i: int, g: int = 0) -> bytes:
    return make_block_hash_with_group_id(bytes([i]) * 32, g)


def test_same_observable_state_as_stock() -> None:
    for caching in (True, False):
        s, q = both(caching=caching)
        assert q.null_block.block_id == 0 and q.null_block.is_null
        assert observe(s) == observe(q)
        for p in (s, q):
            a = p.get_new_blocks(4)
            if caching:  # vLLM's managers never key blocks with caching off
                p._insert_block_hash(key(1), a[0], num_tokens=16)
                p._insert_block_hash(key(2), a[1], num_tokens=32)
            p.free_blocks([a[3], a[0], a[2], a[1]])
            p.touch([p.blocks[2], p.null_block])
            p.get_new_blocks(3)
        assert observe(s) == observe(q)
        assert [b.block_id for b in s.get_cached_block(bytes([2]) * 32, [0]) or []] == [
            b.block_id for b in q.get_cached_block(bytes([2]) * 32, [0]) or []
        ]
        q.check_coherence()


def test_eviction_emits_the_same_events() -> None:
    s, q = both(n=4, events=True)
    for p in (s, q):
        a = p.get_new_blocks(3)
        for i, b in enumerate(a):
            p._insert_block_hash(key(i), b, num_tokens=16 * (i + 1))
        p.free_blocks(a)
        p.get_new_blocks(2)  # evicts the two least recently freed
    assert [repr(e) for e in s.take_events()] == [repr(e) for e in q.take_events()]
    assert q.get_cached_block(bytes([2]) * 32, [0]) == [q.blocks[3]]
    q.check_coherence()


def test_direct_retain_stays_coherent_and_zero_is_refused() -> None:
    q = PagedKVBlockPool(4, True, 16)
    (b,) = q.get_new_blocks(1)
    b.ref_cnt += 1  # what vLLM's managers do for copy-on-write endpoints
    assert q._core.ref_count(b.block_id) == 2
    q.free_blocks([b, b])
    assert b.ref_cnt == 0 and q.get_num_free_blocks() == 3
    with pytest.raises(errors.InvalidArgumentError):
        b.ref_cnt = 5  # a free block's count moves only through the pool
    with pytest.raises(ValueError):
        q.get_new_blocks(4)
    q.check_coherence()


def test_reset_and_evict_blocks() -> None:
    q = PagedKVBlockPool(4, True, 16, enable_kv_cache_events=True)
    a = q.get_new_blocks(2)
    q._insert_block_hash(key(5), a[0], num_tokens=16)
    assert not q.reset_prefix_cache()
    q.evict_blocks({a[0].block_id})
    assert a[0].block_hash is None and len(q.cached_block_hash_to_block) == 0
    q._insert_block_hash(key(5), a[0], num_tokens=16)
    q.free_blocks(a)
    assert q.reset_prefix_cache()
    assert all(b.block_hash is None for b in q.blocks) and not q.cached_block_hash_to_block
    q.check_coherence()


def test_activation_rebinds_the_coordinator_and_back() -> None:
    original = kv_cache_coordinator.BlockPool
    try:
        os.environ["PAGEDKV_VLLM_POOL"] = "0"
        pv.register()
        assert kv_cache_coordinator.BlockPool is original
        os.environ["PAGEDKV_VLLM_POOL"] = "1"
        pv.register()
        assert pv.is_active() and kv_cache_coordinator.BlockPool is PagedKVBlockPool
    finally:
        os.environ.pop("PAGEDKV_VLLM_POOL", None)
        pv.deactivate()
    assert kv_cache_coordinator.BlockPool is original
