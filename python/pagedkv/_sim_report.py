"""The simulator's reports: the flat JSON dict (:func:`result_dict`, :func:`result_json`), the text
report (:func:`format_report`) and the timeline plot (:func:`plot_timeline`, matplotlib imported
only when drawing).

Invariants: reporting reads a :class:`SimResult` and never changes it; the JSON is deterministic for
a given result. Imported through :mod:`pagedkv.simulate`.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any, Optional

import numpy as np

from ._sim_config import PolicyResult, SimResult
from .config import CacheSpec, MemoryBudget, format_bytes
from .errors import InvalidConfigError


def _r(x: float) -> float:
    return round(float(x), 6)


def result_dict(result: SimResult, *, model: Optional[str] = None, spec: Optional[CacheSpec] = None,
                memory: Optional[MemoryBudget] = None) -> dict[str, Any]:
    """A flat JSON-ready dict: headline keys first, then each policy's figures, then the config."""
    p, c = result.paged, result.contiguous
    out: dict[str, Any] = {
        "requests": result.workload.num_requests,
        "num_blocks": result.sim.num_blocks,
        "block_size": result.sim.block_size,
        "token_capacity": result.sim.num_blocks * result.sim.block_size,
        "watermark_blocks": result.watermark_blocks,
        "max_model_len": result.workload.max_model_len,
        "contiguous_slots": c.max_concurrency_limit,
        "peak_concurrency_paged": p.peak_concurrency,
        "peak_concurrency_contiguous": c.peak_concurrency,
        "mean_concurrency_paged": _r(p.mean_concurrency),
        "mean_concurrency_contiguous": _r(c.mean_concurrency),
        "kv_utilization_mean": _r(p.kv_utilization_mean),
        "kv_utilization_peak": _r(p.kv_utilization_peak),
        "kv_utilization_mean_contiguous": _r(c.kv_utilization_mean),
        "kv_utilization_peak_contiguous": _r(c.kv_utilization_peak),
        "waste_tokens_per_seq_paged": _r(p.waste_tokens_per_seq),
        "waste_tokens_per_seq_contiguous": _r(c.waste_tokens_per_seq),
        "waste_fraction_paged": _r(p.waste_fraction),
        "waste_fraction_contiguous": _r(c.waste_fraction),
        "preemptions": p.preemptions,
        "preemptions_swap": p.preemptions_swap,
        "preemptions_recompute": p.preemptions_recompute,
        "swap_ins": p.swap_ins,
        "recomputed_prompt_tokens": p.recomputed_prompt_tokens,
        "prefix_hit_ratio": _r(p.prefix_hit_ratio),
        "blocks_saved_by_sharing": _r(p.blocks_saved_by_sharing_mean),
        "blocks_saved_by_sharing_peak": p.blocks_saved_by_sharing_peak,
        "cow_copies": p.cow_copies,
        "evictions": p.evictions,
        "steps_paged": p.steps,
        "steps_contiguous": c.steps,
        "output_tokens": p.output_tokens,
        "tokens_per_step_paged": _r(p.tokens_per_step),
        "tokens_per_step_contiguous": _r(c.tokens_per_step),
        "requests_per_step_paged": _r(p.requests_per_step),
        "requests_per_step_contiguous": _r(c.requests_per_step),
        "mean_queue_steps_paged": _r(p.mean_queue_steps),
        "mean_queue_steps_contiguous": _r(c.mean_queue_steps),
        "mean_latency_steps_paged": _r(p.mean_latency_steps),
        "mean_latency_steps_contiguous": _r(c.mean_latency_steps),
        "workload": asdict(result.workload),
        "sim": asdict(result.sim),
    }
    out.update(_tier_keys(p, ""))
    g = result.grouped
    if g is not None:
        out.update(_tier_keys(g, "_groups"))
        out.update({
            "groups": [list(x) for x in (result.sim.groups or ())],
            "group_num_blocks": result.sim.group_num_blocks,
            "peak_concurrency_groups": g.peak_concurrency,
            "mean_concurrency_groups": _r(g.mean_concurrency),
            "page_occupancy_mean_groups": _r(g.kv_utilization_mean),
            "page_occupancy_peak_groups": _r(g.kv_utilization_peak),
            "preemptions_groups": g.preemptions,
            "preemptions_swap_groups": g.preemptions_swap,
            "recomputed_prompt_tokens_groups": g.recomputed_prompt_tokens,
            "prefix_hit_ratio_groups": _r(g.prefix_hit_ratio),
            "evictions_groups": g.evictions,
            "steps_groups": g.steps,
            "tokens_per_step_groups": _r(g.tokens_per_step),
            "requests_per_step_groups": _r(g.requests_per_step),
            "mean_queue_steps_groups": _r(g.mean_queue_steps),
            "mean_latency_steps_groups": _r(g.mean_latency_steps),
        })
    if model is not None:
        out["model"] = model
    if spec is not None:
        out["spec"] = asdict(spec)
        out["bytes_per_block"] = spec.bytes_per_block
    if memory is not None:
        out["memory"] = asdict(memory)
    return out


