"""The router's index under churning lower tiers: bounded, exact for what is live, GPU never crowded.

A synthetic event stream (no sockets): a replica's GPU and CPU tiers report every store and
removal; its shared storage tier (Redis) reports stores only, so its entries must age out by TTL.
The clock is the test's.
"""

from __future__ import annotations

import random
from typing import Any, Dict, List, Set, Tuple

import pytest

pytest.importorskip("msgspec")

from pagedkv.errors import InvalidArgumentError  # noqa: E402
from pagedkv.events import EventSink, KVEventBatch  # noqa: E402
from pagedkv.router import PrefixIndex  # noqa: E402
from pagedkv.router.index import APPLY_SLICE, ENTRY_BYTES  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def batch(*ops: Tuple[str, str, List[int]]) -> KVEventBatch:
    sink = EventSink()
    for kind, medium, hashes in ops:
        if kind == "stored":
            sink.add_stored(hashes, None, [1] * len(hashes), 1, medium=medium)
        else:
            sink.add_removed(hashes, medium=medium)
    return KVEventBatch(ts=0.0, events=sink.take())


def test_churning_lower_tiers_keep_the_index_bounded_and_exact() -> None:
    clock = Clock()
    cap = 2_000
    index = PrefixIndex(max_bytes_per_replica=cap * ENTRY_BYTES, ttl_s={"STORAGE": 30.0},
                        clock=clock)
    rng = random.Random(7)
    gpu: List[int] = []
    cpu: List[int] = []
    storage: Dict[int, float] = {}  # hash -> last stored
    fresh = iter(range(1, 1 << 40))
    for tick in range(600):
        clock.now += 1.0
        new_gpu = [next(fresh) for _ in range(20)]
        gone_gpu, gpu = gpu[:max(0, len(gpu) + 20 - 200)], gpu[max(0, len(gpu) + 20 - 200):]
        gpu += new_gpu
        gone_cpu = cpu[:max(0, len(cpu) + len(gone_gpu) - 500)]
        cpu = cpu[len(gone_cpu):] + gone_gpu
        # Redis: what the GPU evicts is written through, and some old blocks are stored again.
        again = rng.sample(sorted(storage), min(5, len(storage)))
        for h in gone_gpu + again:
            storage[h] = clock.now
        index.apply(0, batch(("removed", "GPU", gone_gpu), ("stored", "GPU", new_gpu),
                             ("removed", "CPU", gone_cpu), ("stored", "CPU", gone_gpu),
                             ("stored", "STORAGE", gone_gpu + again)))
        live_storage = {h for h, t in storage.items() if clock.now - t < 30.0}
        assert index.entries(0) == len(gpu) + len(cpu) + len(live_storage) <= cap
        if tick % 50 == 0 or tick == 599:
            for h in set(gpu) | set(cpu) | set(storage) | {next(fresh)}:
                want: Set[str] = set()
                if h in gpu:
                    want.add("GPU")
                if h in cpu:
                    want.add("CPU")
                if h in live_storage:
                    want.add("STORAGE")
                assert index.tiers(0, h) == want, (tick, h)
            assert index.match(gpu) == {0: len(gpu)}
    assert not index.evicted and sum(index.expired.values()) > 10_000


def test_lower_tiers_never_crowd_out_gpu_entries() -> None:
    clock = Clock()
    cap = 1_000
    index = PrefixIndex(max_bytes_per_replica=cap * ENTRY_BYTES, ttl_s={}, clock=clock)
    gpu = list(range(1, 301))
    index.apply(0, batch(("stored", "GPU", gpu)))
    # A storage tier that never removes, ten times the bound, in one batch and in many.
    index.apply(0, batch(("stored", "STORAGE", list(range(10_000, 15_000)))))
    for k in range(50):
        clock.now += 1
        index.apply(0, batch(("stored", "CPU", list(range(20_000 + 100 * k, 20_100 + 100 * k)))))
    assert index.entries(0) <= cap
    assert index.match(gpu) == {0: 300}
    # Further GPU stores are indexed, the lower tiers make room.
    more = list(range(301, 801))
    index.apply(0, batch(("stored", "GPU", more)))
    assert index.match(gpu + more) == {0: 800} and index.entries(0) <= cap
    # The lower tiers' latest entries are the ones kept.
    assert index.tiers(0, 24_999) == {"CPU"}
    assert index.tiers(0, 20_000) == set()
    # With only GPU entries left, the oldest GPU entries go (the bound holds, stores are indexed).
    index.apply(0, batch(("stored", "GPU", list(range(1_000, 1_500)))))
    assert index.entries(0) <= cap and index.match(list(range(1_000, 1_500))) == {0: 500}
    assert index.tiers(0, 1) == set()


def test_a_giant_batch_is_applied_in_slices() -> None:
    """The lock is taken once per slice, never for the whole batch."""
    index = PrefixIndex()

    class CountingLock:
        def __init__(self, lock: Any) -> None:
            self.lock, self.holds = lock, 0

        def __enter__(self) -> None:
            self.lock.acquire()
            self.holds += 1

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    lock = index._lock = CountingLock(index._lock)  # type: ignore[assignment]
    index.apply(0, batch(("stored", "GPU", list(range(3 * APPLY_SLICE + 1)))))
    assert lock.holds == 4 and index.blocks(0) == 3 * APPLY_SLICE + 1


