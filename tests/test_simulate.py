"""The synthetic workload and the paged-vs-contiguous simulator, run through the real manager."""

import json
import math

import numpy as np
import pytest

from pagedkv.cli import main
from pagedkv.config import CapacityError
from pagedkv.errors import InvalidConfigError
from pagedkv.simulate import SimConfig, plot_timeline, result_json, simulate
from pagedkv.workload import WorkloadConfig, generate

pytest.importorskip("pagedkv._core")


# ------------------------------------------------------------------------------------ workload

def test_generate_is_deterministic_and_sorted():
    cfg = WorkloadConfig(num_requests=200, seed=7, num_prefixes=2, prefix_len=40, n_samples=2)
    a, b = generate(cfg), generate(cfg)
    assert [r.req_id for r in a] == list(range(200))
    assert all(x.arrival_step <= y.arrival_step for x, y in zip(a, a[1:]))
    for x, y in zip(a, b):
        assert x.arrival_step == y.arrival_step and x.outputs == y.outputs
        assert np.array_equal(x.prompt, y.prompt)
    c = generate(WorkloadConfig(num_requests=200, seed=8, num_prefixes=2, prefix_len=40, n_samples=2))
    assert any(not np.array_equal(x.prompt, y.prompt) for x, y in zip(a, c))


def test_lengths_are_capped_to_max_model_len():
    cfg = WorkloadConfig(num_requests=500, prompt_median=400, prompt_sigma=1.5, output_median=300,
                         output_sigma=1.5, max_model_len=512, n_samples=3)
    for r in generate(cfg):
        assert 1 <= r.prompt_len <= 511
        assert all(1 <= n for n in r.output_lens)
        assert r.prompt_len + max(r.output_lens) <= 512
        assert len(r.outputs) == 3
        assert r.prompt.dtype == np.int64 and int(r.prompt.max()) < cfg.vocab_size


def test_distribution_parameters_take_effect():
    cfg = WorkloadConfig(num_requests=4000, arrival_rate=0.25, prompt_median=600, prompt_sigma=1.0,
                         output_median=250, output_sigma=0.8, max_model_len=1 << 20, seed=1)
    reqs = generate(cfg)
    prompts = np.array([r.prompt_len for r in reqs])
    outputs = np.array([r.output_lens[0] for r in reqs])
    assert abs(np.median(prompts) / 600 - 1) < 0.06
    assert abs(np.median(outputs) / 250 - 1) < 0.06
    assert abs(np.std(np.log(prompts)) - 1.0) < 0.05
    rate = len(reqs) / reqs[-1].arrival_step
    assert abs(rate / 0.25 - 1) < 0.05


def test_shared_prefixes():
    cfg = WorkloadConfig(num_requests=300, num_prefixes=3, prefix_len=64, prefix_fraction=0.5, seed=3)
    reqs = generate(cfg)
    with_prefix = [r for r in reqs if r.prefix_id is not None]
    assert 0.4 < len(with_prefix) / len(reqs) < 0.6
    assert {r.prefix_id for r in with_prefix} == {0, 1, 2}
    for pid in range(3):
        heads = [r.prompt[:64] for r in with_prefix if r.prefix_id == pid]
        assert all(np.array_equal(h, heads[0]) for h in heads)
    heads = {tuple(r.prompt[:64]) for r in with_prefix}
    assert len(heads) == 3
    assert all(r.prompt_len > 64 for r in with_prefix)


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_requests=0), dict(arrival_rate=0), dict(arrival_rate=float("inf")), dict(prompt_median=-1),
     dict(output_sigma=-0.1), dict(max_model_len=1), dict(num_prefixes=2), dict(prefix_len=5),
     dict(num_prefixes=1, prefix_len=8191), dict(prefix_fraction=1.5), dict(n_samples=0),
     dict(seed=-1), dict(vocab_size=2**33), dict(num_requests=True), dict(arrival_rate="fast")],
)
def test_workload_validation(kwargs):
    with pytest.raises(InvalidConfigError):
        WorkloadConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_blocks=0), dict(block_size=0), dict(max_num_seqs=0), dict(max_prefill_tokens=0),
     dict(check_every=-1), dict(watermark_blocks=-1), dict(num_blocks=1.5)],
)
def test_sim_config_validation(kwargs):
    base = dict(num_blocks=64)
    base.update(kwargs)
    with pytest.raises(InvalidConfigError):
        SimConfig(**base)


