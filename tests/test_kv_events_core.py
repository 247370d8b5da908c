"""The core's KV-event ring through the binding (``_core.BlockManager``): what is recorded when
blocks enter and leave the prefix cache, the tuple shape, coalescing of a chain, the overflow
policy (oldest dropped, counted) and the disabled default.

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
    assert ev == [("stored", "GPU", h, None, toks[:8], B)]
    assert m.drain_kv_events() == [], "drain empties the ring"
    # The chain grows: the next block's event names its parent.
    m.append(1, [1, 2, 3])
    m.step([1], [3])
    h2 = hashes(toks + [1, 2, 3])
    assert m.drain_kv_events() == [("stored", "GPU", [h2[2]], h2[1], toks[8:] + [1, 2, 3], B)]
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
    assert ev == [("removed", "GPU", [h[1], h[0]], None, [], B)]
    m.step([2], [13])
    m.drain_kv_events()
    assert m.reset_prefix_cache() == 3
    assert m.drain_kv_events() == [("cleared", "GPU", [], None, [], B)]


def test_overflow_drops_the_oldest_and_counts() -> None:
    m, _ = make(num_blocks=16, cap=2)
    toks = list(range(17))  # four full blocks: four records in a ring of two
    m.admit(1, toks)
    m.step([1], [17])
    assert m.kv_events_dropped == 2
    h = hashes(toks)
    # The newest two survive, still one chain with the surviving first block's parent.
    assert m.drain_kv_events() == [("stored", "GPU", h[2:], h[1], toks[8:16], B)]


def test_swap_out_removes_and_swap_in_stores_again() -> None:
    m, _ = make(num_blocks=8, num_host_blocks=8)
    toks = list(range(9))
    m.admit(1, toks)
    m.step([1], [9])
    m.drain_kv_events()
    m.swap_out([1])
    h = hashes(toks)
    assert m.drain_kv_events() == [("removed", "GPU", [h[1], h[0]], None, [], B)]
    m.swap_in([1])
    assert m.drain_kv_events() == [("stored", "GPU", h, None, toks[:8], B)]


def test_capacity_is_validated() -> None:
    with pytest.raises(InvalidConfigError, match="kv_event_capacity"):
        _core.BlockManager(8, B, kv_event_capacity=1 << 30)
    with pytest.raises(InvalidArgumentError, match="kv_event_capacity"):
        _core.BlockManager(8, B, kv_event_capacity=-1)
