"""The simulator's tier sweep: :func:`simulate_tiers` runs the paged policy (full accounting, or
with KV cache groups) once per (host, disk) tier size pair over the same requests,
:class:`TierPoint` holds each run's hit ratios by tier, loads and modelled TTFT, and
:func:`format_tier_sweep` / :func:`plot_tier_sweep` report them.

Invariants: every point replays the same generated requests; a disk tier without a host tier is
skipped. Imported through :mod:`pagedkv.simulate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._sim_config import SimConfig
from ._sim_exec import _simulate_paged
from .config import format_bytes
from .errors import InvalidConfigError
from .workload import WorkloadConfig, generate



@dataclass
class TierPoint:
    """One paged run of a tier sweep: the tier sizes and what they served."""

    host_cache_blocks: int
    disk_cache_blocks: int
    prefix_hit_ratio: float
    hits_by_tier: dict[str, float]
    modelled_ttft_mean_s: float
    modelled_ttft_p90_s: float
    steps: int
    evictions: int
    #: Blocks loaded per tier (``"host"``, ``"disk"``), one count per KV cache group, and the
    #: bytes they moved (each group's blocks at their size).
    loaded_blocks: dict[str, list[int]] = field(default_factory=dict)
    loaded_bytes: dict[str, int] = field(default_factory=dict)
    #: The run had KV cache groups (pages of ``sim.group_num_blocks``), not full accounting.
    grouped: bool = False


def simulate_tiers(workload: WorkloadConfig, sim: SimConfig, host_blocks: list[int],
                   disk_blocks: list[int], *, progress: bool = False,
                   grouped: bool = False) -> list[TierPoint]:
    """The paged run of ``workload`` for every (host, disk) tier size pair, the same requests
    each time: hit ratio by tier (fraction of admitted prompt tokens) and modelled TTFT. A host size
    of 0 runs without tiers (its TTFT modelled as the prefill of what the GPU pool missed).

    Sizes are in blocks of the full-attention pool (``sim.num_blocks``'s). ``grouped`` runs the
    manager with ``sim.groups`` over ``sim.group_num_blocks`` pages instead, each host size
    the same host memory in pages; the disk tier is refused there
    (:class:`~pagedkv.errors.InvalidConfigError` on ``disk_cache_blocks``)."""
    from dataclasses import replace

    if not isinstance(workload, WorkloadConfig) or not isinstance(sim, SimConfig):
        raise InvalidConfigError("simulate_tiers() takes a WorkloadConfig and a SimConfig")
    if grouped and sim.groups is None:
        raise InvalidConfigError("simulate_tiers(grouped=True) needs a SimConfig with groups",
                                 field="groups", value=None, reason="grouped sweep needs groups")
    requests = generate(workload)
    points: list[TierPoint] = []
    for h in host_blocks:
        for d in disk_blocks:
            if d and not h:
                continue
            # A host size of 0 is the plain pool; the gate still models its TTFT.
            cfg = replace(sim, host_cache_blocks=h, disk_cache_blocks=d)
            res, _ = _simulate_paged(requests, workload, cfg, progress, model_ttft=True,
                                     grouped=grouped)
            total = res.admitted_prompt_tokens
            hits = {k: v / total if total else 0.0 for k, v in res.prefix_hits_by_tier.items()}
            points.append(TierPoint(h, d, sum(hits.values()), hits, res.modelled_ttft_mean_s,
                                    res.modelled_ttft_p90_s, res.steps, res.evictions,
                                    res.tier_loaded_blocks, res.tier_loaded_bytes, grouped))
    return points


def format_tier_sweep(points: list[TierPoint], sim: SimConfig) -> str:
    """A table of a tier sweep: sizes, hit ratio by tier, modelled TTFT."""
    block_bytes = sim.kv_bytes_per_token * sim.block_size
    lines = [f"tier sweep: GPU pool {sim.num_blocks} blocks ({format_bytes(sim.num_blocks * block_bytes)}); "
             f"TTFT modelled at {sim.prefill_tokens_per_s:g} prefill tok/s, host link "
             f"{sim.host_link_bytes_per_s / 1e9:g} GB/s, disk {sim.disk_bytes_per_s / 1e9:g} GB/s"]
    if any(p.grouped for p in points):
        lines.append(f"KV cache groups: {len(sim.groups or ())} groups over "
                     f"{sim.group_num_blocks:,} pages of the same memory; each loaded block "
                     "priced at its group's bytes")
    lines.append(f"{'host':>10} {'disk':>10} {'hit ratio':>9} {'gpu':>6} {'host':>6} {'disk':>6} "
                 f"{'TTFT mean':>10} {'TTFT p90':>10} {'loaded':>10}")
    for p in points:
        hb = format_bytes(p.host_cache_blocks * block_bytes) if p.host_cache_blocks else "-"
        db = format_bytes(p.disk_cache_blocks * block_bytes) if p.disk_cache_blocks else "-"
        t = p.hits_by_tier
        p90 = f"{p.modelled_ttft_p90_s * 1e3:8.1f}ms"
        lines.append(f"{hb:>10} {db:>10} {p.prefix_hit_ratio:9.1%} {t.get('gpu', 0):6.1%} "
                     f"{t.get('host', 0):6.1%} {t.get('disk', 0):6.1%} "
                     f"{p.modelled_ttft_mean_s * 1e3:8.1f}ms {p90:>10} "
                     f"{format_bytes(sum(p.loaded_bytes.values())):>10}")
    return "\n".join(lines)


def plot_tier_sweep(points: list[TierPoint], sim: SimConfig, path: str) -> None:
    """Hit ratio (stacked by tier) and modelled mean TTFT for each tier configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    block_bytes = sim.kv_bytes_per_token * sim.block_size
    labels = [(f"host {format_bytes(p.host_cache_blocks * block_bytes)}"
               if p.host_cache_blocks else "no tier")
              + (f"\ndisk {format_bytes(p.disk_cache_blocks * block_bytes)}"
                 if p.disk_cache_blocks else "") for p in points]
    x = np.arange(len(points))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(8, 1.4 * len(points) * 2), 4.5))
    bottom = np.zeros(len(points))
    for tier, color in (("gpu", "#4c72b0"), ("host", "#55a868"), ("disk", "#c44e52")):
        vals = np.array([p.hits_by_tier.get(tier, 0.0) for p in points])
        a1.bar(x, vals, bottom=bottom, label=tier, color=color)
        bottom += vals
    a1.set_xticks(x, labels, fontsize=8)
    a1.set_ylabel("prompt tokens served from cache")
    a1.set_ylim(0, 1)
    a1.legend()
    a1.set_title("prefix hit ratio by tier")
    a2.bar(x, [p.modelled_ttft_mean_s * 1e3 for p in points], color="#8172b2")
    a2.set_xticks(x, labels, fontsize=8)
    a2.set_ylabel("ms")
    a2.set_title("modelled mean TTFT (queueing excluded)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
