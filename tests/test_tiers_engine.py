"""The tiered prefix cache through the engine (CPU, fp32, greedy): host, disk and remote tiers.

Every test runs the same multi-prompt workload twice in a KV pool too small to keep it, so the
second round finds its prefixes only below the GPU, and checks the outputs equal a run without
tiers token for token, the hits land in the tier that should serve them, and the manager's
invariants hold. The disk tier runs in a temp dir (restart, corruption); the remote tier against a
real ``redis-server`` on loopback (two engines sharing it, a dead server).
"""

from __future__ import annotations

import os
import random
from typing import Any, Dict, List, Tuple

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import pagedkv  # noqa: E402
from pagedkv.errors import ConfigArgumentError  # noqa: E402

from tiny_llama import save_tiny_llama  # noqa: E402

BS = 16
POOL = 24  # blocks: the workload's 6 prompts of 6 full blocks each do not fit
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # layers x K,V x tokens x kv heads x head dim x fp32
SP = pagedkv.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiers-model")), 512)


def _prompts(seed: int = 0, n: int = 6, length: int = 100) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 128) for _ in range(length)] for _ in range(n)]


def _run(model_dir: str, rounds: int = 2, prompts: Any = None, device: str = "cpu",
         on_engine: Any = None, **kw: Any) -> Tuple[List[List[int]], Any, Any]:
    """Runs the workload (each prompt alone, ``rounds`` times) on a fresh LLM; ``on_engine``,
    if given, is called with the LLM before the first prompt."""
    llm = pagedkv.LLM(model_dir, device=device, num_blocks=POOL, block_size=BS, max_num_seqs=2,
                      progress=False, **kw)
    outs = []
    try:
        if on_engine is not None:
            on_engine(llm)
        for _ in range(rounds):
            for p in prompts or _prompts():
                out = llm.generate([{"prompt_token_ids": p}], SP, use_tqdm=False)
                outs.append(list(out[0].outputs[0].token_ids))
        llm.llm_engine.manager.check_invariants()
        stats = llm.stats()
        tiers = llm.llm_engine.tiers
        store_stats = {s.name: s.stats() for s in tiers.stores} if tiers else {}
    finally:
        llm.shutdown()
    return outs, stats, store_stats


@pytest.fixture(scope="module")
def baseline(model_dir: str) -> List[List[int]]:
    outs, stats, _ = _run(model_dir)
    assert stats.prefix_hits_by_tier == {"gpu": stats.prefix_hit_tokens}
    return outs


@pytest.mark.parametrize("fused", [True, False])
def test_host_tier_serves_evicted_prefixes_with_the_same_outputs(model_dir: str,
                                                                 baseline: List[List[int]],
                                                                 fused: bool) -> None:
    """Through the fused forward and through transformers' own module forwards."""
    outs, stats, _ = _run(model_dir, host_cache_memory="1MiB", fused_model=fused)
    assert outs == baseline
    hits = stats.prefix_hits_by_tier
    assert set(hits) == {"gpu", "host"}
    # Round two: every prompt's 6 full blocks come back, from the host tier (the pool kept none).
    assert hits["host"] >= 6 * 6 * BS // 2
    assert sum(hits.values()) == stats.prefix_hit_tokens
    assert stats.tier_bytes_read["host"] == hits["host"] // BS * BLOCK_BYTES
    assert stats.tier_bytes_written["host"] > 0
    assert 0 < stats.tier_usage_bytes["host"] <= 2**20