# ----------------------------------------------------------------------------------- simulator

def _small(**overrides):
    w = dict(num_requests=120, arrival_rate=0.5, prompt_median=100, prompt_sigma=0.8,
             output_median=50, output_sigma=0.6, max_model_len=1024, seed=11)
    s = dict(num_blocks=256, block_size=16)
    for k, v in overrides.items():
        (s if k in SimConfig.__dataclass_fields__ else w)[k] = v
    return WorkloadConfig(**w), SimConfig(**s)


def test_single_request_matches_hand_arithmetic():
    w, s = _small(num_requests=1, max_model_len=2048, num_blocks=512)
    (req,) = generate(w)
    p, out, a = req.prompt_len, req.output_lens[0], req.arrival_step
    res = simulate(w, s)
    lens = np.arange(p, p + out)  # tokens held after each of its steps: prefill, then decodes
    cap = 512 * 16
    for pol in (res.paged, res.contiguous):
        assert pol.steps == a + out
        assert pol.requests_served == 1 and pol.output_tokens == out
        assert pol.peak_concurrency == 1
        assert pol.mean_concurrency == pytest.approx(out / (a + out))
        assert pol.mean_latency_steps == out and pol.mean_queue_steps == 0
        assert pol.kv_utilization_mean == pytest.approx(lens.sum() / cap / (a + out))
        assert pol.kv_utilization_peak == pytest.approx(lens[-1] / cap)
    paged_waste = (np.ceil(lens / 16) * 16 - lens).mean()
    assert res.paged.waste_tokens_per_seq == pytest.approx(paged_waste)
    assert res.contiguous.waste_tokens_per_seq == pytest.approx((2048 - lens).mean())
    assert res.contiguous.waste_fraction == pytest.approx((2048 - lens).sum() / (2048 * out))
    assert res.paged.preemptions == 0 and res.paged.blocks_saved_by_sharing_peak == 0


def test_unconstrained_policies_agree():
    # Plenty of memory for both: same schedule, same timing, same utilization.
    w, s = _small(num_requests=60, arrival_rate=0.05, max_model_len=256, num_blocks=4096)
    res = simulate(w, s)
    p, c = res.paged, res.contiguous
    assert c.max_concurrency_limit == 4096 * 16 // 256
    assert p.peak_concurrency < c.max_concurrency_limit
    assert (p.steps, p.output_tokens, p.peak_concurrency) == (c.steps, c.output_tokens, c.peak_concurrency)
    assert p.mean_latency_steps == c.mean_latency_steps
    assert p.mean_queue_steps == c.mean_queue_steps == 0
    assert p.kv_utilization_mean == pytest.approx(c.kv_utilization_mean)
    assert np.array_equal(p.timeline["concurrency"], c.timeline["concurrency"])
    assert p.preemptions == 0
    assert 0 <= p.waste_tokens_per_seq <= 15


def test_memory_bound_paged_beats_contiguous():
    w, s = _small()
    res = simulate(w, s)
    p, c = res.paged, res.contiguous
    assert c.max_concurrency_limit == 256 * 16 // 1024 == 4
    assert c.peak_concurrency == 4
    assert p.peak_concurrency > 2 * c.peak_concurrency
    assert p.steps < c.steps
    assert p.tokens_per_step > c.tokens_per_step
    assert p.output_tokens == c.output_tokens == sum(sum(r.output_lens) for r in generate(w))
    assert p.requests_served == c.requests_served == 120
    assert p.kv_utilization_mean > c.kv_utilization_mean
    assert p.kv_utilization_peak <= 1.0
    assert p.waste_tokens_per_seq < 16 < c.waste_tokens_per_seq
    assert p.waste_fraction < 0.1 < c.waste_fraction


