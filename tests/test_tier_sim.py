"""The simulator's tiers: the real host tier under the scheduler, a modelled disk, the sweep CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv.errors import InvalidConfigError
from pagedkv.simulate import SimConfig, simulate_tiers
from pagedkv.workload import WorkloadConfig

WL = WorkloadConfig(num_requests=120, arrival_rate=2.0, prompt_median=300, output_median=16,
                    max_model_len=2048, num_prefixes=24, prefix_len=512, prefix_fraction=0.9,
                    seed=3)


def test_each_tier_adds_hits_and_the_gpu_share_stays() -> None:
    sim = SimConfig(num_blocks=160, block_size=16, preemption_mode="recompute", check_every=25)
    pts = simulate_tiers(WL, sim, [0, 200], [0, 2000])
    by = {(p.host_cache_blocks, p.disk_cache_blocks): p for p in pts}
    assert set(by) == {(0, 0), (200, 0), (200, 2000)}
    none, host, disk = by[(0, 0)], by[(200, 0)], by[(200, 2000)]
    assert none.hits_by_tier["host"] == 0 and none.hits_by_tier["disk"] == 0
    # The host tier adds hits; the GPU pool's share moves only with the schedule (host hits
    # shorten prefills, which changes what runs together), not down by what the tier serves.
    assert host.hits_by_tier["gpu"] >= 0.8 * none.hits_by_tier["gpu"]
    assert host.hits_by_tier["host"] > 0
    assert disk.hits_by_tier["disk"] > 0
    assert none.prefix_hit_ratio < host.prefix_hit_ratio < disk.prefix_hit_ratio
    assert disk.modelled_ttft_mean_s < none.modelled_ttft_mean_s


def test_a_burst_of_host_hits_fits_one_step() -> None:
    """Many requests arriving together, each with a prefix the host tier holds, admitted in
    one step: their loads outnumber two whole sequences' blocks (the step buffers' old swap
    capacity, which made the step fail with BufferTooSmallError)."""
    wl = WorkloadConfig(num_requests=300, arrival_rate=200.0, prompt_median=200,
                        output_median=4, max_model_len=256, num_prefixes=60, prefix_len=160,
                        prefix_fraction=1.0, seed=1)
    sim = SimConfig(num_blocks=120, block_size=16, max_num_seqs=64,
                    preemption_mode="recompute")
    none, host = simulate_tiers(wl, sim, [0, 600], [0])
    assert none.hits_by_tier["host"] == 0 and host.hits_by_tier["host"] > 0.2


def test_tier_settings_are_checked() -> None:
    with pytest.raises(InvalidConfigError, match="disk_cache_blocks"):
        SimConfig(num_blocks=16, disk_cache_blocks=4)
    with pytest.raises(InvalidConfigError, match="host_cache_blocks"):
        SimConfig(num_blocks=16, host_cache_blocks=-1)


def test_the_sweep_cli_prints_json_and_plots(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv", "simulate", "--requests", "60", "--num-blocks", "200",
         "--max-model-len", "2048",
         "--num-prefixes", "8", "--prefix-len", "512", "--host-cache", "0", "256MiB",
         "--disk-cache", "0", "2GiB", "--json", "--plot", str(png)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert len(d["points"]) == 3
    assert png.stat().st_size > 10_000
    bad = subprocess.run([sys.executable, "-m", "pagedkv", "simulate", "--disk-cache", "1GiB"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--host-cache" in bad.stderr
