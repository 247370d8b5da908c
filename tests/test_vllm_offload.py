"""pagedkv's vLLM offloading spec (:mod:`pagedkv.vllm.offload`): the scheduler-side manager on the
core's keyed pool, the spec vLLM's ``OffloadingConnector`` loads by name, and the version gate.

- Scenarios with the answers vLLM's offloading connector relies on: a store in flight is
  ``HIT_PENDING`` and never evicted, a completed one is a ``HIT``, a full tier refuses a store
  with nothing changed, offered keys are never evicted by their own store, failed stores drop
  their keys and free their chunks first, loads pin chunks and release them tail first, events.
- A seeded random trace against a set model of which keys are stored and ready: every
  ``lookup`` agrees, every eviction the manager reports is a key the model held and no other
  key vanishes, each key keeps its chunk, and the core stays coherent (``check_coherence``).
- The spec built from an ``OffloadingConfig`` as vLLM builds it, its worker on CPU tensors:
  blocks stored through the manager's chunk ids and loaded back arrive byte for byte.
- A vLLM of another minor version is refused with a message naming 0.33.0.

Skips when vLLM is not importable (``scripts/test_vllm.sh`` runs it with vLLM installed).
"""

from __future__ import annotations

import os
import random
from typing import Any, Dict, List

import pytest

if os.environ.get("PAGEDKV_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm.v1.kv_offload.base")

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from pagedkv.errors import InvalidArgumentError, InvalidConfigError, MissingDependencyError
from pagedkv.vllm import offload
from pagedkv.vllm.offload import PagedKVOffloadingManager, PagedKVOffloadingSpec

CTX = ReqContext(req_id="t")
HIT, PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ks(*ids: int) -> List[bytes]:
    return [k(i) for i in ids]


def chunks(spec: Any) -> List[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(c) for c in spec.chunk_ids]


def stored(m: PagedKVOffloadingManager, *ids: int) -> List[int]:
    out = m.prepare_store(ks(*ids), CTX)
    assert out is not None
    m.complete_store(ks(*ids), CTX)
    return chunks(out.store_spec)


def test_store_pending_then_ready_and_events() -> None:
    m = PagedKVOffloadingManager(4, enable_events=True)
    out = m.prepare_store(ks(1, 2), CTX)
    assert out is not None and out.keys_to_store == ks(1, 2) and out.evicted_keys == []
    assert chunks(out.store_spec) == [0, 1]
    assert [m.lookup(x, CTX) for x in ks(1, 2, 3)] == [PENDING, PENDING, MISS]
    assert list(m.take_events()) == []
    m.complete_store(ks(1, 2), CTX)
    assert [m.lookup(x, CTX) for x in ks(1, 2)] == [HIT, HIT]
    (ev,) = list(m.take_events())
    assert ev.keys == ks(1, 2) and not ev.removed
    # Offering stored keys again stores nothing.
    out = m.prepare_store(ks(1, 2), CTX)
    assert out is not None and out.keys_to_store == [] and chunks(out.store_spec) == []
    m.check_coherence()


def test_full_tier_refuses_with_nothing_changed() -> None:
    m = PagedKVOffloadingManager(3)
    stored(m, 1, 2)
    assert m.prepare_store(ks(3), CTX) is not None  # pending: held
    before = (m.pool.free_order(), m.pool.entries())
    # 2 free chunks would need evicting 1 and 2, but 2 is offered: only one is evictable.
    assert m.prepare_store(ks(2, 4, 5), CTX) is None
    assert (m.pool.free_order(), m.pool.entries()) == before
    assert [m.lookup(x, CTX) for x in ks(1, 2, 3, 4)] == [HIT, HIT, PENDING, MISS]
    m.check_coherence()


def test_offered_keys_are_not_evicted_by_their_store() -> None:
    m = PagedKVOffloadingManager(3, enable_events=True)
    stored(m, 1)
    stored(m, 2)
    stored(m, 3)
    list(m.take_events())
    # LRU says evict 1 first, but 1 is offered: 2 goes.
    out = m.prepare_store(ks(1, 4), CTX)
    assert out is not None and out.keys_to_store == ks(4) and out.evicted_keys == ks(2)
    assert [m.lookup(x, CTX) for x in ks(1, 2, 3, 4)] == [HIT, MISS, HIT, PENDING]
    (ev,) = list(m.take_events())
    assert ev.removed and ev.keys == ks(2)
    m.check_coherence()