def test_preemption_recompute_keeps_invariants_and_leaks_nothing():
    # A tight pool under heavy load: appends run out and the newest request is recomputed.
    w, s = _small(num_requests=150, arrival_rate=2.0, output_median=120, num_blocks=160,
                  check_every=1)
    res = simulate(w, s)  # check_invariants every step; raises on a leak at the end
    p = res.paged
    assert p.preemptions > 0
    assert p.recomputed_prompt_tokens > 0
    assert p.requests_served == 150
    # Re-admissions find the victims' full blocks still cached.
    assert p.prefix_hit_ratio > 0
    assert p.kv_utilization_peak <= 1.0


def test_deterministic_json():
    w, s = _small(num_requests=80, n_samples=2, num_prefixes=2, prefix_len=48)
    a = result_json(simulate(w, s))
    b = result_json(simulate(w, s))
    assert a == b
    w2, _ = _small(num_requests=80, n_samples=2, num_prefixes=2, prefix_len=48, seed=12)
    assert result_json(simulate(w2, s)) != a


def test_parallel_sampling_shares_and_copies_on_write():
    w, s = _small(num_requests=60, n_samples=3, num_blocks=1024, check_every=7)
    res = simulate(w, s)
    p = res.paged
    assert p.cow_copies > 0
    assert p.blocks_saved_by_sharing_peak > 0 and p.blocks_saved_by_sharing_mean > 0
    assert p.kv_utilization_peak <= 1.0
    assert p.output_tokens == sum(sum(r.output_lens) for r in generate(w))
    # Contiguous reserves a full max_model_len slot per sample: 16 slots, at most 5 requests.
    assert res.contiguous.max_concurrency_limit == 16
    assert res.contiguous.peak_concurrency <= 16 < p.peak_concurrency
    assert res.contiguous.steps > p.steps


def test_shared_prefixes_hit_the_cache():
    w, s = _small(num_requests=100, num_prefixes=2, prefix_len=128, prefix_fraction=1.0,
                  arrival_rate=0.3, num_blocks=1024)
    on = simulate(w, s).paged
    assert on.prefix_hit_ratio > 0.3
    assert on.blocks_saved_by_sharing_mean > 0
    off = simulate(w, SimConfig(num_blocks=1024, enable_prefix_caching=False)).paged
    assert off.prefix_hit_ratio == 0 and off.blocks_saved_by_sharing_peak == 0
    assert on.kv_utilization_mean < off.kv_utilization_mean  # shared blocks are held once


def test_no_sharing_means_nothing_saved():
    res = simulate(*_small(num_requests=50))
    assert res.paged.blocks_saved_by_sharing_peak == 0 and res.paged.cow_copies == 0


def test_scheduler_limits():
    w, s = _small(num_requests=40, max_num_seqs=2)
    res = simulate(w, s)
    assert res.paged.peak_concurrency <= 2 and res.contiguous.peak_concurrency <= 2
    # A one-token prompt budget still admits one request per step.
    w, s = _small(num_requests=40, arrival_rate=5.0, max_prefill_tokens=1, num_blocks=2048)
    res = simulate(w, s)
    assert res.paged.requests_served == 40
    assert res.paged.mean_queue_steps > 0


def test_pool_too_small_is_a_capacity_error():
    with pytest.raises(CapacityError, match="cannot guarantee progress"):
        simulate(*_small(max_model_len=1024, num_blocks=64))
    with pytest.raises(CapacityError):
        simulate(*_small(max_model_len=512, n_samples=4, num_blocks=128))
    with pytest.raises(InvalidConfigError, match="max_num_seqs"):
        simulate(*_small(n_samples=4, max_num_seqs=2, num_blocks=1024))


