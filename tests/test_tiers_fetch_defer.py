"""The grouped tier fetch never blocks the engine's thread on a store's write.

With KV cache groups, a prompt probed while demotion writes still carry its blocks down to a store
is deferred: the admission gate (``TierCache.ready``) answers "not ready" at once (it used to wait
up to ``WRITE_WAIT_S`` on the scheduler's thread, stalling every running request's decode), the
sequence counts in ``num_fetching`` (the engine's "only waiting on the tiers" test), and a later
``ready`` probes once the writes are done, fetching the blocks from the store. A write that never
finishes delays the probe by ``WRITE_WAIT_S`` at most, after which the prompt is admitted and
recomputes. ``forget`` during a deferral leaves nothing behind.

Real parts: the Rust block manager with a full and a sliding group, a CPU swap engine and a real
disk store (its writes held on an event the test controls).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator, List, Tuple

import numpy as np
import pytest

pytest.importorskip("torch")

from pagedkv import BlockManager, KVCacheGroup  # noqa: E402
from pagedkv.config import CacheSpec  # noqa: E402
from pagedkv.kv_pool import KVPool  # noqa: E402
from pagedkv.tiers import BlockMeta, DiskStore, TierCache  # noqa: E402
from pagedkv.tiers import cache as tier_cache  # noqa: E402
from pagedkv.tiers.host import SwapEngine  # noqa: E402
from pagedkv.tiers.secret import TierSecret  # noqa: E402

from tier_waiting import Waiting  # noqa: E402

BS = 4
#: The write a test holds is released after this long at the latest (so nothing hangs).
HOLD_S = 5.0
#: A generous guard on a gate answer that must not wait for a write (it takes microseconds).
PROMPT_S = 0.5


class _HeldDisk(DiskStore):
    """A disk store whose writes wait until ``release`` is set (a loaded server, a slow disk)."""

    release: threading.Event

    def put(self, meta: BlockMeta, data: Any) -> bool:
        self.release.wait(HOLD_S)
        return super().put(meta, data)


class _Rig:
    def __init__(self, tmp_path: Any) -> None:
        spec = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=BS)
        self.bpb = spec.bytes_per_block
        self.m = BlockManager(16, BS, watermark_blocks=0, num_host_blocks=8, host_cache=True,
                              groups=[KVCacheGroup.full(), KVCacheGroup.sliding(8)])
        self.swap = SwapEngine(KVPool(spec, 16, "cpu"), 8, pin_memory=False)
        self.store = _HeldDisk(tmp_path / "kv", 1 << 20, b"f" * 16, spec.bytes_per_block,
                               max_tokens=BS, secret=TierSecret(b"t" * 32))
        self.store.release = threading.Event()
        self.tiers = TierCache(self.m, self.swap, [self.store], block_size=BS)
        self.tokens = list(range(1, 4 * BS + 2))
        self.hashes, self.salt, _ = self.m.lookup_tiers_groups(self.tokens)
        self.which = [(g, i) for g in (0, 1) for i in range(4)]

    def demote(self) -> None:
        """Every group's block of the prompt's four positions cached in the host tier (each page
        filled with its own value), then demoted: their writes to the store are held."""
        m, hashes, tokens, which = self.m, self.hashes, self.tokens, self.which
        slots = m.reserve_host_blocks(len(which))
        raw = self.swap.host.raw
        for s, (g, i) in zip(slots, which):
            raw[s] = 10 * i + g + 1
        m.commit_host_blocks(slots, [hashes[i] for _, i in which],
                             [None if i == 0 else hashes[i - 1] for _, i in which], self.salt,
                             [t for _, i in which for t in tokens[i * BS:(i + 1) * BS]], True,
                             groups=[g for g, _ in which])
        again = m.reserve_host_blocks(8)
        self.tiers.after_schedule()
        m.commit_host_blocks(again, list(range(1, 9)), [None] * 8, self.salt, [0] * (8 * BS),
                             False)
        assert m.lookup_tiers_groups(tokens)[2] == [[False] * 4, [False] * 4]
        raw.zero_()
        assert self.store.stats().puts == 0  # every write is held

    def gate(self, seq: Waiting) -> Tuple[bool, float]:
        """The gate's answer for ``seq`` and the seconds it took."""
        t0 = time.monotonic()
        ok = self.tiers.ready(seq)
        return ok, time.monotonic() - t0

    def idle(self) -> None:
        """No host slot is reserved or referenced: each is free or host-cached."""
        m = self.m
        m.check_invariants()
        assert m.num_seqs == 0
        assert all(m.host_block_refcount(h) == 0 for h in range(m.num_host_blocks))
        assert m.num_free_host_blocks + m.stats().host_cached_blocks == m.num_host_blocks
        assert m.host_blocks_available() == m.num_host_blocks


