"""The offloading tier's index as Python sees it (``pagedkv._core.OffloadIndex``), without vLLM:
the bound ``lookup_function`` answers as ``lookup`` does (errors included), evictions hand back
the key objects that were stored, the guesses the binding keeps for later calls (the last
``prepare_*`` call's keys, the lookups before a load) never change an answer, positions come from
a context's dict or its own method, and bad arguments are typed errors that change nothing.
"""

from __future__ import annotations

import gc
import sys
from typing import Any, Dict, List, Optional

import pytest

from pagedkv._core import OffloadIndex
from pagedkv.errors import InvalidArgumentError, InvalidBlockError

MISS, HIT, PENDING = "miss", "hit", "pending"


class Ctx:
    """A request context shaped like vLLM's ``ReqContext`` (positions in a dict)."""

    def __init__(self) -> None:
        self._offload_key_positions: Dict[bytes, int] = {}

    def get_offload_key_position(self, key: bytes) -> Optional[int]:
        return self._offload_key_positions.get(key)


class CountingCtx(Ctx):
    """Overrides the position method: the index must call it."""

    calls = 0

    def get_offload_key_position(self, key: bytes) -> Optional[int]:
        self.calls += 1
        return super().get_offload_key_position(key)


def k(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def ks(*ids: int) -> List[bytes]:
    return [k(i) for i in ids]


def index(n: int) -> OffloadIndex:
    return OffloadIndex(n, (MISS, HIT, PENDING), Ctx.get_offload_key_position)


def snapshot(x: OffloadIndex) -> Any:
    return (x.free_order(), x.entries(), [x.ref_count(c) for c in range(x.num_chunks)],
            x.num_pending)


def test_lookup_function_answers_as_lookup() -> None:
    x = index(4)
    f = x.lookup_function()
    x.prepare_store(ks(1, 2))
    x.complete_store(ks(1))
    for key, want in ((k(1), HIT), (k(2), PENDING), (k(3), MISS)):
        assert x.lookup(key) == want
        assert f(key) == want and f(key, None) == want and f(key, Ctx()) == want
        assert f(key=key) == want and f(key, req_context=3) == want
    # A bytes subclass goes through the ordinary method, with the same answer.

    class B(bytes):
        pass

    assert f(B(k(1))) == HIT
    for bad in ("x", bytearray(k(1)), 7):
        with pytest.raises(InvalidArgumentError):
            f(bad)
    with pytest.raises(TypeError):
        f()
    with pytest.raises(TypeError):
        f(k(1), None, None)
    # Without result objects the answers are 0, 1, 2.
    y = OffloadIndex(2)
    y.prepare_store(ks(5))
    assert (y.lookup_function()(k(5)), y.lookup(k(6))) == (2, 0)


def test_evictions_hand_back_the_stored_objects() -> None:
    x = index(2)
    stored = ks(1, 2)
    x.prepare_store(stored)
    x.complete_store(stored)
    new, chunks, evicted = x.prepare_store(ks(3))
    assert new == ks(3) and chunks is not None and chunks.dtype.name == "int32"
    assert evicted == [k(2)] and evicted[0] is stored[1]  # the tail went first
    # A reset lets go of every stored object.
    obj = k(9)
    before = sys.getrefcount(obj)
    x.prepare_store([obj])
    assert sys.getrefcount(obj) > before
    x.reset()
    gc.collect()
    assert sys.getrefcount(obj) == before
    assert x.lookup(obj) == MISS and x.num_free == 2


def test_guesses_never_change_answers() -> None:
    x = index(4)
    a = ks(1, 2, 3)
    x.prepare_store(a)
    # Equal keys in other objects: no guess matches by address; the same completion.
    assert x.complete_store(ks(1, 2, 3)) == ks(1, 2, 3)
    # The remembered store of `b` goes stale when the store fails: its chunk is unkeyed.
    b = ks(4)
    x.prepare_store(b)
    assert x.complete_store(b, False) == b
    assert x.complete_store(b) == []  # not pending: ignored, whatever the guess says
    x.touch(b)
    assert x.lookup(k(4)) == MISS
    _, _, evicted = x.prepare_store(ks(7, 8, 9))  # the failed chunk, then 3 and 2 (tail first)
    assert evicted == ks(3, 2)
    # Lookups leave guesses for the load that follows, in any order it names the keys.
    x.complete_store(ks(7, 8, 9))
    load = ks(9, 7, 8)
    f = x.lookup_function()
    assert [f(key) for key in load] == [HIT, HIT, HIT]
    chunks = x.prepare_load(list(reversed(load)))
    assert [x.key(int(c)) for c in chunks] == list(reversed(load))
    x.touch(load)
    x.complete_load(set(load))
    assert [x.ref_count(int(c)) for c in chunks] == [0, 0, 0]
    x.check_invariants()


def test_positions_from_the_dict_or_the_method() -> None:
    for cls in (Ctx, CountingCtx):
        x = index(4)
        ctx = cls()
        head, tail = k(1), k(2)
        ctx._offload_key_positions.update({head: 16, tail: 32})
        x.prepare_store([tail], ctx)  # the tail offered first
        x.prepare_store([head], ctx)
        x.complete_store({head, tail})
        assert x.stamp(0) == 32 and x.stamp(1) == 16
        _, _, evicted = x.prepare_store(ks(3, 4, 5))
        assert evicted == [tail]
        if isinstance(ctx, CountingCtx):
            assert ctx.calls == 2
    x = index(2)
    ctx = Ctx()
    ctx._offload_key_positions[k(1)] = "late"  # type: ignore[assignment]
    before = snapshot(x)
    with pytest.raises(InvalidArgumentError) as e:
        x.prepare_store(ks(1), ctx)
    assert "req_context" in str(e.value)
    assert snapshot(x) == before


def test_bad_arguments_are_typed_and_change_nothing() -> None:
    x = index(4)
    x.prepare_store(ks(1, 2))
    x.complete_store(ks(1, 2))
    before = snapshot(x)
    with pytest.raises(InvalidArgumentError) as e:
        x.prepare_load(ks(1, 7))
    assert "prepare_load of key 1" in str(e.value) and "not offloaded" in str(e.value)
    with pytest.raises(InvalidArgumentError):
        x.complete_load(ks(1))  # no load holds it
    with pytest.raises(InvalidArgumentError) as e:
        x.prepare_store([k(3), "k"])  # type: ignore[list-item]
    assert "element 1" in str(e.value)
    with pytest.raises(InvalidArgumentError) as e:
        x.prepare_store(ks(3, 4), None, [True])
    assert "1 admission flags for 2 keys" in str(e.value)
    with pytest.raises(InvalidBlockError):
        x.ref_count(4)
    assert snapshot(x) == before
    # A list with a key of another type, or a list subclass, is read key by key (same checks).
    with pytest.raises(InvalidArgumentError) as e:
        x.touch([k(1), "x"])  # type: ignore[list-item]
    assert "element 1" in str(e.value)

    class L(list):  # type: ignore[type-arg]
        pass

    x.prepare_store(L(ks(5, 6)))
    assert x.complete_store(L(ks(6, 5))) == ks(6, 5)
    x.prepare_load(L(ks(5)))
    x.complete_load(L(ks(5)))
    assert x.ref_count(x.prepare_load(ks(6))[0]) == 1
    with pytest.raises(InvalidArgumentError):
        OffloadIndex(2**31)
    x.check_invariants()
