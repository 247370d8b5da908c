"""``pagedkv.tiers.cache`` and ``pagedkv.tiers.store`` on the CPU, with real parts: the Rust block
manager with a host tier, a real KV pool, host pool and swap engine, real disk stores in temporary
directories, a real KV-event sink.

What is held here: the order "after_schedule between schedule and execute" (a swap-out before it
raises TierOrderError and queues nothing), the store registry (a backend is a module and one line;
figures keyed by the store's name, a third backend included), the stores' evictions published as
BlockRemoved events, the measured read rate behind the load-or-recompute choice, the admission's
host share (``cached_tokens_host``) used to count fetched blocks, and host-pool blocks surviving a
round trip through a disk store.
"""

from __future__ import annotations

import sys
import time
import types
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pagedkv._core")
pytest.importorskip("msgspec")  # the events extra (EventSink); absent on a bare GPU machine

from pagedkv.buffers import StepBuffers  # noqa: E402
from pagedkv.config import CacheSpec  # noqa: E402
from pagedkv.errors import InvalidConfigError, TierOrderError  # noqa: E402
from pagedkv.events.publisher import EventSink  # noqa: E402
from pagedkv.events.schema import BlockRemoved, BlockStored  # noqa: E402
from pagedkv.kv_pool import KVPool  # noqa: E402
from pagedkv.manager import BlockManager  # noqa: E402
from pagedkv.tiers import (  # noqa: E402
    BACKENDS,
    BlockMeta,
    DiskStore,
    TierCache,
    TierStats,
    backend,
    build_stores,
    fingerprint_for_spec,
)
from pagedkv.tiers import cache as tier_cache  # noqa: E402
from pagedkv.tiers.host import HostKVPool, SwapEngine  # noqa: E402

from tier_waiting import Waiting  # noqa: E402

BS = 4
SPEC = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=BS)
FP = fingerprint_for_spec("test/tier-cache", SPEC)


class World:
    """A manager with a host tier over a real pool and swap engine, stepped by hand as the engine
    steps it (admit, step, after_schedule, swaps)."""

    def __init__(self, tmp: Any, *, num_blocks: int = 8, host_blocks: int = 2,
                 stores: Optional[List[Any]] = None, **cache_kw: Any) -> None:
        self.m = BlockManager(num_blocks, BS, watermark_blocks=0, num_host_blocks=host_blocks,
                              host_cache=True)
        self.buf = StepBuffers(4, 64, self.m.max_blocks_per_seq, device="cpu",
                               max_swaps=2 * num_blocks)
        self.m.attach_buffers(self.buf)
        self.pool = KVPool(SPEC, num_blocks, "cpu")
        self.swap = SwapEngine(self.pool, host_blocks, pin_memory=False)
        self.sink = EventSink()
        if stores is None:
            stores = [DiskStore(tmp / "disk", 1 << 20, FP, SPEC.bytes_per_block, max_tokens=BS)]
        self.tiers = TierCache(self.m, self.swap, stores, block_size=BS, events=self.sink,
                               **cache_kw)

    def fill(self, seq_id: int, tokens: List[int]) -> None:
        """Writes recognisable K/V into ``seq_id``'s blocks (a forward's stand-in)."""
        for b in self.m.block_table(seq_id):
            self.pool.kv[:, :, b] = float(b + 1)

    def run(self, seq_id: int, tokens: List[int], *, drain: bool = True) -> Any:
        """One prompt alone: admit, step, (after_schedule), apply the swaps, free."""
        r = self.m.admit(seq_id, tokens)
        info = self.m.step([seq_id], len(tokens) - r.cached_tokens)
        if drain:
            self.tiers.after_schedule()
        self.apply(info)
        self.fill(seq_id, tokens)
        self.m.free(seq_id)
        return r

    def apply(self, info: Any) -> None:
        host = self.buf.host
        if info.num_swap_out:
            self.swap.swap_out(np.asarray(host.swap_out[: info.num_swap_out]))
        if info.num_swap_in:
            self.swap.swap_in(np.asarray(host.swap_in[: info.num_swap_in]))

    def close(self) -> None:
        self.tiers.close()