def _tier_keys(res: PolicyResult, suffix: str) -> dict[str, Any]:
    """A paged run's figures of the prefix cache's tiers (none without a host tier): prompt
    tokens served per tier, blocks loaded per tier and group, their bytes, modelled TTFT."""
    if not res.prefix_hits_by_tier:
        return {}
    return {
        f"prefix_hits_by_tier{suffix}": dict(res.prefix_hits_by_tier),
        f"admitted_prompt_tokens{suffix}": res.admitted_prompt_tokens,
        f"tier_loaded_blocks{suffix}": {k: list(v) for k, v in res.tier_loaded_blocks.items()},
        f"tier_loaded_bytes{suffix}": dict(res.tier_loaded_bytes),
        f"modelled_ttft_mean_s{suffix}": _r(res.modelled_ttft_mean_s),
        f"modelled_ttft_p90_s{suffix}": _r(res.modelled_ttft_p90_s),
    }


def _tier_rows(res: PolicyResult, disk: bool) -> dict[str, str]:
    """The report's rows of a paged run's tiers (empty without a host tier)."""
    hits, total = res.prefix_hits_by_tier, res.admitted_prompt_tokens
    if not hits:
        return {}

    def share(tier: str) -> str:
        return f"{hits.get(tier, 0) / total:.1%} of prompt tokens" if total else "—"

    def loads(tier: str) -> str:
        blocks = sum(res.tier_loaded_blocks.get(tier, ()))
        return f"{blocks:,} blocks, {format_bytes(res.tier_loaded_bytes.get(tier, 0))}"

    rows = {"host-tier hits": share("host"), "host-tier loads": loads("host")}
    if disk:
        rows.update({"disk-tier hits": share("disk"), "disk-tier loads": loads("disk")})
    rows["modelled TTFT mean"] = f"{res.modelled_ttft_mean_s * 1e3:.1f} ms"
    rows["modelled TTFT p90"] = f"{res.modelled_ttft_p90_s * 1e3:.1f} ms"
    return rows


def result_json(result: SimResult, **kwargs: Any) -> str:
    """:func:`result_dict` as one JSON object."""
    return json.dumps(result_dict(result, **kwargs), indent=2)