@pytest.mark.parametrize("kwargs, what", [
    (dict(max_bytes_per_replica=0), "max_bytes_per_replica"),
    (dict(max_bytes_per_replica=True), "max_bytes_per_replica"),
    (dict(ttl_s={"STORAGE": 0}), "ttl_s"),
    (dict(ttl_s={"STORAGE": float("inf")}), "ttl_s"),
    (dict(ttl_s={"STORAGE": "1"}), "ttl_s"),
])
def test_bad_bounds_are_refused(kwargs: dict, what: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        PrefixIndex(**kwargs)
    assert err.value.fields["what"] == what


def test_router_cli_index_flags() -> None:
    import argparse

    from pagedkv import cli

    p = argparse.ArgumentParser()
    cli._add_router_args(p)
    args = p.parse_args(["--replica", "http://127.0.0.1:1", "--index-memory", "1MiB",
                         "--index-ttl", "STORAGE=5", "--index-ttl", "CPU=none"])
    assert cli._router_index_args(args) == {"index_max_bytes": 1 << 20,
                                            "index_ttl_s": {"STORAGE": 5.0, "CPU": None}}
    for bad in (["--index-ttl", "STORAGE=0"], ["--index-ttl", "600"],
                ["--index-memory", "lots"]):
        with pytest.raises(SystemExit):
            p.parse_args(["--replica", "http://127.0.0.1:1", *bad])


def test_windowed_groups_never_count_and_never_remove_the_full_groups_entries() -> None:
    """A hybrid replica publishes every group's blocks under the same chain hashes: only the full
    group's are matched, and a sliding group's removals (its window sliding past, its released
    blocks evicted) leave the full group's entries."""
    from pagedkv import KVCacheGroup

    index = PrefixIndex()
    sink = EventSink([KVCacheGroup.full(), KVCacheGroup.sliding(8), KVCacheGroup.chunked(8)])
    chain = [11, 12, 13, 14]
    sink.add_core([("stored", "GPU", chain, None, [1] * 16, 4, 0),
                   ("stored", "GPU", chain, None, [1] * 16, 4, 1),
                   ("stored", "GPU", [99], None, [1] * 4, 4, 2),
                   ("removed", "GPU", chain[:3], None, [], 4, 1),
                   ("removed", "GPU", [99], None, [], 4, 2)])
    index.apply(0, KVEventBatch(ts=0.0, events=sink.take()))
    assert index.full_groups(0) == {0}
    assert index.match(chain) == {0: 4}
    assert index.match([99]) == {}, "a chunked group's block is no prefix match"
    # Replica 1 holds only a sliding group's blocks of the chain: no match.
    sink.add_core([("stored", "GPU", chain, None, [1] * 16, 4, 1)])
    index.apply(1, KVEventBatch(ts=0.0, events=sink.take()))
    assert index.match(chain) == {0: 4}
    # The full group's removal does drop the entries.
    sink.add_core([("removed", "GPU", chain[2:], None, [], 4, 0)])
    index.apply(0, KVEventBatch(ts=0.0, events=sink.take()))
    assert index.match(chain) == {0: 2}


def test_groups_are_learned_from_the_spec_kind_and_bounded() -> None:
    from pagedkv.events import BlockRemoved, BlockStored, hash_to_wire
    from pagedkv.router.index import MAX_GROUPS_PER_REPLICA

    def stored(g: int, kind: Any, h: int) -> BlockStored:
        return BlockStored(block_hashes=[hash_to_wire(h)], parent_block_hash=None,
                           token_ids=[1], block_size=1, lora_id=None, medium="GPU",
                           lora_name=None, group_idx=g, kv_cache_spec_kind=kind)

    index = PrefixIndex()
    # vLLM may number a sliding group 0 and the full one 1; an MLA group is full too; a group
    # without a kind is full only as group 0; a removal from a group never stored is ignored.
    events = [stored(0, "sliding_window", 5), stored(1, "full_attention", 6),
              stored(2, "mla_attention", 7), stored(3, None, 8), stored(0, None, 9),
              BlockRemoved(block_hashes=[hash_to_wire(6)], medium="GPU", group_idx=7)]
    index.apply(0, KVEventBatch(ts=0.0, events=events))
    assert index.full_groups(0) == {1, 2}
    assert [index.match([h]).get(0, 0) for h in (5, 6, 7, 8, 9)] == [0, 1, 1, 0, 0]
    many = [stored(g, "full_attention", 100 + g) for g in range(MAX_GROUPS_PER_REPLICA + 3)]
    index.apply(1, KVEventBatch(ts=0.0, events=many))
    assert len(index.full_groups(1)) == MAX_GROUPS_PER_REPLICA
    assert index.refused[1] == 3
    index.clear(0)
    assert index.full_groups(0) == set()