def prompt(k: int) -> List[int]:
    return list(range(100 * k, 100 * k + 2 * BS + 1))  # two full blocks and one token


@pytest.fixture
def world(tmp_path: Any) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    w.close()


# ------------------------------------------------------------------ after_schedule's place


def test_a_swap_out_before_after_schedule_raises_and_queues_nothing(world: World) -> None:
    for k in range(4):
        world.run(k, prompt(k))
    # This step's write-backs need a host slot, so the manager demotes a host-cached block.
    r = world.m.admit(9, prompt(4))
    info = world.m.step([9], len(prompt(4)) - r.cached_tokens)
    assert info.num_swap_out and world.m.stats().demotions > world.tiers.stats.demotions
    host_before = world.swap.host.kv.clone()
    out_before = world.swap.num_swapped_out
    with pytest.raises(TierOrderError, match="after_schedule") as err:
        world.apply(info)  # the runner applying the step's swap lists, after_schedule skipped
    assert err.value.pending >= 1
    assert world.swap.num_swapped_out == out_before  # nothing queued
    # Compared as bits: the host pool starts uninitialised, and a NaN is unequal to itself.
    assert torch.equal(world.swap.host.kv.view(torch.int32), host_before.view(torch.int32))
    # The demoted blocks were saved before the raise; the check passes once they are taken.
    assert world.tiers.stats.demotions == world.m.stats().demotions
    world.tiers.after_schedule()
    world.apply(info)
    assert world.swap.num_swapped_out == out_before + info.num_swap_out
    world.tiers.close()
    assert world.tiers.stats.bytes_written["disk"] >= SPEC.bytes_per_block


def test_the_order_holds_without_any_store(tmp_path: Any) -> None:
    """With no store below the host a demoted block is only dropped, but the order is the same."""
    w = World(tmp_path, stores=[])
    for k in range(4):
        w.run(k, prompt(k))
    r = w.m.admit(9, prompt(4))
    info = w.m.step([9], len(prompt(4)) - r.cached_tokens)
    with pytest.raises(TierOrderError):
        w.apply(info)
    w.tiers.after_schedule()
    w.apply(info)
    assert w.tiers.stats.demotions == w.m.stats().demotions
    w.close()


# ------------------------------------------------------------------ the registry


def test_the_registry_builds_the_stores_a_config_asks_for(tmp_path: Any) -> None:
    assert list(BACKENDS) == ["disk", "remote"]  # fastest first
    none = types.SimpleNamespace(disk_cache_dir=None, remote_cache_url=None)
    assert build_stores(none, FP, SPEC.bytes_per_block) == []
    cfg = types.SimpleNamespace(disk_cache_dir=str(tmp_path / "kv"), disk_cache_memory=1 << 20,
                                remote_cache_url=None)
    stores = build_stores(cfg, FP, SPEC.bytes_per_block)
    try:
        assert [(s.name, s.locality) for s in stores] == [("disk", "LOCAL")]
        assert isinstance(stores[0], DiskStore) and stores[0].take_removed() == []
    finally:
        for s in stores:
            s.close()
    with pytest.raises(InvalidConfigError, match="unknown tier backend 'tape'"):
        backend("tape")


class MemStore:
    """A third backend, the whole of it: a dict of verified payloads (module ``tier_mem``)."""

    name = "mem"
    locality = "LOCAL"

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.blocks: dict = {}
        self.removed: List[int] = []
        self.read_delay_s = 0.0
        self.reads = 0

    @classmethod
    def from_config(cls, config: object, fingerprint: bytes, block_bytes: int) -> "MemStore":
        return cls(block_bytes)

    def put(self, meta: BlockMeta, data: Any) -> bool:
        self.blocks[meta.block_hash] = (meta, bytes(np.asarray(data)))
        return True

    def get_into(self, meta: BlockMeta, out: Any) -> bool:
        time.sleep(self.read_delay_s)
        self.reads += 1
        got = self.blocks.get(meta.block_hash)
        if got is None or got[0] != meta:
            return False
        np.asarray(out)[:] = np.frombuffer(got[1], np.uint8)
        return True

    def longest_prefix(self, hashes: Any) -> int:
        n = 0
        while n < len(hashes) and int(hashes[n]) in self.blocks:
            n += 1
        return n

    def stats(self) -> TierStats:
        return TierStats(usage_bytes=len(self.blocks) * self.block_bytes)

    def take_removed(self) -> List[int]:
        out, self.removed = self.removed, []
        return out

    def close(self) -> None:
        pass