def format_report(result: SimResult, *, model: Optional[str] = None, spec: Optional[CacheSpec] = None,
                  memory: Optional[MemoryBudget] = None) -> str:
    """The human-readable report: the setup, then paged and contiguous side by side."""
    w, s, p, c = result.workload, result.sim, result.paged, result.contiguous
    lines = []
    if model is not None and spec is not None:
        pool = f"{format_bytes(s.num_blocks * spec.bytes_per_block)}, "
        lines.append(f"model      {model}: {format_bytes(spec.bytes_per_token)}/token, "
                     f"{format_bytes(spec.bytes_per_block)}/block ({spec.dtype})")
    else:
        pool = ""
    if memory is not None:
        lines.append(f"memory     {format_bytes(memory.total_bytes)} × {memory.utilization} − weights "
                     f"{format_bytes(memory.weights_bytes)} − activations "
                     f"{format_bytes(memory.activation_peak_bytes)} − graphs "
                     f"{format_bytes(memory.graph_reserve_bytes)}")
    lines.append(f"pool       {s.num_blocks:,} blocks × {s.block_size} = {s.num_blocks * s.block_size:,} "
                 f"token slots ({pool}watermark {result.watermark_blocks} blocks)")
    shape = (f"prompts log-normal median {w.prompt_median:g} σ {w.prompt_sigma:g}, outputs median "
             f"{w.output_median:g} σ {w.output_sigma:g}, max_model_len {w.max_model_len}")
    lines.append(f"workload   {w.num_requests} requests, Poisson {w.arrival_rate:g}/step, seed {w.seed}")
    lines.append(f"           {shape}")
    if w.num_prefixes:
        lines.append(f"           {w.num_prefixes} shared prefixes × {w.prefix_len} tokens on "
                     f"{w.prefix_fraction:.0%} of requests")
    if w.n_samples > 1:
        lines.append(f"           {w.n_samples} parallel samples per request")
    g = result.grouped
    if g is not None:
        kinds: dict[str, int] = {}
        for kind, size in s.groups or ():
            label = kind if kind == "full" else f"{kind} {size}"
            kinds[label] = kinds.get(label, 0) + 1
        lines.append(f"groups     {len(s.groups or ())} KV cache groups ("
                     + ", ".join(f"{n} {k}" for k, n in kinds.items())
                     + f") over {s.group_num_blocks:,} pages of the same memory; "
                     "'paged' counts every layer as full attention")
    lines.append("")
    rows: list[tuple[str, ...]] = [
        ("", "paged", "contiguous"),
        ("concurrency limit", f"{p.max_concurrency_limit} (max_num_seqs)", f"{c.max_concurrency_limit}"),
        ("peak concurrency", f"{p.peak_concurrency}", f"{c.peak_concurrency}"),
        ("mean concurrency", f"{p.mean_concurrency:.1f}", f"{c.mean_concurrency:.1f}"),
        ("KV utilization mean", f"{p.kv_utilization_mean:.1%}", f"{c.kv_utilization_mean:.1%}"),
        ("KV utilization peak", f"{p.kv_utilization_peak:.1%}", f"{c.kv_utilization_peak:.1%}"),
        ("waste slots / seq", f"{p.waste_tokens_per_seq:.1f}", f"{c.waste_tokens_per_seq:.1f}"),
        ("waste fraction", f"{p.waste_fraction:.1%}", f"{c.waste_fraction:.1%}"),
        ("preemptions", f"{p.preemptions} (swap {p.preemptions_swap}, recompute "
                        f"{p.preemptions_recompute})", "0"),
        ("steps to finish", f"{p.steps:,}", f"{c.steps:,}"),
        ("tokens / step", f"{p.tokens_per_step:.2f}", f"{c.tokens_per_step:.2f}"),
        ("requests / step", f"{p.requests_per_step:.4f}", f"{c.requests_per_step:.4f}"),
        ("mean queueing (steps)", f"{p.mean_queue_steps:.0f}", f"{c.mean_queue_steps:.0f}"),
        ("mean latency (steps)", f"{p.mean_latency_steps:.0f}", f"{c.mean_latency_steps:.0f}"),
    ]
    if w.sharing or p.prefix_hit_ratio:
        rows.append(("prefix hit ratio", f"{p.prefix_hit_ratio:.1%}", "—"))
    if w.sharing:
        rows += [
            ("blocks saved by sharing", f"{p.blocks_saved_by_sharing_mean:.1f} mean, "
                                        f"{p.blocks_saved_by_sharing_peak} peak", "—"),
            ("copy-on-write copies", f"{p.cow_copies}", "—"),
        ]
    if p.recomputed_prompt_tokens:
        rows.append(("recomputed prompt tokens", f"{p.recomputed_prompt_tokens:,}", "—"))
    disk = bool(s.disk_cache_blocks)
    tier_rows = _tier_rows(p, disk)
    rows += [(k, v, "—") for k, v in tier_rows.items()]
    if g is not None:
        grouped = {
            "": "paged, groups",
            "concurrency limit": f"{g.max_concurrency_limit} (max_num_seqs)",
            "peak concurrency": f"{g.peak_concurrency}",
            "mean concurrency": f"{g.mean_concurrency:.1f}",
            "KV utilization mean": f"{g.kv_utilization_mean:.1%} of pages",
            "KV utilization peak": f"{g.kv_utilization_peak:.1%} of pages",
            "waste slots / seq": f"{g.waste_tokens_per_seq:.1f}",
            "waste fraction": "—",
            "preemptions": f"{g.preemptions} (swap {g.preemptions_swap}, recompute "
                           f"{g.preemptions_recompute})",
            "steps to finish": f"{g.steps:,}",
            "tokens / step": f"{g.tokens_per_step:.2f}",
            "requests / step": f"{g.requests_per_step:.4f}",
            "mean queueing (steps)": f"{g.mean_queue_steps:.0f}",
            "mean latency (steps)": f"{g.mean_latency_steps:.0f}",
            "prefix hit ratio": f"{g.prefix_hit_ratio:.1%}",
            "recomputed prompt tokens": f"{g.recomputed_prompt_tokens:,}",
            **_tier_rows(g, disk),
        }
        if not any(r[0] == "prefix hit ratio" for r in rows):
            rows.append(("prefix hit ratio", f"{p.prefix_hit_ratio:.1%}", "—"))
        if g.recomputed_prompt_tokens and not any(r[0] == "recomputed prompt tokens" for r in rows):
            rows.append(("recomputed prompt tokens", f"{p.recomputed_prompt_tokens:,}", "—"))
        rows = [(r[0], grouped.get(r[0], "—"), r[1], r[2]) for r in rows]
    ncol = len(rows[0])
    widths = [max(len(r[i]) for r in rows) for i in range(ncol)]
    for i, r in enumerate(rows):
        lines.append("  ".join([r[0].ljust(widths[0])]
                               + [r[j].rjust(widths[j]) for j in range(1, ncol)]))
        if i == 0:
            lines.append("  ".join("-" * wd for wd in widths))
    if c.steps and p.steps:
        lines.append("")
        lines.append(f"paged finishes in {p.steps / c.steps:.2f}× the contiguous steps "
                     f"({c.steps / p.steps:.1f}× the throughput) in the same memory")
    if g is not None and g.steps and p.steps and p.mean_concurrency:
        hit = (f"; prefix hit ratio {g.prefix_hit_ratio:.1%} against {p.prefix_hit_ratio:.1%}"
               if p.prefix_hit_ratio or g.prefix_hit_ratio else "")
        lines.append(f"with groups: {g.mean_concurrency / p.mean_concurrency:.2f}× the mean "
                     f"concurrency of full-attention accounting, {g.steps / p.steps:.2f}× its "
                     f"steps{hit}")
    return "\n".join(lines)


