"""The keyed pool's batch calls the offloading manager uses (``KeyedBlockPool.lookup_many`` and
``insert_many``), without vLLM: same answers as the one-key calls, all-or-nothing inserts, typed
errors naming the bad element."""

from __future__ import annotations

import pytest

from pagedkv._core import KeyedBlockPool
from pagedkv.errors import InvalidArgumentError, InvalidBlockError


def test_lookup_many_matches_lookup() -> None:
    p = KeyedBlockPool(8, reserve_null=False)
    p.insert(b"a", 3)
    p.insert(b"b", 5)
    p.insert(b"b", 6)  # several blocks under a key: the first answers
    keys = [b"a", b"x", b"b", b"a"]
    assert p.lookup_many(keys) == [p.lookup(k) for k in keys] == [3, None, 5, 3]
    assert p.lookup_many(iter([b"b"])) == [5]
    assert p.lookup_many([]) == []


def test_insert_many_counts_new_pairs() -> None:
    p = KeyedBlockPool(8, reserve_null=False)
    blocks, _ = p.allocate(3)
    assert p.insert_many([b"a", b"b", b"c"], blocks) == 3
    assert p.insert_many([b"a", b"d"], [blocks[0], blocks[1]]) == 1  # (a, b0) already there
    assert p.keys_of(blocks[1]) == [b"b", b"d"]
    p.check_invariants()


def test_insert_many_is_all_or_nothing() -> None:
    p = KeyedBlockPool(4)  # block 0 is the null block: not keyable
    p.insert(b"old", 1)
    before = p.entries()
    with pytest.raises(InvalidBlockError):
        p.insert_many([b"a", b"b", b"c"], [2, 3, 9])
    assert p.entries() == before
    with pytest.raises(InvalidArgumentError):
        p.insert_many([b"a", b"b"], [2, 0])
    assert p.entries() == before
    with pytest.raises(InvalidArgumentError) as e:
        p.insert_many([b"a"], [2, 3])
    assert "2 blocks for 1 keys" in str(e.value)
    with pytest.raises(InvalidArgumentError) as e:
        p.insert_many([b"a", "b"], [2, 3])  # type: ignore[list-item]
    assert "element 1" in str(e.value) and "bytes" in str(e.value)
    with pytest.raises(InvalidArgumentError):
        p.lookup_many([b"a", 7])  # type: ignore[list-item]
    assert p.entries() == before
    p.check_invariants()