def test_one_step_may_load_more_blocks_than_two_sequences_hold(model_dir: str) -> None:
    """Many prompts admitted in one step, each with its blocks in the host tier: the step's
    swap-in list holds more pairs than two whole sequences' worth (what the step buffers used to
    carry: the step then failed with BufferTooSmallError), and the outputs are a tierless run's."""
    prompts = _prompts(seed=5, n=40, length=100)
    kw: Dict[str, Any] = dict(device="cpu", num_blocks=200, block_size=BS, max_num_seqs=16,
                              progress=False)
    outs = {}
    for label, tier in (("none", {}), ("host", {"host_cache_memory": "4MiB"})):
        llm = pagedkv.LLM(model_dir, **kw, **tier)
        try:
            reqs = [{"prompt_token_ids": p} for p in prompts]
            llm.generate(reqs, SP, use_tqdm=False)
            got = llm.generate(reqs, SP, use_tqdm=False)
            outs[label] = [list(o.outputs[0].token_ids) for o in got]
            llm.llm_engine.manager.check_invariants()
            hits = llm.stats().prefix_hits_by_tier
        finally:
            llm.shutdown()
    assert outs["host"] == outs["none"]
    # More host-tier blocks came back than 2 x 32 (two sequences of this model's context).
    assert hits["host"] // BS > 2 * (512 // BS)


def test_disk_tier_serves_what_the_host_tier_dropped(model_dir: str, baseline: List[List[int]],
                                                     tmp_path: Any) -> None:
    outs, stats, stores = _run(model_dir, host_cache_memory="64KiB",
                               disk_cache_dir=str(tmp_path / "kv"), disk_cache_memory="64MiB")
    assert outs == baseline
    assert stats.prefix_hits_by_tier["disk"] > 0
    assert stats.tier_bytes_read["disk"] > 0 and stats.tier_bytes_written["disk"] > 0
    assert stores["disk"].hits > 0 and stores["disk"].corrupt == 0
    assert stats.tier_usage_bytes["disk"] > 0
    assert sum(stats.prefix_hits_by_tier.values()) == stats.prefix_hit_tokens


def test_a_restarted_engine_finds_its_prefixes_on_disk(model_dir: str, baseline: List[List[int]],
                                                       tmp_path: Any) -> None:
    kv = str(tmp_path / "kv")
    # Recompute priced far above any disk read: every block on disk is loaded, however fast this
    # machine prefills (the load-or-recompute choice is tested in test_tier_cache.py).
    args: Dict[str, Any] = dict(host_cache_memory="64KiB", disk_cache_dir=kv,
                                disk_cache_memory="64MiB", prefill_tokens_per_s=1.0)
    # Six other prompts after the workload push its blocks out of the pool and the host tier.
    first, _, _ = _run(model_dir, rounds=1, prompts=_prompts() + _prompts(seed=1), **args)
    assert first[:6] == baseline[:6]
    # The key is kept (owner-only) with the cache, so a new process hashes the same way.
    assert oct(os.stat(kv).st_mode & 0o777) == "0o700"
    again, stats, _ = _run(model_dir, rounds=1, **args)
    assert again == baseline[:6]
    assert stats.prefix_hits_by_tier["disk"] >= 6 * 6 * BS // 2


def test_corrupt_disk_blocks_are_misses_never_wrong_kv(model_dir: str, baseline: List[List[int]],
                                                      tmp_path: Any) -> None:
    kv = tmp_path / "kv"
    args: Dict[str, Any] = dict(host_cache_memory="64KiB", disk_cache_dir=str(kv),
                                disk_cache_memory="64MiB")
    _run(model_dir, rounds=1, prompts=_prompts() + _prompts(seed=1), **args)
    # Flip bytes all over every segment file: every record's checksum fails.
    for f in kv.iterdir():
        if f.is_file() and f.stat().st_size > 4096 and f.name not in ("hash.key", "lock"):
            data = bytearray(f.read_bytes())
            for i in range(200, len(data), 1024):
                data[i] ^= 0xFF
            f.write_bytes(bytes(data))
    outs, stats, stores = _run(model_dir, rounds=1, **args)
    assert outs == baseline[:6]
    assert stats.prefix_hits_by_tier.get("disk", 0) == 0
    assert stores["disk"].hits == 0


