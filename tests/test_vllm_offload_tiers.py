"""pagedkv's disk and Redis tiers as secondary tiers of vLLM's tiered offloading
(:mod:`pagedkv.vllm.offload_tiers`), driven through vLLM's real ``TieringOffloadingSpec`` and
``TieringOffloadingManager`` on the CPU, the tiers configured as a user configures them
(``{"type": ..., "module_path": "pagedkv.vllm.offload_tiers", ...}``):

- store -> cascade to the disk tier -> the primary tier reset -> lookup, promotion -> the same
  bytes; a restarted engine finds its chunks; events carry medium STORAGE, locality LOCAL;
- a corrupted file is a failed key of its promotion (the other keys arrive), then a miss; a
  directory written by another model (or another chunk layout) is all misses;
- Redis on a real ``redis-server`` (loopback): two managers, one stores, the other (its own spec
  and tier) hits after its RETRY; a chunk stored by another Python process (another hash seed)
  is a hit here; a tampered value, a real record moved
  under another key, a record under another secret, and another model's chunks are never served;
- a full job queue fails a cascade at once (submit never blocks); bad options are
  ``InvalidConfigError`` naming the option.

Skips when vLLM is not importable (``scripts/test_vllm.sh`` runs it with vLLM installed).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import threading
import time
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np
import pytest

if os.environ.get("PAGEDKV_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import (  # noqa: E402
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from pagedkv.errors import InvalidConfigError, TierSecretError  # noqa: E402
from pagedkv.tiers.record import HEADER_BYTES, encode  # noqa: E402
from pagedkv.tiers.secret import TierSecret  # noqa: E402
from pagedkv.vllm.offload_tiers import (  # noqa: E402
    PagedKVDiskTier,
    PagedKVRemoteTier,
    key_meta,
    layout_fingerprint,
)

MODULE = "pagedkv.vllm.offload_tiers"
CHUNK = 8192
NUM_CHUNKS = 16
SECRET = "s" * 40
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
DEADLINE_S = 20.0
_ENGINE_IDS = itertools.count()


@pytest.fixture(autouse=True)
def _tier_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_TIER_SECRET", SECRET)


def config(tiers: List[Dict[str, Any]], *, model: str = "org/model", dtype: str = "bfloat16",
           chunk: int = CHUNK, engine: Optional[str] = None, tp_size: int = 1,
           events: bool = False, extra: Optional[Dict[str, Any]] = None) -> OffloadingConfig:
    if extra is None:
        extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": NUM_CHUNKS * chunk,
                 "secondary_tiers": tiers}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("model.layers.0.attn", "model.layers.1.attn"), 0),),
        worker_kv_bytes_per_block=chunk, enable_kv_cache_events=events, extra_config=extra,
        engine_id=engine or f"pagedkv-test-{os.getpid()}-{next(_ENGINE_IDS)}",
        model=OffloadingModelConfig(name=model, dtype=dtype, max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=tp_size, tp_size=tp_size, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False),
    )


def disk(path: Any, **opts: Any) -> Dict[str, Any]:
    return {"type": "PagedKVDiskTier", "module_path": MODULE, "path": str(path),
            "capacity_bytes": 64 * 16384, **opts}


def remote(url: str, **opts: Any) -> Dict[str, Any]:
    return {"type": "PagedKVRemoteTier", "module_path": MODULE, "url": url,
            "timeout_s": 2.0, **opts}


class Engine:
    """One scheduler's offloading manager, built by vLLM's spec, and its primary tier's bytes."""

    def __init__(self, cfg: OffloadingConfig) -> None:
        self.spec = TieringOffloadingSpec(cfg)
        manager = self.spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        self.m = manager
        view = manager.primary_tier.get_kv_memoryview()
        self.rows = np.asarray(view).view(np.uint8).reshape(len(view), -1)
        self.n = 0

    @property
    def tier(self) -> Any:
        return self.m.secondary_tiers[0]

    def ctx(self) -> ReqContext:
        self.n += 1
        ctx = ReqContext(req_id=f"r{self.n}")
        self.m.on_new_request(ctx)
        return ctx

    def settle(self) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while self.m.has_pending_work():
            assert time.monotonic() < deadline, "tier jobs did not finish"
            self.m.on_schedule_end(STEP)
            time.sleep(0.005)
        self.m.on_schedule_end(STEP)

    def store(self, keys: Sequence[OffloadKey], data: np.ndarray) -> None:
        """The GPU -> primary store of ``keys`` (their bytes written into the chunks vLLM's worker
        would fill), completed, cascaded to the secondary tier and settled."""
        ctx = self.ctx()
        out = self.m.prepare_store(list(keys), ctx)
        assert out is not None and list(out.keys_to_store) == list(keys)
        for i, c in enumerate(out.store_spec.chunk_ids):  # type: ignore[attr-defined]
            self.rows[int(c)] = data[i]
        self.m.complete_store(list(keys), ctx)
        self.m.on_request_finished(ctx)
        self.settle()

    def evict_primary(self) -> None:
        """Empties the primary tier (vLLM's reset) and wipes its bytes."""
        self.m.reset_cache()
        self.m.on_reset_flushed()
        self.rows[:] = 0

    def lookup(self, keys: Sequence[OffloadKey]) -> List[LookupResult]:
        """Each key's answer once none is pending (promotions run, probes answered)."""
        ctx = self.ctx()
        deadline = time.monotonic() + DEADLINE_S
        while True:
            res = [self.m.lookup(k, ctx) for k in keys]
            if not any(r in (LookupResult.RETRY, LookupResult.HIT_PENDING) for r in res):
                self.m.on_request_finished(ctx)
                self.settle()
                return res
            assert time.monotonic() < deadline, f"lookups still pending: {res}"
            self.m.on_schedule_end(STEP)
            time.sleep(0.005)

    def load(self, keys: Sequence[OffloadKey]) -> np.ndarray:
        """The primary bytes of ``keys`` (all HIT), as the GPU load would read them."""
        ctx = self.ctx()
        spec = self.m.prepare_load(list(keys), ctx)
        chunk_ids = spec.chunk_ids  # type: ignore[attr-defined]
        out = np.stack([self.rows[int(c)].copy() for c in chunk_ids])
        self.m.complete_load(list(keys), ctx)
        self.m.on_request_finished(ctx)
        return out

    def close(self) -> None:
        del self.rows  # the primary region's buffer, exported to numpy
        self.m.shutdown()