def test_eviction_order_is_release_order_and_loads_pin() -> None:
    m = PagedKVOffloadingManager(4)
    c = stored(m, 1, 2, 3, 4)
    assert c == [0, 1, 2, 3]
    # The store released its chunks tail first: free order 4, 3, 2, 1.
    spec = m.prepare_load(ks(3, 1), CTX)
    assert chunks(spec) == [2, 0]  # in the order of the keys
    # 3 and 1 are held by the load: a store of 3 keys cannot evict them.
    assert m.prepare_store(ks(5, 6, 7), CTX) is None
    m.complete_load(ks(3, 1), CTX)  # released tail first: 1, then 3 (3 evicted last)
    out = m.prepare_store(ks(5, 6, 7), CTX)
    assert out is not None and out.evicted_keys == ks(4, 2, 1)
    m.complete_store(ks(5, 6, 7), CTX)  # free order: 3, 7, 6, 5
    # touch moves present keys to the back, the head evicted last; unknown keys are ignored.
    m.touch(ks(3, 99, 5), CTX)
    out = m.prepare_store(ks(8, 9), CTX)
    assert out is not None and out.evicted_keys == ks(7, 6)
    m.check_coherence()


def test_completions_as_sets_release_tail_first() -> None:
    """vLLM's connector reports a job's keys as a set: the release order is the order in which
    the keys were named (prepare_store / prepare_load), reversed, not the set's."""
    m = PagedKVOffloadingManager(8)
    prefix = ks(1, 2, 3, 4, 5, 6)
    assert m.prepare_store(prefix, CTX) is not None
    m.complete_store(set(reversed(prefix)), CTX)
    out = m.prepare_store(ks(7, 8, 9), CTX)  # 2 never-used chunks, then the LRU: the tail
    assert out is not None and out.evicted_keys == ks(6)
    m.complete_store(ks(7, 8, 9), CTX)
    m.prepare_load(ks(1, 2, 3), CTX)
    m.complete_load({k(2), k(3), k(1)}, CTX)
    out = m.prepare_store(ks(10, 11, 12, 13, 14), CTX)
    assert out is not None and out.evicted_keys == ks(5, 4, 9, 8, 7)
    out = m.prepare_store(ks(15), CTX)  # the loaded prefix went back tail first: 3, 2, 1
    assert out is not None and out.evicted_keys == ks(3)
    m.check_coherence()


class CountingContext(ReqContext):
    """A ReqContext whose position lookups go through an override (read key by key)."""

    calls = 0

    def get_offload_key_position(self, key: Any) -> Any:
        self.calls += 1
        return super().get_offload_key_position(key)


@pytest.mark.parametrize("ctx_cls", [ReqContext, CountingContext])
def test_completion_order_follows_token_positions(ctx_cls: type) -> None:
    """With the positions vLLM's connector records, tails go first whatever the order the keys
    were offered in, and across KV cache groups."""
    m = PagedKVOffloadingManager(4)
    ctx = ctx_cls(req_id="p")
    head, tail = k(1), k(2)
    ctx.set_offload_key_position(head, 16)
    ctx.set_offload_key_position(tail, 32)
    assert m.prepare_store([tail], ctx) is not None  # a backfill: the tail offered first
    assert m.prepare_store([head], ctx) is not None
    m.complete_store({head, tail}, ctx)
    out = m.prepare_store(ks(3, 4, 5), CTX)  # 2 never-used chunks, then the tail
    assert out is not None and out.evicted_keys == [tail]
    g = [make_offload_key(b"h", 0), make_offload_key(b"t", 0), make_offload_key(b"h", 1),
         make_offload_key(b"t", 1)]
    m = PagedKVOffloadingManager(4)
    ctx = ctx_cls(req_id="groups")
    for key, pos in zip(g, (16, 32, 16, 32)):
        ctx.set_offload_key_position(key, pos)
    assert m.prepare_store(g, ctx) is not None
    m.complete_store(g, ctx)
    out = m.prepare_store(ks(8, 9), CTX)
    assert out is not None and set(out.evicted_keys) == {g[1], g[3]}  # both groups' tails
    if ctx_cls is CountingContext:
        assert ctx.calls == 4  # the override was honoured


def test_failed_store_unkeys_and_frees_first() -> None:
    m = PagedKVOffloadingManager(4, enable_events=True)
    stored(m, 1)
    out = m.prepare_store(ks(2, 3), CTX)
    assert out is not None
    failed = chunks(out.store_spec)
    list(m.take_events())
    m.complete_store(ks(1, 2, 3), CTX, success=False)  # 1 is ready: untouched
    assert [m.lookup(x, CTX) for x in ks(1, 2, 3)] == [HIT, MISS, MISS]
    (ev,) = list(m.take_events())
    assert ev.removed and ev.metadata_only and ev.keys == ks(2, 3)
    # The failed chunks are reused first, before the never-used chunk and without evicting 1.
    out = m.prepare_store(ks(4, 5), CTX)
    assert out is not None and chunks(out.store_spec) == failed and out.evicted_keys == []
    m.check_coherence()


