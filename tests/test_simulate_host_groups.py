"""``pagedkv simulate`` with KV cache groups and the host tier of the prefix cache: the grouped
run drives the core's grouped host tier (every group's blocks keyed by chain hash and group),
reports hits by tier, and its modelled TTFT prices the blocks each admission loads at their
group's bytes.

The first test works one admission out by hand on the manager itself; the others run a
Gemma-3-shaped group set (five sliding layers per full one) on a trace whose prompts overflow the
device pool."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from pagedkv.config import CacheSpec, size_groups
from pagedkv.errors import InvalidConfigError
from pagedkv.simulate import SimConfig, format_report, result_dict, simulate, simulate_tiers
from pagedkv.workload import WorkloadConfig

pytest.importorskip("pagedkv._core")

B = 16


def test_one_admission_by_hand_prices_each_groups_loaded_blocks():
    """A 100-token prompt (6 shareable blocks) with groups full + sliding 32, pushed off the
    device by another prompt, comes back from the host tier: group 0 loads its 6 blocks, the
    sliding group only the two its window still reads (positions from 96 - 32 + 1 = 65 on:
    blocks 4 and 5). At 1000 and 10 bytes a block that is 6020 bytes; the TTFT is the 4
    uncached tokens' prefill plus those bytes over the link."""
    from pagedkv.buffers import StepBuffers
    from pagedkv.manager import BlockManager
    from pagedkv.tiers.model import ModelledDiskTier

    groups = (("full", 0), ("sliding", 32))
    mgr = BlockManager(14, B, watermark_blocks=0, max_blocks_per_seq=8, groups=groups,
                       num_host_blocks=64, host_cache=True)
    bufs = StepBuffers(4, 256, 8, device="cpu", backend="numpy", max_swaps=32, num_groups=2)
    mgr.attach_buffers(bufs)
    prefill, link = 1000.0, 1e4
    tiers = ModelledDiskTier(mgr, 0, block_size=B, block_bytes=2000, group_block_bytes=(1000, 10),
                             prefill_tokens_per_s=prefill, host_bytes_per_s=link,
                             disk_bytes_per_s=1e9)
    a = SimpleNamespace(seq_id=1, token_ids=list(range(1, 101)), cache_salt=None)
    b = SimpleNamespace(seq_id=2, token_ids=list(range(1001, 1101)), cache_salt=None)

    def serve(seq):
        r = mgr.admit(seq.seq_id, seq.token_ids)
        tiers.admitted(seq, r)
        info = mgr.step([seq.seq_id], [r.num_tokens - r.cached_tokens])
        tiers.step_built(bufs.views(info, on_device=False).swap_in)
        mgr.free(seq.seq_id)
        mgr.check_invariants()
        return r

    first = serve(a)
    assert first.cached_tokens == 0
    serve(b)  # 14 pages: takes every page, evicting (offloading) all of a's cached blocks
    again = serve(SimpleNamespace(seq_id=3, token_ids=a.token_ids, cache_salt=None))
    assert (again.cached_tokens_gpu, again.cached_tokens_host) == (0, 96)
    s = tiers.stats
    assert s.loaded_blocks == {"host": [6, 2], "disk": [0, 0]}
    assert s.loaded_bytes == {"host": 6 * 1000 + 2 * 10, "disk": 0}
    assert s.hit_tokens == {"gpu": 0, "host": 96, "disk": 0}
    assert s.ttft_s == pytest.approx([100 / prefill, 100 / prefill, 4 / prefill + 6020 / link])
    assert mgr.stats().host_loaded_blocks == 8


# A Gemma-3-shaped model: five sliding-window layers per full one.
KINDS = ([("sliding", 128)] * 5 + [("full", 0)]) * 2
SPEC = CacheSpec(num_layers=12, num_kv_heads=2, head_dim=64, dtype="float16", block_size=B)
#: 24 system prompts of 512 tokens on 90% of 150 requests: far more than the device pool keeps.
WL = WorkloadConfig(num_requests=150, arrival_rate=2.0, prompt_median=600, prompt_sigma=0.3,
                    output_median=16, max_model_len=2048, num_prefixes=24, prefix_len=512,
                    prefix_fraction=0.9, seed=3)


def _sim(num_blocks: int = 200, **kw):
    sizing = size_groups(SPEC, KINDS, num_blocks * SPEC.bytes_per_block, WL.max_model_len)
    return SimConfig(num_blocks=num_blocks, block_size=B, max_num_seqs=64,
                     preemption_mode="recompute", kv_bytes_per_token=SPEC.bytes_per_token,
                     groups=tuple(g.as_tuple() for g in sizing.groups),
                     group_num_blocks=sizing.num_blocks,
                     group_block_bytes=(sizing.page_bytes,) * sizing.num_groups,
                     check_every=25, **kw), sizing


