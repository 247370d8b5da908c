"""``pagedkv simulate`` with KV cache groups: the grouped paged run beside full-attention
accounting, in the same memory, through the real manager."""

import json

import pytest

from pagedkv.cli import main
from pagedkv.config import CacheSpec, CapacityError, size_groups
from pagedkv.errors import InvalidConfigError
from pagedkv.simulate import SimConfig, format_report, plot_timeline, result_dict, simulate
from pagedkv.workload import WorkloadConfig

pytest.importorskip("pagedkv._core")

# A small hybrid: 4 layers, 3 sliding (window 64) and 1 full.
KINDS = [("sliding", 64), ("sliding", 64), ("sliding", 64), ("full", 0)]
SPEC = CacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_size=16)
WORKLOAD = WorkloadConfig(num_requests=120, arrival_rate=2.0, prompt_median=300,
                          prompt_sigma=0.5, output_median=200, output_sigma=0.5,
                          max_model_len=1024, num_prefixes=2, prefix_len=128,
                          prefix_fraction=0.5, seed=3)


def _sim(num_blocks: int = 400, **kw):
    sizing = size_groups(SPEC, KINDS, num_blocks * SPEC.bytes_per_block, WORKLOAD.max_model_len)
    return SimConfig(num_blocks=num_blocks, block_size=16, max_num_seqs=256,
                     groups=tuple(g.as_tuple() for g in sizing.groups),
                     group_num_blocks=sizing.num_blocks, **kw), sizing


def test_grouped_run_fits_more_sequences_in_the_same_memory():
    sim, sizing = _sim()
    assert sizing.grouping.slots == 1 and sim.group_num_blocks == 4 * 400
    res = simulate(WORKLOAD, sim)
    g, p = res.grouped, res.paged
    assert g is not None
    assert g.requests_served == p.requests_served == WORKLOAD.num_requests
    assert g.output_tokens == p.output_tokens
    # Memory-bound: a sequence holds ~ceil(L/16) + 3 × 5 pages of a quarter block's bytes, so
    # more run at once, and the workload finishes sooner.
    assert g.mean_concurrency > 1.5 * p.mean_concurrency
    assert g.steps < p.steps
    assert g.peak_concurrency > p.peak_concurrency
    assert 0 < g.kv_utilization_mean <= g.kv_utilization_peak <= 1
    assert g.prefix_hit_ratio > 0  # the shared prefixes hit with groups too
    assert g.policy == "paged, groups"
    # Deterministic.
    again = simulate(WORKLOAD, sim)
    assert again.grouped is not None and again.grouped.steps == g.steps
    assert again.grouped.prefix_hit_ratio == g.prefix_hit_ratio


def test_report_json_and_plot_show_the_grouped_run(tmp_path):
    pytest.importorskip("matplotlib")
    sim, _ = _sim()
    res = simulate(WORKLOAD, sim)
    text = format_report(res)
    assert "paged, groups" in text
    assert "4 KV cache groups (1 full, 3 sliding 64) over 1,600 pages" in text
    assert "the mean concurrency of full-attention accounting" in text
    d = result_dict(res)
    assert d["groups"] == [["full", 0]] + [["sliding", 64]] * 3 and d["group_num_blocks"] == 1600
    assert d["mean_concurrency_groups"] == pytest.approx(res.grouped.mean_concurrency, abs=1e-6)
    assert d["prefix_hit_ratio_groups"] == pytest.approx(res.grouped.prefix_hit_ratio, abs=1e-6)
    out = tmp_path / "t.png"
    plot_timeline(res, str(out))
    assert out.stat().st_size > 1000
    # Without groups nothing changes.
    plain = simulate(WORKLOAD, SimConfig(num_blocks=400, block_size=16, max_num_seqs=256))
    assert plain.grouped is None and "paged, groups" not in format_report(plain)
    assert "groups" not in result_dict(plain)


def test_capacity_check_counts_every_group():
    # 64 full-attention blocks: 128 pages; one 1024-token sample needs 64 (full) + min(64, 5 + 64)
    # (sliding: its window plus one prefill chunk of the whole context) pages.
    from dataclasses import replace

    with pytest.raises(CapacityError, match="pages"):
        simulate(replace(WORKLOAD, num_requests=2), SimConfig(num_blocks=70, block_size=16, watermark_blocks=0,
                                     groups=(("full", 0), ("sliding", 64)), group_num_blocks=127))


@pytest.mark.parametrize("kw, field", [
    ({"groups": (("full", 0), ("sliding", 64))}, "group_num_blocks"),
    ({"group_num_blocks": 10}, "group_num_blocks"),
    ({"groups": (("sliding", 64), ("full", 0)), "group_num_blocks": 10}, "groups"),
    ({"groups": (("full", 0), ("window", 64)), "group_num_blocks": 10}, "layer_kinds"),
    ({"groups": (), "group_num_blocks": 10}, "groups"),
    # The host tier works with groups; the modelled disk holds one group's chain only.
    ({"groups": (("full", 0), ("sliding", 64)), "group_num_blocks": 10,
      "host_cache_blocks": 8, "disk_cache_blocks": 8}, "disk_cache_blocks"),
    ({"groups": (("full", 0), ("sliding", 64)), "group_num_blocks": 10,
      "group_block_bytes": (4096,)}, "group_block_bytes"),
    ({"groups": (("full", 0), ("sliding", 64)), "group_num_blocks": 10,
      "group_block_bytes": (4096, 0)}, "group_block_bytes"),
    ({"group_block_bytes": (4096,)}, "group_block_bytes"),
    ({"groups": (("full", 0), ("sliding", 64)), "group_num_blocks": -1}, "group_num_blocks"),
])
def test_bad_group_config_is_refused(kw, field):
    with pytest.raises(InvalidConfigError) as info:
        SimConfig(num_blocks=100, **kw)
    assert info.value.field == field