def test_empty_calls_change_nothing() -> None:
    m = PagedKVOffloadingManager(2, enable_events=True)
    stored(m, 1)
    list(m.take_events())
    before = (m.pool.free_order(), m.pool.entries())
    out = m.prepare_store([], CTX)
    assert out is not None and out.keys_to_store == [] and out.evicted_keys == []
    m.complete_store([], CTX)
    m.complete_store([], CTX, success=False)
    m.complete_store(ks(9), CTX)  # not being stored: ignored
    assert chunks(m.prepare_load([], CTX)) == []
    m.complete_load([], CTX)
    m.touch([], CTX)
    assert list(m.take_events()) == []
    assert (m.pool.free_order(), m.pool.entries()) == before


def test_metadata_only_removal_pruned_when_retried() -> None:
    m = PagedKVOffloadingManager(2, enable_events=True)
    m.prepare_store(ks(1), CTX)
    m.complete_store(ks(1), CTX, success=False)
    m.prepare_store(ks(1), CTX)  # retried before the events were drained
    evs = list(m.take_events())
    assert evs == []


def test_bad_loads_are_typed_and_change_nothing() -> None:
    m = PagedKVOffloadingManager(4)
    stored(m, 1)
    m.prepare_store(ks(2), CTX)
    before = (m.pool.free_order(), [m.pool.ref_count(c) for c in range(4)])
    for keys in (ks(1, 3), ks(1, 2)):  # missing; still being stored
        with pytest.raises(InvalidArgumentError):
            m.prepare_load(keys, CTX)
        assert (m.pool.free_order(), [m.pool.ref_count(c) for c in range(4)]) == before
    with pytest.raises(InvalidArgumentError):
        m.complete_load(ks(1), CTX)  # no load holds it
    assert (m.pool.free_order(), [m.pool.ref_count(c) for c in range(4)]) == before
    m.check_coherence()


def test_reset_and_zero_chunks_and_config() -> None:
    m = PagedKVOffloadingManager(2)
    stored(m, 1)
    m.prepare_store(ks(2), CTX)
    m.reset_cache()
    assert [m.lookup(x, CTX) for x in ks(1, 2)] == [MISS, MISS]
    assert stored(m, 3, 4) == [0, 1]
    z = PagedKVOffloadingManager(0)
    assert z.prepare_store(ks(1), CTX) is None and z.lookup(k(1), CTX) is MISS
    with pytest.raises(InvalidConfigError):
        PagedKVOffloadingManager(4, cache_policy="arc")
    with pytest.raises(InvalidConfigError):
        PagedKVOffloadingManager(-1)


def test_store_threshold_counts_offers() -> None:
    m = PagedKVOffloadingManager(4, store_threshold=2, max_tracker_size=8)
    out = m.prepare_store(ks(1, 2), CTX)
    assert out is not None and out.keys_to_store == []
    out = m.prepare_store(ks(1, 3), CTX)
    assert out is not None and out.keys_to_store == ks(1)
    assert m.stores_skipped == 3


def test_random_trace_against_a_model() -> None:
    rnd = random.Random(7)
    m = PagedKVOffloadingManager(24, enable_events=True)
    ready: set = set()
    pending: Dict[bytes, int] = {}  # key -> chunk
    chunk_of: Dict[bytes, int] = {}
    loads: List[List[bytes]] = []
    for step in range(400):
        op = rnd.random()
        if op < 0.45:
            keys = ks(*rnd.sample(range(60), rnd.randint(1, 8)))
            held_loads = {x for ld in loads for x in ld}
            out = m.prepare_store(keys, CTX)
            if out is None:
                continue
            for e in out.evicted_keys:
                assert e in ready and e not in keys and e not in held_loads, step
                ready.discard(e)
                del chunk_of[e]
            want = [x for x in dict.fromkeys(keys) if x not in ready and x not in pending]
            assert out.keys_to_store == want
            for x, c in zip(want, chunks(out.store_spec)):
                pending[x] = c
                chunk_of[x] = c
        elif op < 0.7 and pending:
            keys = rnd.sample(sorted(pending), rnd.randint(1, len(pending)))
            ok = rnd.random() < 0.85
            m.complete_store(keys, CTX, success=ok)
            for x in keys:
                pending.pop(x)
                if ok:
                    ready.add(x)
                else:
                    del chunk_of[x]
        elif op < 0.85 and ready:
            keys = rnd.sample(sorted(ready), rnd.randint(1, min(4, len(ready))))
            assert chunks(m.prepare_load(keys, CTX)) == [chunk_of[x] for x in keys]
            loads.append(keys)
        elif loads:
            m.complete_load(loads.pop(rnd.randrange(len(loads))), CTX)
        else:
            m.touch(ks(*rnd.sample(range(60), 5)), CTX)
        for i in range(60):
            x = k(i)
            want = HIT if x in ready else PENDING if x in pending else MISS
            assert m.lookup(x, CTX) is want, (step, i)
        assert len(set(chunk_of.values())) == len(chunk_of)
        m.check_coherence()
    list(m.take_events())


