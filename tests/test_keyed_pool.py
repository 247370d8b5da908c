"""The extension's KeyedBlockPool (caller-keyed blocks), without vLLM: eviction order, revival,
keys shared by several blocks, typed errors that leave the pool unchanged, and a randomized
check against a plain-Python model."""

from __future__ import annotations

import random

import pytest

from pagedkv import errors
from pagedkv._core import KeyedBlockPool


def key(h: int, group: int = 0) -> bytes:
    return bytes([h]) * 8 + group.to_bytes(4, "big")


def test_null_block_reserved() -> None:
    p = KeyedBlockPool(4)
    assert p.null_block == 0 and p.num_free == 3 and p.free_order() == [1, 2, 3]
    p.touch([0])
    p.release([0])
    assert p.ref_count(0) == 0 and not p.is_free(0)
    assert KeyedBlockPool(1).num_free == 0
    assert KeyedBlockPool(3, reserve_null=False).free_order() == [0, 1, 2]


def test_placement_and_lru_eviction() -> None:
    p = KeyedBlockPool(6)
    ids, evicted = p.allocate(4)
    assert ids == [1, 2, 3, 4] and evicted == []
    assert p.insert(key(1), 1) and p.insert(key(2), 2)
    p.release([1, 3, 2, 4])  # 'cache': uncached to the front, cached to the back
    assert p.free_order() == [3, 4, 5, 1, 2]
    p.touch([2])  # a hit on a free cached block revives it
    assert p.free_order() == [3, 4, 5, 1] and p.ref_count(2) == 1
    ids, evicted = p.allocate(4)
    assert ids == [3, 4, 5, 1] and evicted == [1]
    assert p.lookup(key(1)) is None and p.lookup(key(2)) == 2
    assert p.stats()["evictions"] == 1 and p.stats()["revivals"] == 1
    p.check_invariants()


def test_front_and_back_modes() -> None:
    p = KeyedBlockPool(5)
    ids, _ = p.allocate(4)
    p.insert(key(9), 1)
    p.release([1, 2], "front")
    p.release([3, 4], "back")
    assert p.free_order() == [1, 2, 3, 4]
    with pytest.raises(errors.InvalidArgumentError):
        p.release([], "sideways")


def test_groups_and_shared_keys() -> None:
    p = KeyedBlockPool(5)
    a, _ = p.allocate(3)
    h = b"\x07" * 32
    assert p.insert(h + (0).to_bytes(4, "big"), a[0])
    assert p.insert(h + (0).to_bytes(4, "big"), a[1])
    assert not p.insert(h + (0).to_bytes(4, "big"), a[1])
    p.insert(h + (1).to_bytes(4, "big"), a[2])
    assert p.lookup_groups(h, [0, 1]) == [a[0], a[2]]
    assert p.lookup_groups(h, [0, 2]) is None
    assert p.entries()[h + (0).to_bytes(4, "big")] == [a[0], a[1]]
    assert p.keys_of(a[2]) == [h + (1).to_bytes(4, "big")]
    assert p.evict(a[0]) == 1 and p.lookup(h + (0).to_bytes(4, "big")) == a[1]
    assert not p.reset()
    p.release(a)
    assert p.reset() and p.num_keys == 0
    p.check_invariants()


def test_errors_leave_state_unchanged() -> None:
    p = KeyedBlockPool(4)
    ids, _ = p.allocate(2)
    before = (p.free_order(), [p.ref_count(b) for b in range(4)])
    with pytest.raises(errors.RefcountUnderflowError):
        p.release([1, 2, 2])
    with pytest.raises(errors.OutOfBlocksError):
        p.allocate(3)
    with pytest.raises(errors.InvalidBlockError):
        p.touch([1, 99])
    with pytest.raises(errors.InvalidArgumentError):
        p.set_ref(3, 2)  # free block
    with pytest.raises(errors.InvalidArgumentError):
        p.touch([-1])
    with pytest.raises(errors.InvalidConfigError):
        KeyedBlockPool(0)
    assert (p.free_order(), [p.ref_count(b) for b in range(4)]) == before
    p.check_invariants()


def test_random_ops_match_model() -> None:
    rng = random.Random(12)
    n = 12
    p = KeyedBlockPool(n)
    free = list(range(1, n))
    ref = [0] * n
    pairs: list[tuple[bytes, int]] = []
    held: list[int] = []
    for _ in range(3000):
        op = rng.randrange(5)
        if op == 0:
            k = rng.randrange(4)
            if k > len(free):
                with pytest.raises(errors.OutOfBlocksError):
                    p.allocate(k)
                continue
            ids, ev = p.allocate(k)
            want = free[:k]
            del free[:k]
            assert ids == want
            assert ev == [b for b in want if any(x == b for _, x in pairs)]
            pairs = [(kk, b) for kk, b in pairs if b not in want]
            for b in want:
                ref[b] = 1
            held += want
        elif op == 1 and held:
            picks = sorted(set(rng.sample(range(len(held)), min(len(held), rng.randrange(1, 4)))))
            bs = [held[i] for i in picks]
            p.release(bs)
            for i in reversed(picks):
                del held[i]
            front, back = [], []
            for b in bs:
                ref[b] -= 1
                if ref[b] == 0:
                    (back if any(x == b for _, x in pairs) else front).append(b)
            free = front + free + back
        elif op == 2 and held:
            b = rng.choice(held)
            k = key(rng.randrange(5))
            fresh = (k, b) not in pairs
            assert p.insert(k, b) == fresh
            if fresh:
                pairs.append((k, b))
        elif op == 3:
            b = rng.randrange(1, n)
            p.touch([b])
            if ref[b] == 0:
                free.remove(b)
            ref[b] += 1
            held.append(b)
        elif op == 4:
            k = key(rng.randrange(5))
            want = next((b for kk, b in pairs if kk == k), None)
            assert p.lookup(k) == want
        assert p.free_order() == free
        assert [p.ref_count(b) for b in range(n)] == ref
    p.check_invariants()