@pytest.fixture
def mem_backend(monkeypatch: Any) -> None:
    module = types.ModuleType("tier_mem")
    module.MemStore = MemStore  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tier_mem", module)
    monkeypatch.setitem(BACKENDS, "mem", "tier_mem:MemStore")


def test_a_third_backend_is_one_line_and_its_figures_are_keyed_by_name(tmp_path: Any,
                                                                         mem_backend: None) -> None:
    cfg = types.SimpleNamespace(disk_cache_dir=str(tmp_path / "kv"), disk_cache_memory=1 << 20,
                                remote_cache_url=None)
    stores = build_stores(cfg, FP, SPEC.bytes_per_block)
    assert [s.name for s in stores] == ["disk", "mem"]
    w = World(tmp_path, host_blocks=2, stores=stores)
    try:
        for k in range(6):
            w.run(k, prompt(k))
        w.tiers.close()
        totals = w.tiers.totals(SPEC.bytes_per_block)
        assert set(totals["hits"]) == {"gpu", "host", "disk", "mem"}
        assert totals["bytes_written"]["mem"] == totals["bytes_written"]["disk"] > 0
        assert totals["usage"]["mem"] == len(stores[1].blocks) * SPEC.bytes_per_block
        stored = [e for e in w.sink.take() if isinstance(e, BlockStored) and e.medium == "STORAGE"]
        assert {e.locality for e in stored} == {"LOCAL"}
        # The Prometheus collector labels the figures with the store's name.
        pytest.importorskip("prometheus_client")
        from pagedkv.metrics import PagedKVCollector

        col = PagedKVCollector(w.m, bytes_per_block=SPEC.bytes_per_block, max_age_s=0.0,
                               tiers=lambda: w.tiers.totals(SPEC.bytes_per_block))
        written = {s.labels["tier"]: s.value for fam in col.collect()
                   if fam.name == "pagedkv_tier_written_bytes" for s in fam.samples
                   if s.name.endswith("_total")}
        assert written["mem"] == written["disk"] == totals["bytes_written"]["mem"]
        assert written["host"] > 0
    finally:
        w.tiers.close()


def test_a_name_is_taken_once(tmp_path: Any, monkeypatch: Any, mem_backend: None) -> None:
    monkeypatch.setattr(MemStore, "name", "host")
    with pytest.raises(InvalidConfigError, match="'host' is taken"):
        build_stores(types.SimpleNamespace(), FP, SPEC.bytes_per_block)
    monkeypatch.setattr(MemStore, "name", "mem")
    with pytest.raises(InvalidConfigError, match="'mem' is taken"):
        World(tmp_path, stores=[MemStore(SPEC.bytes_per_block), MemStore(SPEC.bytes_per_block)])


# ------------------------------------------------------------------ evictions as events


def test_the_stores_evictions_are_published_once_per_step(tmp_path: Any) -> None:
    store = MemStore(SPEC.bytes_per_block)
    w = World(tmp_path, stores=[store])
    try:
        w.run(0, prompt(0))
        w.sink.take()
        store.removed = [11, 12]
        w.run(1, prompt(1))
        removed = [e for e in w.sink.take() if isinstance(e, BlockRemoved)
                   and e.medium == "STORAGE"]
        assert len(removed) == 1 and removed[0].locality == "LOCAL"
        assert [int.from_bytes(h, "big") for h in removed[0].block_hashes] == [11, 12]
        assert w.tiers.stats.removed_blocks == {"mem": 2}
        w.run(2, prompt(2))  # drained: not published again
        assert not [e for e in w.sink.take() if isinstance(e, BlockRemoved)
                    and e.medium == "STORAGE"]
    finally:
        w.close()