# ------------------------------------------------------------------ the spec


def offloading_config(extra: Dict[str, Any], bytes_per_block: int,
                      block_size: int = 16) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=block_size,
                                      layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=bytes_per_block, enable_kv_cache_events=True,
        extra_config=extra, engine_id="e0",
        model=OffloadingModelConfig(name="m", dtype="float16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=block_size, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True))


def test_spec_loads_by_name_and_moves_bytes() -> None:
    extra = {"spec_name": "PagedKVOffloadingSpec", "spec_module_path": "pagedkv.vllm.offload",
             "cpu_bytes_to_use": 8 * 4096}
    pages = (1024, 2048)
    cfg = offloading_config(extra, sum(pages))
    spec = OffloadingSpecFactory.create_spec(cfg)
    assert isinstance(spec, PagedKVOffloadingSpec)
    assert spec.num_chunks == 8  # 3072 bytes per block, aligned to 4096
    m = spec.get_manager()
    assert m is spec.get_manager()
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randint(-128, 127, (16, p), dtype=torch.int8, generator=g) for p in pages]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=t.shape[1]) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=pages[0]),
                          CanonicalKVCacheRef(tensor_idx=1, page_size_bytes=pages[1])]])
    w = spec.get_worker(caches)
    keys = ks(1, 2, 3)
    out = m.prepare_store(keys, CTX)
    assert out is not None
    assert w.submit_store(1, GPULoadStoreSpec([4, 5, 6], [3], [0]), out.store_spec)
    (res,) = w.get_finished()
    assert res.job_id == 1 and res.success and res.transfer_size == 3 * sum(pages)
    m.complete_store(keys, CTX)
    want = [t[[4, 5, 6]].clone() for t in tensors]
    for t in tensors:
        t[[10, 11, 12]] = 0
    src = m.prepare_load(keys, CTX)
    assert w.submit_load(2, src, GPULoadStoreSpec([10, 11, 12], [3], [0]))
    w.wait({2})
    assert [r.job_id for r in w.get_finished()] == [2]
    m.complete_load(keys, CTX)
    for t, x in zip(tensors, want):
        assert torch.equal(t[[10, 11, 12]], x)
    w.shutdown()


def test_spec_config_errors() -> None:
    base = {"spec_name": "PagedKVOffloadingSpec", "spec_module_path": "pagedkv.vllm.offload"}
    for bad in ({}, {"cpu_bytes_to_use": 0}, {"cpu_bytes_to_use": "lots"}):
        with pytest.raises(InvalidConfigError) as e:
            PagedKVOffloadingSpec(offloading_config({**base, **bad}, 1024))
        assert "cpu_bytes_to_use" in str(e.value)
    spec = PagedKVOffloadingSpec(offloading_config(
        {**base, "cpu_bytes_to_use": 1 << 20, "eviction_policy": "arc"}, 1024))
    with pytest.raises(InvalidConfigError) as e:
        spec.get_manager()
    assert "'arc'" in str(e.value)


@pytest.mark.parametrize("version", ["0.34.0", "0.32.1", "1.0.0"])
def test_other_vllm_versions_are_refused(version: str) -> None:
    with pytest.raises(MissingDependencyError) as e:
        offload._check_vllm_version(version)
    assert "0.33.0" in str(e.value) and version in str(e.value)
    assert isinstance(e.value, ImportError)


def test_tested_version_passes() -> None:
    import vllm

    offload._check_vllm_version(vllm.__version__)
    offload._check_vllm_version("0.33.2")


def test_import_fails_on_another_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import sys

    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    monkeypatch.delitem(sys.modules, "pagedkv.vllm.offload")
    with pytest.raises(MissingDependencyError) as e:
        importlib.import_module("pagedkv.vllm.offload")
    assert "vLLM 0.33.0" in str(e.value) and "vLLM 0.34.0" in str(e.value)
