"""The core's KV-event ring through the binding (``_core.BlockManager``): what is recorded when
blocks enter and leave the prefix cache, the tuple shape, coalescing of a chain, the overflow
policy (oldest dropped, counted), the disabled default, and the group each event names with
several KV cache groups (a sliding group's block released mid-run and evicted later is removed
for that group, and the stream adds up to ``cached_block_keys()``).

Hashes are checked against ``_core.hash_blocks`` under the same ``hash_seed``: the events name the
same u128 prefix hashes the manager keys its cache with.
"""

from __future__ import annotations

import pytest

from pagedkv import StepBuffers, _core
from pagedkv.errors import InvalidArgumentError, InvalidConfigError

B = 4
SEED = 7


def make(num_blocks: int = 8, cap: int = 64, **kw: object) -> tuple[_core.BlockManager, StepBuffers]:
    m = _core.BlockManager(num_blocks, B, 0, hash_seed=SEED, kv_event_capacity=cap, **kw)
    bufs = StepBuffers(8, 256, 16, device="cpu")
    m.attach_buffers(bufs._arena)
    return m, bufs


def hashes(tokens: list[int]) -> list[int]:
    return [int.from_bytes(h, "little") for h in _core.hash_blocks(tokens, B, hash_seed=SEED)]


def test_disabled_by_default_records_nothing() -> None:
    m = _core.BlockManager(8, B, 0, hash_seed=SEED)
    bufs = StepBuffers(8, 256, 16, device="cpu")
    m.attach_buffers(bufs._arena)
    assert m.kv_event_capacity == 0
    m.admit(1, list(range(9)))
    m.step([1], [9])
    m.reset_prefix_cache()
    assert m.drain_kv_events() == []
    assert m.kv_events_dropped == 0


def test_stored_on_step_as_one_chain_event() -> None:
    m, _ = make()
    toks = list(range(100, 109))  # two full blocks and one token
    m.admit(1, toks)
    # Registration happens at step time: nothing yet.
    assert m.drain_kv_events() == []
    m.step([1], [9])
    ev = m.drain_kv_events()
    h = hashes(toks)
    assert ev == [("stored", "GPU", h, None, toks[:8], B, 0)]
    assert m.drain_kv_events() == [], "drain empties the ring"
    # The chain grows: the next block's event names its parent.
    m.append(1, [1, 2, 3])
    m.step([1], [3])
    h2 = hashes(toks + [1, 2, 3])
    assert m.drain_kv_events() == [("stored", "GPU", [h2[2]], h2[1], toks[8:] + [1, 2, 3], B, 0)]
    assert all(isinstance(x, int) and x >= 0 for x in h2)


def test_removed_on_eviction_and_cleared_on_reset() -> None:
    m, _ = make(num_blocks=4)
    a = list(range(9))
    m.admit(1, a)
    m.step([1], [9])
    m.free(1)
    m.drain_kv_events()
    # A 4-block prompt of other tokens takes the two free blocks, then evicts both cached-free
    # ones (the tail first: LRU order).
    b = list(range(50, 63))
    m.admit(2, b)
    ev = m.drain_kv_events()
    h = hashes(a)
    assert ev == [("removed", "GPU", [h[1], h[0]], None, [], B, 0)]
    m.step([2], [13])
    m.drain_kv_events()
    assert m.reset_prefix_cache() == 3
    assert m.drain_kv_events() == [("cleared", "GPU", [], None, [], B, 0)]


def test_overflow_drops_the_oldest_and_counts() -> None:
    m, _ = make(num_blocks=16, cap=2)
    toks = list(range(17))  # four full blocks: four records in a ring of two
    m.admit(1, toks)
    m.step([1], [17])
    assert m.kv_events_dropped == 2
    h = hashes(toks)
    # The newest two survive, still one chain with the surviving first block's parent.
    assert m.drain_kv_events() == [("stored", "GPU", h[2:], h[1], toks[8:16], B, 0)]


def test_swap_out_removes_and_swap_in_stores_again() -> None:
    m, _ = make(num_blocks=8, num_host_blocks=8)
    toks = list(range(9))
    m.admit(1, toks)
    m.step([1], [9])
    m.drain_kv_events()
    m.swap_out([1])
    h = hashes(toks)
    assert m.drain_kv_events() == [("removed", "GPU", [h[1], h[0]], None, [], B, 0)]
    m.swap_in([1])
    assert m.drain_kv_events() == [("stored", "GPU", h, None, toks[:8], B, 0)]


def test_capacity_is_validated() -> None:
    with pytest.raises(InvalidConfigError, match="kv_event_capacity"):
        _core.BlockManager(8, B, kv_event_capacity=1 << 30)
    with pytest.raises(InvalidArgumentError, match="kv_event_capacity"):
        _core.BlockManager(8, B, kv_event_capacity=-1)


def test_groups_name_their_blocks_and_balance_with_the_cache() -> None:
    from pagedkv import BlockManager, KVCacheGroup

    groups = [KVCacheGroup.full(), KVCacheGroup.sliding(4)]
    m = BlockManager(24, B, watermark_blocks=0, hash_seed=SEED, kv_event_capacity=256,
                     groups=groups)
    buf = StepBuffers(4, 64, 16, num_groups=2, backend="numpy", device="cpu")
    m.attach_buffers(buf)
    held: set[tuple[int, int]] = set()

    def drain() -> list[tuple]:
        ev = m.drain_kv_events()
        for kind, medium, hs, _, _, _, g in ev:
            assert medium == "GPU"
            if kind == "stored":
                assert not held & {(g, h) for h in hs}
                held.update((g, h) for h in hs)
            elif kind == "removed":
                assert {(g, h) for h in hs} <= held
                held.difference_update((g, h) for h in hs)
            else:
                held.clear()
        assert sorted(held) == m.cached_block_keys()
        return ev

    toks = list(range(100, 124))  # six blocks, prefilled in three steps of 8
    h = hashes(toks)
    m.admit(1, toks[:8])
    m.step([1], [8])
    assert drain() == [("stored", "GPU", h[:2], None, toks[:8], B, 0),
                       ("stored", "GPU", h[:2], None, toks[:8], B, 1)]
    for k in (8, 16):
        m.append(1, toks[k:k + 8])
        m.step([1], [8])
    drain()
    assert m.block_table(1, 1)[:3] == [-1] * 3, "the sliding group released blocks 0..2"
    # A cold prompt takes every free block and evicts released sliding blocks only: removals
    # of group 1, while group 0 still holds the chain.
    st = m.stats()
    assert (st.cached_free_blocks, st.free_blocks % 2) == (3, 0)
    # (free + 2) / 2 blocks in each of the two groups.
    m.admit(2, list(range(500, 500 + B * (st.free_blocks + 2) // 2)))
    assert m.stats().evictions == 2
    ev = drain()
    assert [(e[0], e[6]) for e in ev] == [("removed", 1)]
    assert set(ev[0][2]) <= set(h[:3]) and len(ev[0][2]) == 2
    assert {(0, x) for x in h} <= held
    m.free(1)
    m.free(2)
    drain()
    m.check_invariants()
    m.reset_prefix_cache()
    assert drain() == [("cleared", "GPU", [], None, [], B, 0)]