def test_gemma3_groups_host_tier_adds_hits_on_an_overflowing_trace():
    sim, sizing = _sim()
    # The shared prompts alone need 24 x 32 blocks of every layer: four times the pool.
    assert WL.num_prefixes * WL.prefix_len // B > 3 * sim.num_blocks
    assert sizing.num_groups == 6 and sizing.grouping.slots == 2
    none = simulate(WL, sim, record_timeline=False)
    host = simulate(WL, replace(sim, host_cache_blocks=400), record_timeline=False)
    g0, g1 = none.grouped, host.grouped
    assert g0 is not None and g1 is not None
    assert g1.requests_served == g0.requests_served == WL.num_requests
    assert g0.prefix_hits_by_tier == {}  # no tier: nothing counted by tier
    hits = g1.prefix_hits_by_tier
    assert hits["host"] > 0 and hits["disk"] == 0
    assert g1.prefix_hit_ratio > g0.prefix_hit_ratio + 0.02
    assert hits["gpu"] + hits["host"] == pytest.approx(g1.prefix_hit_ratio
                                                       * g1.admitted_prompt_tokens, abs=1)
    # Every group loaded blocks; a sliding group only its window's per hit, so fewer than the
    # full group's, and fewer than the host tokens' blocks.
    loads = g1.tier_loaded_blocks["host"]
    assert len(loads) == 6 and all(n > 0 for n in loads)
    assert max(loads[1:]) < hits["host"] // B
    assert g1.tier_loaded_bytes["host"] == sum(loads) * sizing.page_bytes
    assert g1.tier_loaded_bytes["disk"] == 0
    assert 0 < g1.modelled_ttft_mean_s
    # The full-accounting run has the host tier too, in whole-model blocks.
    p = host.paged
    assert p.prefix_hits_by_tier["host"] > 0
    assert p.tier_loaded_bytes["host"] == (p.tier_loaded_blocks["host"][0]
                                           * SPEC.bytes_per_token * B)
    # Reports: hits by tier and TTFT for both paged runs.
    d = result_dict(host)
    assert d["prefix_hits_by_tier_groups"] == hits
    assert d["tier_loaded_blocks_groups"] == {"host": loads, "disk": [0] * 6}
    assert d["modelled_ttft_mean_s_groups"] == pytest.approx(g1.modelled_ttft_mean_s, abs=1e-6)
    assert d["prefix_hits_by_tier"] == p.prefix_hits_by_tier
    text = format_report(host)
    assert "host-tier hits" in text and "modelled TTFT" in text


def test_gemma3_groups_tier_sweep_and_disk_refused():
    sim, _ = _sim()
    pts = simulate_tiers(WL, sim, [0, 400], [0], grouped=True)
    none, host = pts
    assert none.hits_by_tier["host"] == 0 < host.hits_by_tier["host"]
    assert none.prefix_hit_ratio < host.prefix_hit_ratio
    assert len(host.loaded_blocks["host"]) == 6
    with pytest.raises(InvalidConfigError) as info:
        simulate_tiers(WL, sim, [400], [1000], grouped=True)
    assert info.value.field == "disk_cache_blocks"
    assert "host_cache_blocks" in str(info.value)


def test_cli_tier_sweep_runs_the_groups(tmp_path, capsys):
    import json

    from pagedkv.cli import main

    cfg = {"model_type": "gemma3_text", "torch_dtype": "float16", "hidden_size": 256,
           "intermediate_size": 512, "num_hidden_layers": 12, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
           "sliding_window": 128, "sliding_window_pattern": 6, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["simulate", "--hf-config", str(tmp_path), "--num-blocks", "200", "--requests", "150",
            "--rate", "2", "--prompt-median", "600", "--output-median", "16",
            "--max-model-len", "2048", "--num-prefixes", "24", "--prefix-len", "512",
            "--prefix-fraction", "0.9", "--seed", "3", "--quiet", "--host-cache", "0", "60MiB"]
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    # 10 sliding layers and 2 full: 6 groups of 2 layers, a page of 2 layers x 16 tokens.
    assert d["groups"][0] == ["full", 0] and len(d["groups"]) == 6
    page = 2 * 2 * 2 * 64 * 2 * 16  # layers x K,V x heads x dims x fp16 bytes x tokens
    assert d["group_block_bytes"] == [page] * 6
    none, host = d["points"]
    assert none["grouped"] and host["grouped"]
    assert host["hits_by_tier"]["host"] > 0.05 and host["prefix_hit_ratio"] > none["prefix_hit_ratio"]
    assert host["loaded_bytes"]["host"] == sum(host["loaded_blocks"]["host"]) * page
    assert main(argv) == 0
    assert "KV cache groups: 6 groups over 1,200 pages" in capsys.readouterr().out
    # The disk tier is refused with groups, and runs with full-attention accounting.
    assert main(argv + ["--disk-cache", "0", "100MiB"]) != 0
    err = capsys.readouterr().err
    assert "--disk-cache with gemma3_text's 6 KV cache groups" in err and "--no-kv-groups" in err
    assert main(argv + ["--disk-cache", "0", "100MiB", "--no-kv-groups", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "groups" not in d and len(d["points"]) == 3 and not d["points"][0]["grouped"]
    assert d["points"][2]["hits_by_tier"]["disk"] > 0


def test_groups_swap_and_host_tier_share_the_host_pool():
    """Swap preemption and the host tier in one host pool with groups: swapped sequences come
    back (their swap-ins are not priced as tier loads: the run's own check compares the priced
    loads with the manager's ``host_loaded_blocks``), and the tier serves hits."""
    from test_simulate_groups import WORKLOAD, _sim as _small

    work = replace(WORKLOAD, num_requests=40, arrival_rate=50.0, prompt_median=200,
                   output_median=600, seed=1)
    sim, _ = _small(num_blocks=66, num_host_blocks=4000, preemption_mode="swap",
                    host_cache_blocks=300, check_every=10)
    g = simulate(work, sim, record_timeline=False).grouped
    assert g is not None and g.requests_served == work.num_requests
    assert g.preemptions_swap > 0 and g.swap_ins == g.preemptions_swap
    assert g.prefix_hits_by_tier["host"] > 0
    assert sum(g.tier_loaded_blocks["host"]) > 0