REQUIRED_KEYS = {
    "peak_concurrency_paged", "peak_concurrency_contiguous", "kv_utilization_mean",
    "waste_tokens_per_seq_paged", "waste_fraction_contiguous", "prefix_hit_ratio",
    "blocks_saved_by_sharing", "preemptions", "steps_paged", "steps_contiguous",
    "tokens_per_step_paged", "tokens_per_step_contiguous",
}


def test_cli_json_has_required_keys(capsys):
    rc = main(["simulate", "--num-blocks", "256", "--max-model-len", "1024", "--requests", "60",
               "--rate", "0.5", "--prompt-median", "100", "--output-median", "40", "--json"])
    assert rc == 0
    captured = capsys.readouterr()
    obj = json.loads(captured.out)
    assert REQUIRED_KEYS <= set(obj)
    assert obj["num_blocks"] == 256 and obj["contiguous_slots"] == 4
    assert obj["peak_concurrency_paged"] > obj["peak_concurrency_contiguous"]
    assert "paged" not in captured.err  # --json implies no progress bar
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in obj.values())


def test_cli_text_report_and_plot(tmp_path, capsys):
    png = tmp_path / "sim.png"
    rc = main(["simulate", "--num-blocks", "256", "--max-model-len", "1024", "--requests", "40",
               "--prompt-median", "100", "--output-median", "40", "--plot", str(png), "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "peak concurrency" in out and "contiguous" in out and f"plot written to {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_needs_a_timeline(tmp_path):
    res = simulate(*_small(num_requests=10), record_timeline=False)
    with pytest.raises(InvalidConfigError):
        plot_timeline(res, str(tmp_path / "x.png"))
    res = simulate(*_small(num_requests=10))
    with pytest.raises(InvalidConfigError, match="cannot write plot"):
        plot_timeline(res, str(tmp_path / "missing-dir" / "x.png"))


def test_cli_simulate_capacity_error_exits_2(capsys):
    assert main(["simulate", "--num-blocks", "64", "--max-model-len", "4096", "--requests", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv simulate: error:") and err.count("\n") == 1


def _brute_force_physical(mgr, seq_ids):
    """Slots holding KV, from the block tables: each block's fill, each block once."""
    B = mgr.block_size
    fill = {}
    for sid in seq_ids:
        n = mgr.seq_len(sid)
        for j, b in enumerate(mgr.block_table(sid)):
            fill[b] = max(fill.get(b, 0), min(B, n - j * B))
    return sum(fill.values()), len(fill)


def test_physical_token_count_matches_block_tables():
    from pagedkv.manager import BlockManager
    from pagedkv.simulate import _physical_tokens

    mgr = BlockManager(64, 4)
    prompt = list(range(10))
    mgr.admit(1, prompt)  # 3 blocks, tail holds 2
    mgr.fork(1, 2)        # shares all three, tail included
    mgr.fork(1, 3)
    live = [1, 2, 3]

    def check():
        used = mgr.num_blocks - mgr.num_free_blocks
        expected, distinct = _brute_force_physical(mgr, live)
        assert distinct == used
        assert _physical_tokens(mgr, [(s, mgr.seq_len(s)) for s in live], used) == expected
        return expected

    assert check() == 10                  # one copy of the prompt, however many holders
    mgr.append_batch([2], [100])          # copy-on-write of the shared tail
    assert check() == 10 + 3
    mgr.append_batch([1, 2, 3], [7, 8, 9])
    # Full blocks shared once; 1 copies the tail it shared with 3, 3 then owns it alone, 2 fills its own.
    assert check() == 8 + 3 + 3 + 4
    mgr.admit(4, prompt[:8] + [55, 56, 57])  # shares nothing yet: no step has registered blocks
    live.append(4)
    assert check() == 8 + 3 + 3 + 4 + 11