@pytest.fixture
def rig(tmp_path: Any) -> Iterator[_Rig]:
    r = _Rig(tmp_path)
    try:
        yield r
    finally:
        r.store.release.set()
        r.tiers.close()


def test_a_probe_whose_blocks_are_still_being_written_is_deferred_not_waited_for(
        rig: _Rig) -> None:
    """The gate answers "not ready" at once while the writes are held (no fetch started, no host
    slot reserved), counting the sequence as fetching; once the writes land the next answers
    probe and fetch exactly the blocks boundary 4 needs from the store, and the admission hits
    them."""
    rig.demote()
    seq = Waiting(1, rig.tokens)
    for _ in range(3):  # asked on several steps: never waits, still deferred
        ok, took = rig.gate(seq)
        assert ok is False
        assert took < PROMPT_S, took
        assert rig.tiers.num_fetching == 1
        assert rig.m.num_free_host_blocks == 8  # nothing reserved: no fetch yet
        assert rig.store.stats().puts == 0
    t0 = time.monotonic()
    rig.tiers.wait(0.05)  # an engine with nothing else to run waits on the writes, bounded
    assert time.monotonic() - t0 < PROMPT_S
    assert rig.tiers.stats.bytes_read["disk"] == 0 and rig.store.stats().hits == 0

    rig.store.release.set()
    deadline = time.monotonic() + 30
    while not rig.tiers.ready(seq):
        assert time.monotonic() < deadline
        assert rig.tiers.num_fetching == 1
        rig.tiers.wait()
    assert rig.tiers.num_fetching == 0
    assert rig.store.stats().puts == 8
    # Boundary 4 (position 16, window 8: from 9): group 0's four blocks, the sliding group's 2, 3.
    assert rig.m.lookup_tiers_groups(rig.tokens)[2] == [[True] * 4, [False, False, True, True]]
    assert rig.tiers.stats.bytes_read["disk"] == 6 * rig.bpb
    assert rig.store.stats().hits == 6 and rig.tiers.stats.failed_fetches == 0
    raw = rig.swap.host.raw
    pages = {int(raw[s][0]) for s in range(8) if bool((raw[s] == raw[s][0]).all())}
    assert pages == {0} | {10 * i + 1 for i in range(4)} | {10 * i + 2 for i in (2, 3)}
    r = rig.m.admit(1, rig.tokens)
    assert r.cached_tokens == r.cached_tokens_host == 4 * BS
    rig.tiers.admitted(seq, r)
    assert rig.tiers.stats.fetched_tokens["disk"] == 4 * BS
    rig.m.free(1)
    rig.idle()