def plot_timeline(result: SimResult, path: str) -> None:
    """Write a PNG of KV utilization and concurrency over time for both policies."""
    p, c = result.paged, result.contiguous
    if not p.timeline or not c.timeline:
        raise InvalidConfigError("this result holds no timeline; run simulate(record_timeline=True)")
    from ._optional import require

    require("matplotlib", "plot_timeline")  # one-line error naming pagedkv[plot] when absent
    # The object-oriented API with an Agg canvas: no pyplot, no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6.5))
    FigureCanvasAgg(fig)
    ax_u, ax_c = fig.subplots(2, 1, sharex=True)
    runs = [(p, "tab:blue"), (c, "tab:orange")]
    if result.grouped is not None and result.grouped.timeline:
        runs.append((result.grouped, "tab:green"))
    for res, color in runs:
        steps = np.arange(len(res.timeline["utilization"]))
        label = res.policy
        if res is result.grouped:
            label = (f"paged, {len(result.sim.groups or ())} KV cache groups (pages held; "
                     f"hit ratio {res.prefix_hit_ratio:.0%})")
        elif res is p and result.grouped is not None:
            label = f"paged, counted as full attention (hit ratio {res.prefix_hit_ratio:.0%})"
        ax_u.plot(steps, 100 * res.timeline["utilization"], color=color, lw=0.8, label=label)
        ax_c.plot(steps, res.timeline["concurrency"], color=color, lw=0.8, label=label)
    reserved = c.timeline["concurrency"] * result.workload.max_model_len
    capacity = result.sim.num_blocks * result.sim.block_size
    ax_u.plot(np.arange(len(reserved)), 100 * reserved / capacity, color="tab:orange", lw=0.8,
              ls="--", label="contiguous, reserved")
    ax_u.set_ylabel("KV utilization (%)")
    ax_u.set_ylim(0, 105)
    ax_c.set_ylabel("running sequences")
    ax_c.set_xlabel("scheduler step")
    ax_u.legend(loc="center right", fontsize=8)
    ax_u.set_title(f"{result.workload.num_requests} requests, {result.sim.num_blocks} blocks × "
                   f"{result.sim.block_size} tokens, max_model_len {result.workload.max_model_len}")
    for ax in (ax_u, ax_c):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise InvalidConfigError(f"cannot write plot {path}: {exc}") from None