# ------------------------------------------------------------------ fetches and their rate


def _demote_everything(w: World, first: int, n: int) -> None:
    for k in range(first, first + n):
        w.run(k, prompt(k))


def _fetch(w: World, seq: Waiting) -> Tuple[bool, Any]:
    """Asks the gate until the fetch is done; then admits ``seq`` as the scheduler would."""
    started = w.tiers.ready(seq)
    deadline = time.monotonic() + 10
    while not w.tiers.ready(seq):
        assert time.monotonic() < deadline
        w.tiers.wait(0.01)
    r = w.m.admit(seq.seq_id, seq.token_ids)
    w.tiers.admitted(seq, r)
    return started, r


def test_fetched_blocks_count_by_the_admissions_host_share(tmp_path: Any) -> None:
    store = MemStore(SPEC.bytes_per_block)
    w = World(tmp_path, num_blocks=6, host_blocks=2, stores=[store])
    try:
        w.run(0, prompt(0))
        _demote_everything(w, 1, 6)  # prompt 0 left the pool and the host tier, into the store
        assert w.m.lookup_tiers(prompt(0))[:2] == (0, 0)
        assert store.longest_prefix(w.m.lookup_tiers(prompt(0))[2]) == 2
        started, r = _fetch(w, Waiting(50, prompt(0)))
        assert started is False  # it waited for its reads
        assert r.cached_tokens_host == 2 * BS and r.cached_tokens_gpu == 0
        assert w.tiers.stats.fetched_tokens == {"mem": 2 * BS}
        assert w.tiers.stats.bytes_read == {"mem": 2 * SPEC.bytes_per_block}
        assert w.tiers.totals(SPEC.bytes_per_block)["hits"]["host"] == 0
    finally:
        w.close()


def test_the_read_rate_is_measured_and_decides_load_or_recompute(tmp_path: Any) -> None:
    store = MemStore(SPEC.bytes_per_block)
    store.read_delay_s = 0.02
    w = World(tmp_path, num_blocks=6, host_blocks=2, stores=[store],
              prefill_tokens_per_s=1e9)
    try:
        assert w.tiers.load_bytes_per_s == {}
        w.run(0, prompt(0))
        _demote_everything(w, 1, 6)
        # Not measured yet: loaded, and its reads measure the store.
        started, r = _fetch(w, Waiting(50, prompt(0)))
        assert started is False and r.cached_tokens_host == 2 * BS
        rate = w.tiers.load_bytes_per_s["mem"]
        assert 0 < rate <= SPEC.bytes_per_block / 0.02
        w.m.free(50)
        # Measured: 20 ms a block against a prefill of a nanosecond a token: recompute.
        _demote_everything(w, 10, 6)
        reads = store.reads
        assert w.tiers.ready(Waiting(51, prompt(0))) is True
        assert store.reads == reads and w.tiers.stats.skipped_fetches == 1
        # A slow prefill makes the same store worth loading.
        w.tiers.prefill_tokens_per_s = 1.0
        started, r = _fetch(w, Waiting(52, prompt(0)))
        assert started is False and r.cached_tokens_host == 2 * BS
        # The rate folds in new reads (an EWMA): faster reads raise it.
        store.read_delay_s = 0.0
        before = w.tiers.load_bytes_per_s["mem"]
        w.m.free(52)
        _demote_everything(w, 20, 6)
        _fetch(w, Waiting(53, prompt(0)))
        assert w.tiers.load_bytes_per_s["mem"] > before
    finally:
        w.close()


