"""pagedkv's drop-in vLLM ``KVCacheManager`` against vLLM's own, call for call.

Replays seeded serving traces (admissions with shared prefixes and prefix-cache hits, chunked
prefill, decode with lookahead slots, preemption-style frees, evictions under a small pool) on
vLLM's ``KVCacheManager`` and on :class:`pagedkv.vllm.manager.PagedKVCacheManager` side by side
and requires the same answer from every call (block ids, hit lengths, refusals, free counts,
cached keys), plus a coherent pagedkv state after each step. Skips when vLLM is not importable
(``scripts/test_vllm.sh`` runs it with vLLM installed).
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

if os.environ.get("PAGEDKV_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm.v1.core.kv_cache_manager")

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

from pagedkv.errors import InvalidConfigError
from pagedkv.vllm import activate_manager, deactivate_manager, is_manager_active
from pagedkv.vllm.manager import DropInKVCacheManager, PagedKVCacheManager
from pagedkv.vllm.pool import PagedKVBlockPool

BS = 4


def _config(num_blocks: int, groups: int = 1) -> KVCacheConfig:
    specs = [
        KVCacheGroupSpec(
            ["full"],
            FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32),
        )
    ]
    if groups == 2:
        specs.append(
            KVCacheGroupSpec(
                ["swa"],
                SlidingWindowSpec(
                    block_size=BS,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                    sliding_window=8,
                ),
            )
        )
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs)


def _manager(cls: type, num_blocks: int, groups: int = 1, **kw: Any) -> Any:
    return cls(
        _config(num_blocks, groups),
        max_model_len=256,
        scheduler_block_size=BS,
        hash_block_size=BS,
        **kw,
    )


def _request(rid: str, prompt: list[int], max_tokens: int = 64) -> Request:
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, eos_token_id=None)
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )


def _ids(blocks: Any) -> Any:
    return None if blocks is None else blocks.get_block_ids()


def _keys(m: Any) -> dict[int, Any]:
    return {b.block_id: b.block_hash for b in m.block_pool.blocks if b.block_hash is not None}


def _events(m: Any) -> list[tuple[str, Any]]:
    out = []
    for e in m.take_events():
        if isinstance(e, BlockStored):
            out.append(("stored", tuple(e.block_hashes)))
        elif isinstance(e, BlockRemoved):
            out.append(("removed", tuple(e.block_hashes)))
        else:
            out.append((type(e).__name__, None))
    return out


class _Twin:
    """One request's copy on each manager."""

    def __init__(self, rid: str, prompt: list[int], out_len: int) -> None:
        self.reqs = [_request(rid, prompt), _request(rid, prompt)]
        self.out_len = out_len