def keys(*ids: int, group: int = 0) -> List[OffloadKey]:
    return [make_offload_key(i.to_bytes(32, "big"), group) for i in ids]


def payload(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, CHUNK), dtype=np.uint8)


@pytest.fixture
def engines() -> Iterator[List[Engine]]:
    made: List[Engine] = []
    yield made
    for e in made:
        e.close()


def build(engines: List[Engine], cfg: OffloadingConfig) -> Engine:
    e = Engine(cfg)
    engines.append(e)
    return e


HIT, MISS = LookupResult.HIT, LookupResult.MISS


# ------------------------------------------------------------------------------------ identity


def test_fingerprint_names_model_and_layout_not_the_engine() -> None:
    base = config([])

    def fp(cfg: OffloadingConfig, chunk: int = CHUNK, revision: str = "") -> bytes:
        spec: Any = SimpleNamespace(config=cfg)
        return layout_fingerprint(spec, chunk, revision)

    def par(**kw: Any) -> OffloadingConfig:
        return dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, **kw))

    ref = fp(base)
    assert len(ref) == 16 and fp(config([])) == ref
    # The same KV from another engine, replica, rank or length limit: the same identity.
    same = [
        dataclasses.replace(base, engine_id="other"),
        par(data_parallel_index=3, data_parallel_size=4),
        par(rank=1),
        dataclasses.replace(base, model=dataclasses.replace(base.model, max_model_len=128)),
    ]
    assert all(fp(c) == ref for c in same)
    group = base.groups[0]
    differ = [
        fp(base, revision="abc123"),
        fp(base, chunk=2 * CHUNK),
        fp(config([], model="org/other")),
        fp(config([], dtype="float16")),
        fp(dataclasses.replace(base, cache=dataclasses.replace(base.cache, tokens_per_hash=32))),
        fp(dataclasses.replace(base, cache=dataclasses.replace(base.cache, blocks_per_chunk=2))),
        fp(dataclasses.replace(base, groups=(dataclasses.replace(group, layer_names=("x",)),))),
        fp(dataclasses.replace(base, groups=(
            dataclasses.replace(group, sliding_window_size_in_chunks=4),))),
        fp(dataclasses.replace(base, worker_kv_bytes_per_block=CHUNK // 2)),
        fp(par(tp_size=2, world_size=2)),
        fp(par(pp_size=2)),
        fp(par(dcp_size=2)),
        fp(dataclasses.replace(base, replicated_layout=True)),
        fp(dataclasses.replace(base, canonical_layout=True, kv_cache_layout="NHD")),
    ]
    assert ref not in differ and len(set(differ)) == len(differ)


def test_key_meta_covers_the_whole_key() -> None:
    a, b = make_offload_key(bytes(32), 0), make_offload_key(bytes(31) + b"\x01", 0)
    ma, mb, mg = key_meta(a), key_meta(b), key_meta(make_offload_key(bytes(32), 1))
    assert (ma.group, mg.group) == (0, 1) and len(ma.token_ids) == 0
    assert len({ma.block_hash, mb.block_hash, mg.block_hash}) == 3
    assert len({ma.salt_digest, mb.salt_digest, mg.salt_digest}) == 3
    assert key_meta(a) == ma  # a pure function of the key


# ------------------------------------------------------------------------------------ disk


def test_disk_cascade_evict_promote_same_bytes(tmp_path: Any, engines: List[Engine]) -> None:
    e = build(engines, config([disk(tmp_path / "kv", enable_kv_events=True)], events=True))
    assert isinstance(e.tier, PagedKVDiskTier)
    ks = keys(1, 2, 3, 4) + keys(1, group=1)
    data = payload(5, 0)
    e.store(ks, data)
    assert e.tier.store.stats().puts == 5
    events = list(e.m.take_events())
    stored = [ev for ev in events if ev.medium is Medium.STORAGE]
    assert [sorted(ev.keys) for ev in stored] == [sorted(ks)]
    assert stored[0].locality is Locality.LOCAL and not stored[0].removed

    e.evict_primary()
    assert e.m.primary_tier.lookup(ks[0], ReqContext("x")) is MISS
    assert e.lookup(ks + keys(9)) == [HIT] * 5 + [MISS]
    np.testing.assert_array_equal(e.load(ks), data)
    assert e.tier.store.stats().hits == 5


def test_disk_eviction_is_a_removed_event_and_a_miss(tmp_path: Any, engines: List[Engine]) -> None:
    slot = 12288  # one 8 KiB chunk's record, rounded up to the disk's 4 KiB slots
    e = build(engines, config([disk(tmp_path / "kv", capacity_bytes=3 * slot,
                                    enable_kv_events=True)], events=True))
    assert e.tier.store.num_slots == 3
    ks = keys(100, 101, 102, 103, 104)
    data = payload(5, 11)
    for i, k in enumerate(ks):  # one at a time: the disk's LRU order is the store order
        e.store([k], data[i : i + 1])
    events = [ev for ev in e.m.take_events() if ev.medium is Medium.STORAGE]
    assert [ev.keys for ev in events if not ev.removed] == [[k] for k in ks]
    assert [sorted(ev.keys) for ev in events if ev.removed] == [sorted(ks[:2])]
    assert all(ev.locality is Locality.LOCAL for ev in events)
    e.evict_primary()
    assert e.lookup(ks) == [MISS, MISS, HIT, HIT, HIT]
    np.testing.assert_array_equal(e.load(ks[2:]), data[2:])


def test_disk_restart_finds_chunks_other_model_or_layout_misses(tmp_path: Any,
                                                                 engines: List[Engine]) -> None:
    path = tmp_path / "kv"
    ks = keys(10, 11, 12)
    data = payload(3, 1)
    a = build(engines, config([disk(path)]))
    a.store(ks, data)
    a.close()
    engines.remove(a)

    # Another model, another dtype, another chunk layout (TP 2): the directory holds nothing
    # for them (their start-up scan finds every slot foreign: free space).
    for cfg in (config([disk(path)], model="org/other"), config([disk(path)], dtype="float16"),
                config([disk(path)], tp_size=2)):
        b = Engine(cfg)
        try:
            assert b.lookup(ks) == [MISS] * 3
        finally:
            b.close()

    # The same model again on the same directory, stored and restarted: found from the slots'
    # headers.
    c = build(engines, config([disk(path)]))
    c.store(ks, data)
    c.close()
    engines.remove(c)
    d = build(engines, config([disk(path)]))  # a restart: found from the slots' headers
    assert d.lookup(ks) == [HIT] * 3
    np.testing.assert_array_equal(d.load(ks), data)


def test_disk_corrupt_record_is_failed_key_never_served(tmp_path: Any,
                                                        engines: List[Engine]) -> None:
    e = build(engines, config([disk(tmp_path / "kv")]))
    ks = keys(20, 21, 22)
    data = payload(3, 2)
    e.store(ks, data)
    store = e.tier.store
    slot = store._index[key_meta(ks[1]).block_hash]
    fd, offset = store._locate(slot)
    at = offset + HEADER_BYTES + 100  # a payload byte (no token ids in these records)
    old = os.pread(fd, 1, at)
    os.pwrite(fd, bytes([old[0] ^ 0xFF]), at)
    e.evict_primary()

    ctx = e.ctx()
    deadline = time.monotonic() + DEADLINE_S
    seen = []
    while True:  # the promotion: key 21's read fails its checksum
        res = [e.m.lookup(k, ctx) for k in ks]
        seen.append(res)
        if LookupResult.HIT_PENDING not in res and LookupResult.RETRY not in res:
            break
        assert time.monotonic() < deadline
        e.m.on_schedule_end(STEP)
        time.sleep(0.005)
    e.m.on_request_finished(ctx)
    assert seen[0] == [LookupResult.HIT_PENDING] * 3  # the index had all three
    assert res == [HIT, MISS, HIT]
    assert store.stats().corrupt == 1
    np.testing.assert_array_equal(e.load([ks[0], ks[2]]), data[[0, 2]])
    assert e.lookup(ks) == [HIT, MISS, HIT]  # no second promotion of the bad one


def test_partial_promotion_reports_verified_keys_and_zeroes_the_rest(
        tmp_path: Any, engines: List[Engine]) -> None:
    e = build(engines, config([disk(tmp_path / "kv")]))
    ks = keys(70, 71, 72)
    data = payload(3, 6)
    e.store(ks, data)
    store = e.tier.store
    fd, offset = store._locate(store._index[key_meta(ks[1]).block_hash])
    os.pwrite(fd, b"\x00" * 64, offset + HEADER_BYTES + 40)
    e.evict_primary()
    e.rows[:3] = 0xAA
    e.tier.submit_load(TransferJob(job_id=7, keys=ks, chunk_ids=np.array([0, 1, 2]),
                                   is_promotion=True, req_context=ReqContext("p")))
    e.tier.drain_jobs()
    [result] = list(e.tier.get_finished_jobs())
    assert result.job_id == 7 and not result.success
    assert set(result.successful_keys or ()) == {ks[0], ks[2]}
    np.testing.assert_array_equal(e.rows[[0, 2]], data[[0, 2]])
    assert not e.rows[1].any()  # the unverified read left nothing behind
    assert e.tier.lookup(ks[1], ReqContext("p")) is MISS


def test_disk_full_queue_fails_store_at_once(tmp_path: Any, engines: List[Engine]) -> None:
    e = build(engines, config([disk(tmp_path / "kv", threads=1, max_queued_jobs=1)]))
    tier = e.tier
    gate = threading.Event()
    entered = threading.Event()
    put = tier.store.put

    def slow_put(meta: Any, data: Any) -> bool:
        entered.set()
        assert gate.wait(DEADLINE_S)
        return bool(put(meta, data))

    tier.store.put = slow_put
    try:
        def job(i: int) -> TransferJob:
            return TransferJob(job_id=1000 + i, keys=keys(30 + i), chunk_ids=np.array([i]),
                               is_promotion=False, req_context=ReqContext("q"))

        t0 = time.monotonic()
        tier.submit_store(job(0))
        assert entered.wait(DEADLINE_S)  # the one worker holds job 0
        tier.submit_store(job(1))  # queued
        tier.submit_store(job(2))  # the queue is full: fails, without waiting
        assert time.monotonic() - t0 < DEADLINE_S / 2
        first = list(tier.get_finished_jobs())
        assert [(r.job_id, r.success) for r in first] == [(1002, False)]
        gate.set()
        tier.drain_jobs()
        rest = sorted((r.job_id, r.success) for r in tier.get_finished_jobs())
        assert rest == [(1000, True), (1001, True)]
    finally:
        gate.set()
        tier.store.put = put


def test_full_queue_fails_promotion_without_refusing_its_keys(tmp_path: Any,
                                                              engines: List[Engine]) -> None:
    e = build(engines, config([disk(tmp_path / "kv", threads=1, max_queued_jobs=1)]))
    ks = keys(90, 91, 92)
    data = payload(3, 10)
    e.store(ks, data)
    e.evict_primary()
    tier = e.tier
    gate = threading.Event()
    entered = threading.Event()
    get_into = tier.store.get_into

    def slow_get_into(meta: Any, out: Any) -> bool:
        entered.set()
        assert gate.wait(DEADLINE_S)
        return bool(get_into(meta, out))

    tier.store.get_into = slow_get_into
    try:
        e.rows[:3] = 0xAA
        for i in range(3):
            tier.submit_load(TransferJob(job_id=2000 + i, keys=ks[i:i + 1],
                                         chunk_ids=np.array([i]), is_promotion=True,
                                         req_context=ReqContext("q")))
            if i == 0:
                assert entered.wait(DEADLINE_S)
        [rejected] = list(tier.get_finished_jobs())
        assert rejected.job_id == 2002 and not rejected.success and not rejected.successful_keys
        assert not e.rows[2].any()
        gate.set()
        tier.drain_jobs()
        assert sorted((r.job_id, r.success) for r in tier.get_finished_jobs()) == [
            (2000, True), (2001, True)]
        np.testing.assert_array_equal(e.rows[:2], data[:2])
        assert tier.lookup(ks[2], ReqContext("q")) is HIT  # the full queue was not its fault
    finally:
        gate.set()
        tier.store.get_into = get_into


def test_bad_options_are_typed_errors(tmp_path: Any) -> None:
    cases = [
        (disk(tmp_path / "a", capacity_bytes=0), "capacity_bytes"),
        ({"type": "PagedKVDiskTier", "module_path": MODULE, "capacity_bytes": 1 << 20}, "path"),
        (disk(tmp_path / "b", threads=0), "threads"),
        (disk(tmp_path / "c", max_queued_jobs="many"), "max_queued_jobs"),
        (disk(tmp_path / "d", capcity_bytes=5), "capcity_bytes"),
        (disk(tmp_path / "e", locality="NEAR"), "locality"),
        (remote("redis://127.0.0.1:1/0", lookup_cache_s=-1), "lookup_cache_s"),
        (remote("", ), "url"),
    ]
    for tier_cfg, field in cases:
        with pytest.raises(InvalidConfigError) as info:
            Engine(config([tier_cfg]))
        assert info.value.field == field, (tier_cfg, info.value)
        assert field in str(info.value)


def test_remote_needs_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDKV_TIER_SECRET")
    pytest.importorskip("redis")
    with pytest.raises(TierSecretError):
        Engine(config([remote("redis://127.0.0.1:1/0")]))


# ------------------------------------------------------------------------------------ Redis


def test_remote_shared_by_two_engines(redis_server: Any, engines: List[Engine]) -> None:
    a = build(engines, config([remote(redis_server.url)]))
    b = build(engines, config([remote(redis_server.url)]))
    assert isinstance(b.tier, PagedKVRemoteTier)
    ks = keys(40, 41, 42)
    data = payload(3, 3)
    a.store(ks, data)
    assert a.tier.store.stats().puts == 3

    # b has never seen these keys: its first lookup is RETRY (the probe is out), never a
    # network wait; then the promotion, then a HIT with a's bytes.
    ctx = b.ctx()
    assert b.m.lookup(ks[0], ctx) is LookupResult.RETRY
    b.m.on_request_finished(ctx)
    assert b.lookup(ks + keys(49)) == [HIT, HIT, HIT, MISS]
    np.testing.assert_array_equal(b.load(ks), data)

    # Another model on the same server sees none of it.
    c = build(engines, config([remote(redis_server.url)], model="org/other"))
    assert c.lookup(ks) == [MISS] * 3


_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import test_vllm_offload_tiers as t
e = t.Engine(t.config([t.remote(sys.argv[2])]))
e.store(t.keys(120, 121, 122), t.payload(3, 13))
e.close()
print("stored")
"""


def test_remote_another_process_stores_this_one_hits(redis_server: Any,
                                                     engines: List[Engine]) -> None:
    import subprocess
    import sys

    env = dict(os.environ, PAGEDKV_TIER_SECRET=SECRET, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", _CHILD, os.path.dirname(__file__),
                          redis_server.url], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("stored"), out.stderr[-2000:]
    e = build(engines, config([remote(redis_server.url)]))
    ks = keys(120, 121, 122)
    assert e.lookup(ks) == [HIT] * 3
    np.testing.assert_array_equal(e.load(ks), payload(3, 13))


def test_remote_lookup_cache_zero_still_resolves(redis_server: Any, engines: List[Engine]) -> None:
    a = build(engines, config([remote(redis_server.url, lookup_cache_s=0)]))
    ks = keys(110, 111)
    data = payload(2, 12)
    a.store(ks, data)
    b = build(engines, config([remote(redis_server.url, lookup_cache_s=0)]))
    assert b.lookup(ks + keys(119)) == [HIT, HIT, MISS]  # each probe's answer is read once
    np.testing.assert_array_equal(b.load(ks), data)


def test_remote_tampered_values_never_served(redis_server: Any, engines: List[Engine]) -> None:
    import redis

    a = build(engines, config([remote(redis_server.url)]))
    ks = keys(50, 51, 52, 53)
    data = payload(4, 4)
    a.store(ks, data)
    r = redis.Redis.from_url(redis_server.url)
    store = a.tier.store
    rkey = [store.key(key_meta(k).block_hash) for k in ks]
    # 51: a payload byte flipped; 52: key 50's real record moved under 52's key; 53: a record
    # for 53 written under another secret (valid checksum, wrong MAC).
    value = bytearray(r.get(rkey[1]))
    value[HEADER_BYTES + 7] ^= 1
    r.set(rkey[1], bytes(value))
    r.set(rkey[2], r.get(rkey[0]))
    forged = encode(store.fingerprint, key_meta(ks[3]), payload(1, 9)[0],
                    secret=TierSecret(b"x" * 40))
    r.set(rkey[3], forged)

    b = build(engines, config([remote(redis_server.url)]))
    res = b.lookup(ks)
    assert res == [HIT, MISS, MISS, MISS]
    np.testing.assert_array_equal(b.load(ks[:1]), data[:1])
    stats = b.tier.store.stats()
    assert stats.corrupt == 1 and stats.mismatched == 1 and stats.unauthenticated == 1
    # The bad values were deleted (corrupt, forged); the moved one is a valid record of another key.
    assert r.exists(rkey[1]) == 0 and r.exists(rkey[3]) == 0


def test_remote_server_down_is_miss_not_stall(tmp_path: Any, engines: List[Engine]) -> None:
    pytest.importorskip("redis")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    e = build(engines, config([remote(f"redis://127.0.0.1:{port}/0", timeout_s=0.2)]))
    ks = keys(60, 61)
    t0 = time.monotonic()
    e.store(ks, payload(2, 5))  # the cascade fails: a failed job, the primary keeps the chunks
    e.evict_primary()
    assert e.lookup(ks) == [MISS, MISS]
    assert time.monotonic() - t0 < DEADLINE_S
    stats = e.tier.store.stats()
    assert stats.dropped >= 1 and stats.puts == 0


# ------------------------------------------------------------------------------------ the docs


def _doc_configs() -> Dict[str, Dict[str, Any]]:
    """The ``kv_connector_extra_config`` of each ``vllm serve`` line of docs/vllm.md that names
    one of this module's tiers, by tier type."""
    doc = os.path.join(os.path.dirname(__file__), "..", "docs", "vllm.md")
    with open(doc, encoding="utf-8") as f:
        text = f.read()
    found: Dict[str, Dict[str, Any]] = {}
    for arg in re.findall(r"--kv-transfer-config '([^']*)'", text):
        cfg = json.loads(arg)["kv_connector_extra_config"]
        for tier in cfg.get("secondary_tiers", []):
            if tier.get("module_path") == MODULE:
                found[tier["type"]] = cfg
    return found


def test_the_documented_lines_build_working_tiers(tmp_path: Any, redis_server: Any,
                                                  engines: List[Engine]) -> None:
    docs = _doc_configs()
    assert sorted(docs) == ["PagedKVDiskTier", "PagedKVRemoteTier"]
    for name, extra in docs.items():
        extra = json.loads(json.dumps(extra))
        extra["cpu_bytes_to_use"] = NUM_CHUNKS * CHUNK  # a test-sized primary tier
        [tier] = extra["secondary_tiers"]
        if name == "PagedKVDiskTier":
            tier["path"] = str(tmp_path / "kv")
            tier["capacity_bytes"] = 1 << 20
        else:
            tier["url"] = redis_server.url
        e = build(engines, config([], extra=extra))
        ks = keys(80, 81)
        data = payload(2, 8)
        e.store(ks, data)
        e.evict_primary()
        assert e.lookup(ks) == [HIT, HIT], name
        np.testing.assert_array_equal(e.load(ks), data)