def test_a_write_that_never_lands_delays_the_probe_by_write_wait_s_at_most(
        rig: _Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the writes held past the bound, the gate keeps answering at once; after
    ``WRITE_WAIT_S`` (from the first deferral) it probes without them: the store holds nothing,
    so the prompt is admitted and recomputes; no host slot is left reserved."""
    monkeypatch.setattr(tier_cache, "WRITE_WAIT_S", 0.3)
    rig.demote()
    seq = Waiting(1, rig.tokens)
    t0 = time.monotonic()
    answers = []
    while True:
        ok, took = rig.gate(seq)
        assert took < PROMPT_S, took
        answers.append(ok)
        if ok:
            break
        assert rig.tiers.num_fetching == 1
        assert time.monotonic() - t0 < HOLD_S - 1, "the deferral is not bounded"
        rig.tiers.wait()
    waited = time.monotonic() - t0
    assert answers[0] is False and len(answers) > 1
    assert waited >= 0.3
    assert rig.store.stats().puts == 0  # the writes are still held: no fetch could use them
    assert rig.tiers.num_fetching == 0
    assert rig.tiers.stats.bytes_read["disk"] == 0 and rig.store.stats().hits == 0
    r = rig.m.admit(1, rig.tokens)
    assert r.cached_tokens == 0  # recomputed
    rig.tiers.admitted(seq, r)
    rig.m.free(1)
    rig.idle()


def test_forget_during_a_deferral_leaves_nothing_behind(rig: _Rig) -> None:
    """A deferred sequence that leaves unadmitted drops its deferral: nothing counts as fetching,
    ``wait`` has nothing of it to wait for, and no host slot was touched; the same id asked again
    later probes afresh."""
    rig.demote()
    seq = Waiting(1, rig.tokens)
    assert rig.gate(seq)[0] is False
    assert rig.tiers.num_fetching == 1
    rig.tiers.forget(seq)
    assert rig.tiers.num_fetching == 0
    assert not rig.tiers._deferred and not rig.tiers._probed and not rig.tiers._fetches
    t0 = time.monotonic()
    rig.tiers.wait(1.0)  # nothing to wait for: returns at once
    assert time.monotonic() - t0 < PROMPT_S
    rig.idle()
    # The writes go on and land; a new sequence with the same prompt then fetches the blocks.
    rig.store.release.set()
    deadline = time.monotonic() + 30
    while rig.store.stats().puts < 8:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    again = Waiting(2, rig.tokens)
    while not rig.tiers.ready(again):
        assert time.monotonic() < deadline
        rig.tiers.wait()
    assert rig.store.stats().hits == 6
    r = rig.m.admit(2, rig.tokens)
    assert r.cached_tokens_host == 4 * BS
    rig.tiers.admitted(again, r)
    rig.m.free(2)
    rig.idle()


def test_an_engine_whose_queue_holds_only_a_deferred_prompt_waits_for_it(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine end to end (a tiny Gemma 3 text model: sliding beside full layers, a host
    tier of forty pages over a disk tier): every write to the disk is held through a first round
    of prompts served one at a time, so when the first prompt comes back its blocks are still on
    their way down. Its probe is deferred and nothing else can run: the engine waits on the
    tiers, step after step (it does not take the queue for stuck and drop the request); the
    writes are let go after a few such waits, the prompt's blocks come back from the disk, and
    every output is the first round's (and transformers' for that prompt)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from tiny_hybrid import MAX_LEN, VOCAB, greedy_reference, hybrid_config, save_hybrid

    from pagedkv import LLM, SamplingParams
    from pagedkv.engine.builder import sequence_blocks
    from pagedkv.layer_groups import group_layers, layer_kinds

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    # Generous: the writes are let go well within it, whatever this machine's load.
    monkeypatch.setattr(tier_cache, "WRITE_WAIT_S", 20.0)
    release = threading.Event()
    put = DiskStore.put

    def held_put(self: DiskStore, meta: BlockMeta, data: Any) -> bool:
        release.wait(30.0)
        return put(self, meta, data)

    monkeypatch.setattr(DiskStore, "put", held_put)

    kind = "gemma3_text"
    path = save_hybrid(kind, str(tmp_path / kind))
    grouping = group_layers(layer_kinds(hybrid_config(kind)), MAX_LEN, BS)
    page = int(grouping.slots) * 2 * BS * 2 * 16 * 4
    g = np.random.default_rng(8)
    prompts = [g.integers(0, VOCAB, n).tolist() for n in (42, 43, 41, 45)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    peak = sequence_blocks(grouping.groups, max(map(len, prompts)) + 6, BS, 64)
    llm = LLM(path, device="cpu", progress=False, block_size=BS, num_blocks=peak + peak // 4,
              max_num_seqs=2, max_num_batched_tokens=64, host_cache_memory=40 * page,
              disk_cache_dir=str(tmp_path / "kv"), disk_cache_memory="64MiB",
              prefill_tokens_per_s=1.0)
    try:
        tiers = llm.llm_engine.tiers
        assert tiers is not None
        waits_while_deferred = []
        wait = tiers.wait

        def spy(timeout_s: float = 0.05) -> None:
            if tiers._deferred and not tiers._fetches:
                waits_while_deferred.append(tiers.num_fetching)
                if len(waits_while_deferred) == 3:
                    release.set()  # the writes go on after the engine waited three times
            wait(timeout_s)

        monkeypatch.setattr(tiers, "wait", spy)

        def one(p: List[int]) -> List[int]:
            got = llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)
            return list(got[0].outputs[0].token_ids)

        first = [one(p) for p in prompts]
        disk = tiers.stores[0]
        assert disk.stats().puts == 0 and tiers.stats.demotions > 0  # all held
        again = one(prompts[0])
        assert release.is_set()
        assert len(waits_while_deferred) >= 3 and set(waits_while_deferred) == {1}
        assert again == first[0]
        dense = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert first[0] == greedy_reference(dense.eval(), prompts[0], 6)
        assert llm.stats().prefix_hits_by_tier.get("disk", 0) > 0
        assert [one(p) for p in prompts[1:]] == first[1:]
        m = llm.llm_engine.manager
        m.check_invariants()
        assert m.num_seqs == 0
        assert all(m.host_block_refcount(h) == 0 for h in range(m.num_host_blocks))
    finally:
        release.set()
        llm.shutdown()