def _replay(seed: int, num_blocks: int, caching: bool, events: bool, lookahead: int,
            groups: int = 1) -> int:
    init_none_hash(sha256)
    rng = random.Random(seed)
    kw = dict(enable_caching=caching, enable_kv_cache_events=events, log_stats=True)
    stock = _manager(KVCacheManager, num_blocks, groups, **kw)
    ours = _manager(PagedKVCacheManager, num_blocks, groups, **kw)
    assert isinstance(ours.block_pool, PagedKVBlockPool) and ours.fast == (groups == 1)
    ms = (stock, ours)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(3, 14))] for _ in range(4)]
    waiting: list[_Twin] = []
    running: list[_Twin] = []
    n = checks = 0
    for step in range(160):
        for _ in range(rng.randrange(0, 3)):
            n += 1
            suffix = [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
            prompt = rng.choice(prefixes) + suffix
            waiting.append(_Twin(f"r{n}", prompt, rng.randrange(1, 20)))
        # Admissions: lookup, then a first chunk (chunked prefill when the prompt is long).
        still: list[_Twin] = []
        for t in waiting:
            res = [m.get_computed_blocks(r) for m, r in zip(ms, t.reqs)]
            assert [(_ids(b), h, s) for b, h, s in res] == [
                (_ids(b), h, s) for b, h, s in res[:1]
            ] * 2
            hit = res[0][1]
            left = t.reqs[0].num_tokens - hit
            chunk = min(left, rng.choice([left, 5, 9]))
            got = [
                m.allocate_slots(r, chunk, hit, b, num_lookahead_tokens=lookahead)
                for m, r, (b, _, _) in zip(ms, t.reqs, res)
            ]
            assert _ids(got[0]) == _ids(got[1]), step
            if got[0] is None:
                still.append(t)
                continue
            for r in t.reqs:
                r.status = RequestStatus.RUNNING
                r.num_computed_tokens = hit + chunk
            running.append(t)
        waiting = still
        # One step for every running request: the rest of a prefill, or one decode token.
        nxt: list[_Twin] = []
        for t in running:
            r0 = t.reqs[0]
            todo = r0.num_tokens - r0.num_computed_tokens
            new = todo if todo > 0 else 1
            got = [
                m.allocate_slots(r, new, num_lookahead_tokens=lookahead)
                for m, r in zip(ms, t.reqs)
            ]
            assert _ids(got[0]) == _ids(got[1]), step
            if got[0] is None:
                # Preempted: freed and back to the queue (as the scheduler does).
                for m, r in zip(ms, t.reqs):
                    m.free(r)
                    r.status = RequestStatus.PREEMPTED
                    r.num_computed_tokens = 0
                waiting.append(t)
                continue
            tok = rng.randrange(1000)
            for r in t.reqs:
                r.num_computed_tokens += new
                if r.num_computed_tokens >= r.num_tokens:
                    r.append_output_token_ids(tok)
            if r0.num_output_tokens >= t.out_len or rng.random() < 0.02:
                for m, r in zip(ms, t.reqs):
                    m.free(r)
                continue
            nxt.append(t)
        running = nxt
        for t in running:
            a, b = (m.get_block_ids(r.request_id) for m, r in zip(ms, t.reqs))
            assert a == b
            assert _ids(ms[0].get_blocks(t.reqs[0].request_id)) == _ids(
                ms[1].get_blocks(t.reqs[1].request_id)
            )
        assert stock.block_pool.get_num_free_blocks() == ours.block_pool.get_num_free_blocks()
        assert stock.usage == ours.usage
        assert _keys(stock) == _keys(ours)
        assert _events(stock) == _events(ours)
        ours.check_coherence()
        checks += 1
        if step == 80 and not running:
            assert stock.reset_prefix_cache() == ours.reset_prefix_cache()
    s, p = stock.make_prefix_cache_stats(), ours.make_prefix_cache_stats()
    assert s is not None and p is not None
    assert (s.requests, s.queries, s.hits) == (p.requests, p.queries, p.hits)
    return checks


@pytest.mark.parametrize(
    "seed,num_blocks,caching,events,lookahead",
    [
        (0, 40, True, True, 0),
        (1, 24, True, False, 2),  # small pool: refusals, preemptions, evictions
        (2, 64, False, False, 0),
        (3, 30, True, True, 3),
    ],
)
def test_same_answers_as_vllm(
    seed: int, num_blocks: int, caching: bool, events: bool, lookahead: int
) -> None:
    assert _replay(seed, num_blocks, caching, events, lookahead) == 160


@pytest.mark.parametrize(
    "seed,num_blocks,caching,events,lookahead",
    [
        (10, 64, True, True, 0),
        (11, 36, True, False, 2),  # small pool: refusals, preemptions, evictions in both groups
        (12, 48, True, True, 3),
    ],
)
def test_hybrid_same_answers_as_vllm(
    seed: int, num_blocks: int, caching: bool, events: bool, lookahead: int
) -> None:
    """A full-attention group beside a sliding-window one: vLLM's coordinator over pagedkv's
    pool answers as vLLM's manager over vLLM's pool does, step by step (tables, keys, events,
    usage, prefix-cache stats)."""
    assert _replay(seed, num_blocks, caching, events, lookahead, groups=2) == 160


def test_hybrid_served_on_the_pagedkv_pool_and_no_group_falls_back() -> None:
    kw = dict(max_model_len=64, scheduler_block_size=BS, hash_block_size=BS)
    m = DropInKVCacheManager(_config(32, groups=2), **kw)
    assert type(m) is DropInKVCacheManager and not m.fast
    assert isinstance(m.block_pool, PagedKVBlockPool)
    assert len(m.coordinator.single_type_managers) == 2
    m1 = DropInKVCacheManager(_config(32), **kw)
    assert type(m1) is DropInKVCacheManager and m1.fast
    empty = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[])
    # vLLM builds an attention-free model's manager with prefix caching off.
    with pytest.raises(InvalidConfigError, match=r"at least one KV cache group, got 0"):
        PagedKVCacheManager(empty, enable_caching=False, **kw)
    assert type(DropInKVCacheManager(empty, enable_caching=False, **kw)) is KVCacheManager


def test_activation_rebinds_the_schedulers_manager() -> None:
    from vllm.v1.core.sched import scheduler

    before = scheduler.KVCacheManager
    try:
        assert activate_manager() is DropInKVCacheManager
        assert scheduler.KVCacheManager is DropInKVCacheManager and is_manager_active()
    finally:
        deactivate_manager()
    assert scheduler.KVCacheManager is before and not is_manager_active()


def test_register_switches_on_the_manager_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.sched import scheduler

    from pagedkv.vllm import register

    stock_cls = scheduler.KVCacheManager
    try:
        monkeypatch.setenv("PAGEDKV_VLLM_MANAGER", "0")
        monkeypatch.delenv("PAGEDKV_VLLM_POOL", raising=False)
        register()
        assert scheduler.KVCacheManager is stock_cls
        monkeypatch.setenv("PAGEDKV_VLLM_MANAGER", "1")
        register()
        assert scheduler.KVCacheManager is DropInKVCacheManager
    finally:
        deactivate_manager()
    assert scheduler.KVCacheManager is stock_cls