def test_host_tier_with_groups_is_accepted():
    sim = SimConfig(num_blocks=100, groups=(("full", 0), ("sliding", 64)), group_num_blocks=10,
                    host_cache_blocks=8, group_block_bytes=[4096, 512])
    assert sim.host_cache_blocks == 8 and sim.group_block_bytes == (4096, 512)
    assert sim.group_page_bytes() == (4096, 512)
    # Without sizes: a page of the same memory, 100 blocks of 16 x 131072 bytes over 10 pages.
    plain = SimConfig(num_blocks=100, groups=(("full", 0), ("sliding", 64)), group_num_blocks=10)
    assert plain.group_page_bytes() == (100 * 16 * 131072 // 10,) * 2


def test_cli_simulate_hf_config_with_groups(tmp_path, capsys):
    cfg = {"model_type": "gemma3_text", "torch_dtype": "float16", "hidden_size": 256,
           "intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
           "sliding_window": 128, "sliding_window_pattern": 6, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["simulate", "--hf-config", str(tmp_path), "--num-blocks", "300", "--requests", "60",
            "--rate", "1", "--prompt-median", "300", "--output-median", "100",
            "--max-model-len", "1024", "--quiet"]
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    # 5 sliding layers and 1 full: 6 groups of 1 layer; the same memory in 6× as many pages.
    assert d["groups"][0] == ["full", 0] and len(d["groups"]) == 6
    assert d["group_num_blocks"] == 300 * 6
    assert d["mean_concurrency_groups"] > d["mean_concurrency_paged"]
    assert main(argv) == 0
    assert "paged, groups" in capsys.readouterr().out
    assert main(argv + ["--no-kv-groups", "--json"]) == 0
    assert "groups" not in json.loads(capsys.readouterr().out)


def test_cli_simulate_every_layer_sliding(tmp_path, capsys):
    """Mistral-7B-v0.1's shape (a sliding window on every layer): the grouped run is one sliding
    group of every layer (pages as large as full-attention blocks), and holds more sequences."""
    cfg = {"model_type": "mistral", "torch_dtype": "float16", "hidden_size": 256,
           "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 1000, "sliding_window": 128,
           "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["simulate", "--hf-config", str(tmp_path), "--num-blocks", "300", "--requests", "60",
            "--rate", "1", "--prompt-median", "300", "--output-median", "100",
            "--max-model-len", "1024", "--quiet", "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["groups"] == [["sliding", 128]] and d["group_num_blocks"] == 300
    assert d["mean_concurrency_groups"] > d["mean_concurrency_paged"]
    SimConfig(num_blocks=100, groups=(("sliding", 64), ("chunked", 32)), group_num_blocks=10)


def test_grouped_run_swaps_every_group():
    """A pool too small for the workload with a host pool and ``preemption_mode="swap"``: the
    grouped run preempts by swap (every group's blocks out and back), serves every request and
    ends with the manager's invariants checked and nothing left allocated."""
    from dataclasses import replace

    # Long outputs arriving at once in 66 blocks (264 pages): the running sequences outgrow it.
    work = replace(WORKLOAD, num_requests=24, arrival_rate=50.0, prompt_median=200,
                   output_median=600)
    sim, _ = _sim(num_blocks=66, num_host_blocks=4000, preemption_mode="swap")
    res = simulate(work, sim)
    g = res.grouped
    assert g is not None
    assert g.requests_served == work.num_requests
    assert g.preemptions_swap > 0 and g.preemptions_recompute == 0
    assert g.swap_ins == g.preemptions_swap  # each swapped sequence came back
    assert res.paged.requests_served == work.num_requests
    assert f"{g.preemptions} (swap {g.preemptions_swap}, recompute 0)" in format_report(res)
    assert result_dict(res)["preemptions_swap_groups"] == g.preemptions_swap


def test_shared_documents_longer_than_the_window_keep_their_hits():
    # Two 192-token documents (three windows of 64) shared by 90% of the requests, under load.
    # Each request steps past a document's window right after its prefill; a document read by
    # one request after another keeps its window held while a reader runs. Before, the windows
    # went to the LRU's evicting end: 0.135 of prompt tokens hit with groups against 0.374
    # counted as full attention (0.36 of it); now 0.279, with 2.6x the concurrency. The rest of
    # full accounting's figure is its 36 preempted requests re-admitted (recompute) hitting their
    # own computed tokens: on first admissions, 137 of 160 requests hit the whole document with
    # groups against 134 counted as full attention.
    wl = WorkloadConfig(num_requests=160, arrival_rate=2.0, prompt_median=400, prompt_sigma=0.3,
                        output_median=120, output_sigma=0.3, max_model_len=1024, num_prefixes=2,
                        prefix_len=192, prefix_fraction=0.9, seed=5)
    sim, _ = _sim(num_blocks=200, check_every=25)
    res = simulate(wl, sim)
    g, p = res.grouped, res.paged
    assert g is not None
    assert g.mean_concurrency > 1.5 * p.mean_concurrency
    assert p.prefix_hit_ratio > 0.2
    assert g.prefix_hit_ratio >= 0.7 * p.prefix_hit_ratio, (g.prefix_hit_ratio, p.prefix_hit_ratio)