def test_two_engines_share_the_remote_tier(model_dir: str, baseline: List[List[int]],
                                           redis_url: str, monkeypatch: Any) -> None:
    monkeypatch.setenv("PAGEDKV_TIER_SECRET", "a fleet secret shared by both test engines")
    args: Dict[str, Any] = dict(host_cache_memory="64KiB", remote_cache_url=redis_url,
                                remote_cache_timeout_s=1.0, hash_seed=1234)
    first, s1, _ = _run(model_dir, rounds=1, prompts=_prompts() + _prompts(seed=1), **args)
    assert first[:6] == baseline[:6]
    assert s1.tier_bytes_written["remote"] > 0
    # A second engine (its own GPU pool and host tier) serves the first's prefixes from Redis.
    second, s2, stores = _run(model_dir, rounds=1, **args)
    assert second == baseline[:6]
    assert s2.prefix_hits_by_tier["remote"] > 0
    assert stores["remote"].hits > 0


def test_a_dead_remote_server_only_costs_misses(model_dir: str, baseline: List[List[int]],
                                                redis_server: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("PAGEDKV_TIER_SECRET", "a fleet secret shared by both test engines")
    url = redis_server.url
    redis_server.stop()
    outs, stats, stores = _run(model_dir, host_cache_memory="64KiB", remote_cache_url=url,
                               remote_cache_timeout_s=0.05, hash_seed=99)
    assert outs == baseline
    assert stats.prefix_hits_by_tier.get("remote", 0) == 0
    assert stores["remote"].errors + stores["remote"].unavailable + stores["remote"].timeouts > 0


@pytest.mark.gpu
def test_gpu_host_and_disk_tiers_keep_greedy_outputs(model_dir: str, tmp_path: Any) -> None:
    """On CUDA (compiled kernels, fp32, the pinned host tier and its side-stream copies): the
    evicted prefixes come back from the host tier, then from disk, with the outputs of a run
    without tiers token for token, and exactly the bytes the hits account for."""
    import torch

    kw: Dict[str, Any] = dict(device="cuda", dtype=torch.float32)
    base, _, _ = _run(model_dir, **kw)
    outs, stats, _ = _run(model_dir, host_cache_memory="1MiB", **kw)
    assert outs == base
    assert stats.prefix_hits_by_tier["host"] >= 6 * 6 * BS // 2
    assert stats.tier_bytes_read["host"] == stats.prefix_hits_by_tier["host"] // BS * BLOCK_BYTES
    # The tiny model prefills a block on the GPU faster than the disk tier reads it back, so the
    # cost model would (rightly) recompute rather than fetch after the first measured read: pin
    # the prefill rate low so this test exercises the disk path itself, every time.
    outs, stats, stores = _run(model_dir, host_cache_memory="64KiB",
                               disk_cache_dir=str(tmp_path / "kv"), disk_cache_memory="64MiB",
                               prefill_tokens_per_s=100.0, **kw)
    assert outs == base
    assert stats.prefix_hits_by_tier["disk"] > 0 and stores["disk"].corrupt == 0


def test_tier_settings_are_checked(model_dir: str, tmp_path: Any) -> None:
    with pytest.raises(ConfigArgumentError, match="host_cache_memory"):
        pagedkv.LLM(model_dir, device="cpu", disk_cache_dir=str(tmp_path), disk_cache_memory="1MiB")
    with pytest.raises(ConfigArgumentError, match="disk_cache_memory"):
        pagedkv.LLM(model_dir, device="cpu", host_cache_memory="1MiB", disk_cache_dir=str(tmp_path))
    with pytest.raises(ConfigArgumentError, match="enable_prefix_caching"):
        pagedkv.LLM(model_dir, device="cpu", host_cache_memory="1MiB", enable_prefix_caching=False)
    with pytest.raises(ConfigArgumentError, match="remote_cache_url"):
        pagedkv.LLM(model_dir, device="cpu", host_cache_memory="1MiB",
                    remote_cache_url="http://x")
    with pytest.raises(ConfigArgumentError, match="host_cache_memory"):
        pagedkv.LLM(model_dir, device="cpu", host_cache_memory=0)