def test_a_skipped_store_is_measured_again_after_a_run_of_skips(tmp_path: Any) -> None:
    store = MemStore(SPEC.bytes_per_block)
    w = World(tmp_path, num_blocks=6, host_blocks=2, stores=[store],
              prefill_tokens_per_s=1e9, load_bytes_per_s={"mem": 1.0})
    try:
        w.run(0, prompt(0))
        _demote_everything(w, 1, 6)
        skipped = [w.tiers.ready(Waiting(100 + i, prompt(0))) for i in range(tier_cache.PROBE_AFTER_SKIPS)]
        assert all(skipped) and store.reads == 0
        assert w.tiers.stats.skipped_fetches == tier_cache.PROBE_AFTER_SKIPS
        started, _ = _fetch(w, Waiting(200, prompt(0)))
        assert started is False and store.reads == 2
        assert w.tiers.load_bytes_per_s["mem"] > 1.0
    finally:
        w.close()


# ------------------------------------------------------------------ the admission's split


def test_admit_and_resume_return_the_host_share(tmp_path: Any) -> None:
    m = BlockManager(8, BS, watermark_blocks=0, num_host_blocks=16, host_cache=True)
    m.attach_buffers(StepBuffers(4, 64, m.max_blocks_per_seq, device="cpu", max_swaps=16))
    for k in range(4):
        r = m.admit(k, prompt(k))
        m.step([k], len(prompt(k)))
        m.free(k)
    r = m.admit(9, prompt(0))  # prompt 0's blocks were evicted, some written back to the host
    assert r.cached_tokens == r.cached_tokens_gpu + r.cached_tokens_host == 2 * BS
    assert r.cached_tokens_host > 0 and m.stats().host_hit_tokens == r.cached_tokens_host
    m.step([9], len(prompt(0)) - r.cached_tokens)
    r = m.admit(10, prompt(0))
    assert (r.cached_tokens, r.cached_tokens_gpu, r.cached_tokens_host) == (2 * BS, 2 * BS, 0)
    m.recompute(10)
    m.free(9)
    r = m.resume(10)
    assert r.cached_tokens == r.cached_tokens_gpu + r.cached_tokens_host == 2 * BS
    [b] = m.admit_batch([11], [prompt(1)])
    assert b.cached_tokens == b.cached_tokens_gpu + b.cached_tokens_host


# ------------------------------------------------------------------ bytes through a store


def test_host_pool_blocks_round_trip_through_a_disk_store(tmp_path: Any) -> None:
    """Blocks written from HostKVPool slots come back verbatim into other slots."""
    spec = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_size=16)
    host = HostKVPool(spec, 8, pin_memory=False)
    torch.manual_seed(0)
    host.kv.copy_(torch.randn(host.kv.shape).to(host.kv.dtype))
    fp = fingerprint_for_spec("test/tiny-llama", spec)
    metas = [BlockMeta(1000 + i, 999 + i if i else None, 7, list(range(16 * i, 16 * i + 16)))
             for i in range(3)]
    with DiskStore(tmp_path / "d", 1 << 20, fp, spec.bytes_per_block, max_tokens=16) as d:
        for i, m in enumerate(metas):
            assert d.put(m, host.raw[i].numpy())
        assert d.longest_prefix([m.block_hash for m in metas]) == 3
        for i, m in enumerate(metas):
            assert d.get_into(m, host.raw[5 + i].numpy())
    assert torch.equal(host.kv[5:8].view(torch.int16), host.kv[0:3].view(torch.int16))


# ------------------------------------------------------------------ the package's edges


def test_the_tiers_package_stands_apart_from_the_engine() -> None:
    """``import pagedkv.tiers`` loads neither torch nor redis; no module of it loads the engine."""
    import os
    import subprocess
    from pathlib import Path

    import pagedkv.tiers as tiers

    code = (
        "import sys, importlib, pagedkv.tiers\n"
        "assert 'torch' not in sys.modules and 'redis' not in sys.modules, 'heavy import'\n"
        "for m in ('store', 'cache', 'model', 'disk', 'record', 'fingerprint', 'host'):\n"
        "    importlib.import_module('pagedkv.tiers.' + m)\n"
        "bad = [m for m in sys.modules if m.startswith('pagedkv.engine')]\n"
        "assert not bad, bad\n"
    )
    pkg = str(Path(tiers.__file__).resolve().parent.parent.parent)
    env = dict(os.environ, PYTHONPATH=pkg)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
