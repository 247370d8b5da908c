"""``pagedkv simulate``: the workload simulator's flags and handler, including the tier sweep
(``--host-cache``); the simulating lives in :mod:`pagedkv.simulate` and :mod:`pagedkv.workload`.
A model with sliding-window or chunked layers (``--model gemma-3-27b``, ``--hf-config``) also
runs with its KV cache groups (:func:`pagedkv.config.size_groups` at ``--max-model-len``) in the
same memory, unless ``--no-kv-groups``; its tier sweep then runs the grouped pool (every group's
pages in the host tier; ``--disk-cache`` refused there, as the engine refuses its disk tier).

Invariant: a ``--plot`` that cannot be drawn (no matplotlib) is refused before simulating.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ..errors import InvalidConfigError
from ._args import (
    _add_memory_args,
    _add_model_args,
    _budget,
    _float,
    _nonneg_float,
    _nonneg_int,
    _positive_int,
    _resolve_model,
    _size,
)


SIM_DEFAULT_MODEL = "llama-3-8b"


def _add_simulate_args(p: argparse.ArgumentParser) -> None:
    from ..simulate import SimConfig
    from ..workload import WorkloadConfig

    w, s = WorkloadConfig(), SimConfig(num_blocks=1)
    _add_model_args(p, default_model=SIM_DEFAULT_MODEL)
    _add_memory_args(p, gpu_mem="24GiB", activation="1GiB", graph="512MiB")
    g = p.add_argument_group("pool")
    g.add_argument("--num-blocks", type=_positive_int, default=None, metavar="N",
                   help="pool size in blocks; overrides the memory arithmetic")
    g.add_argument("--watermark-blocks", type=_nonneg_int, default=None, metavar="N",
                   help="blocks kept back from admissions (default: the manager's)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument("--no-kv-groups", action="store_true",
                   help="for a model with sliding-window or chunked layers, skip the paged run "
                        "with KV cache groups (default: run it beside full-attention accounting, "
                        "in the same memory)")
    g.add_argument("--num-host-blocks", type=_nonneg_int, default=0, metavar="N",
                   help="host KV blocks for swapped-out sequences (default: 0, no swap)")
    g.add_argument("--preemption-mode", choices=("auto", "swap", "recompute"), default="auto",
                   help="reclaim preempted sequences by the cost model (auto), by swap, or by "
                        "recompute (default: auto; recompute without host blocks)")
    g.add_argument("--host-link-gbps", type=_float, default=s.host_link_bytes_per_s / 1e9,
                   metavar="X", help="cost model: host-link bandwidth, GB/s (default: "
                                     f"{s.host_link_bytes_per_s / 1e9:g}, assumed)")
    g.add_argument("--prefill-tps", type=_float, default=s.prefill_tokens_per_s, metavar="X",
                   help="cost model: prefill throughput, tokens/s (default: "
                        f"{s.prefill_tokens_per_s:g}, assumed)")
    g.add_argument("--step-floor-ms", type=_nonneg_float, default=s.step_floor_s * 1e3,
                   metavar="X", help="cost model: what a step costs however few tokens it carries, "
                                     "ms; recompute tokens under it ride along free (default: "
                                     f"{s.step_floor_s * 1e3:g}: linear)")
    g = p.add_argument_group("tiers of the prefix cache (a sweep: every host x disk size)")
    g.add_argument("--host-cache", type=_size, nargs="+", default=None, metavar="SIZE",
                   help="host tier sizes to compare (e.g. 0 8GiB 32GiB; 0 = no tier); prints hit "
                        "ratio by tier and modelled TTFT per size instead of paged vs contiguous")
    g.add_argument("--disk-cache", type=_size, nargs="+", default=[0], metavar="SIZE",
                   help="disk tier sizes under each host size (default: 0, none; not with KV "
                        "cache groups: add --no-kv-groups)")
    g.add_argument("--disk-gbps", type=_float, default=s.disk_bytes_per_s / 1e9, metavar="X",
                   help=f"modelled disk read rate, GB/s (default: {s.disk_bytes_per_s / 1e9:g})")
    g = p.add_argument_group("workload (lengths in tokens, time in scheduler steps)")
    g.add_argument("--requests", type=_positive_int, default=w.num_requests, metavar="N",
                   help=f"number of requests (default: {w.num_requests})")
    g.add_argument("--rate", type=_float, default=w.arrival_rate, metavar="X",
                   help=f"Poisson arrival rate, requests per step (default: {w.arrival_rate})")
    g.add_argument("--prompt-median", type=_float, default=w.prompt_median, metavar="X",
                   help=f"median prompt length, log-normal (default: {w.prompt_median:g})")
    g.add_argument("--prompt-sigma", type=_float, default=w.prompt_sigma, metavar="X",
                   help=f"log-normal sigma of prompt lengths (default: {w.prompt_sigma:g})")
    g.add_argument("--output-median", type=_float, default=w.output_median, metavar="X",
                   help=f"median output length, log-normal (default: {w.output_median:g})")
    g.add_argument("--output-sigma", type=_float, default=w.output_sigma, metavar="X",
                   help=f"log-normal sigma of output lengths (default: {w.output_sigma:g})")
    g.add_argument("--max-model-len", type=_positive_int, default=w.max_model_len, metavar="N",
                   help=f"longest sequence; prompts and outputs are capped to fit, and the "
                        f"contiguous baseline reserves this much per sequence (default: {w.max_model_len})")
    g.add_argument("--num-prefixes", type=_nonneg_int, default=w.num_prefixes, metavar="N",
                   help=f"distinct shared system prompts (default: {w.num_prefixes})")
    g.add_argument("--prefix-len", type=_nonneg_int, default=w.prefix_len, metavar="N",
                   help=f"tokens per shared system prompt (default: {w.prefix_len})")
    g.add_argument("--prefix-fraction", type=_float, default=w.prefix_fraction, metavar="X",
                   help=f"fraction of requests that start with a shared prompt (default: {w.prefix_fraction:g})")
    g.add_argument("--n-samples", type=_positive_int, default=w.n_samples, metavar="N",
                   help=f"parallel samples per request, forked after admission (default: {w.n_samples})")
    g.add_argument("--seed", type=int, default=w.seed, metavar="N",
                   help=f"random seed (default: {w.seed})")
    g = p.add_argument_group("scheduler")
    g.add_argument("--max-num-seqs", type=_positive_int, default=s.max_num_seqs, metavar="N",
                   help=f"most sequences in one batch (default: {s.max_num_seqs})")
    g.add_argument("--max-prefill-tokens", type=_positive_int, default=s.max_prefill_tokens, metavar="N",
                   help=f"prompt tokens admitted per step; one request always fits (default: {s.max_prefill_tokens})")
    g = p.add_argument_group("output")
    g.add_argument("--check", type=_nonneg_int, default=0, metavar="N",
                   help="run the manager's invariant check every N steps (default: only at the end)")
    g.add_argument("--json", action="store_true", help="print one JSON object (implies --quiet)")
    g.add_argument("--plot", metavar="FILE.png", help="plot utilization and concurrency over time")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def _run_simulate(args: argparse.Namespace) -> int:
    if args.plot:
        # Before simulating: finding out after a whole run that the plot cannot be drawn wastes it.
        from .._optional import check_available

        check_available("matplotlib", "--plot")
    from ..simulate import SimConfig, format_report, result_json, simulate
    from ..workload import WorkloadConfig

    label, model, spec, weights, _source = _resolve_model(args, default_model=SIM_DEFAULT_MODEL)
    if args.num_blocks is not None:
        num_blocks, memory = args.num_blocks, None
        kv_bytes = num_blocks * spec.bytes_per_block
    else:
        budget = _budget(args, weights)
        num_blocks, memory = budget.num_blocks(spec), budget
        kv_bytes = budget.kv_bytes
    groups, group_blocks, group_bytes = None, 0, None
    if model is not None and model.has_windowed_layers and not args.no_kv_groups:
        from ..config import size_groups

        sizing = size_groups(spec, model.layer_kinds, kv_bytes, args.max_model_len)
        if sizing.grouping.saves_memory:
            groups = tuple(g.as_tuple() for g in sizing.groups)
            group_blocks = sizing.num_blocks
            # Each group's block is a page (its layers, padded to the page's slots): what a
            # load moves.
            group_bytes = (sizing.page_bytes,) * sizing.num_groups
    workload = WorkloadConfig(
        num_requests=args.requests, arrival_rate=args.rate,
        prompt_median=args.prompt_median, prompt_sigma=args.prompt_sigma,
        output_median=args.output_median, output_sigma=args.output_sigma,
        max_model_len=args.max_model_len, num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len, prefix_fraction=args.prefix_fraction,
        n_samples=args.n_samples, seed=args.seed,
    )
    sim = SimConfig(num_blocks=num_blocks, block_size=spec.block_size,
                    watermark_blocks=args.watermark_blocks, max_num_seqs=args.max_num_seqs,
                    max_prefill_tokens=args.max_prefill_tokens,
                    enable_prefix_caching=not args.no_prefix_caching, check_every=args.check,
                    num_host_blocks=args.num_host_blocks, preemption_mode=args.preemption_mode,
                    host_link_bytes_per_s=args.host_link_gbps * 1e9,
                    prefill_tokens_per_s=args.prefill_tps, kv_bytes_per_token=spec.bytes_per_token,
                    step_floor_s=args.step_floor_ms / 1e3, groups=groups,
                    group_num_blocks=group_blocks, group_block_bytes=group_bytes)
    if args.host_cache is not None:
        if groups is not None and any(args.disk_cache):
            raise InvalidConfigError(
                f"--disk-cache with {label}'s {len(groups)} KV cache groups: the modelled disk "
                "tier holds one group's blocks, as the engine's; sweep --host-cache alone, or add "
                "--no-kv-groups for full-attention accounting", field="disk_cache",
                value=args.disk_cache, reason="no disk tier with groups")
        # With groups the sweep runs the grouped pool (the core's grouped host tier).
        return _run_tier_sweep(args, workload, sim, spec)
    if args.disk_cache != [0]:
        raise InvalidConfigError("--disk-cache needs --host-cache (the disk tier is filled from "
                                 "the host tier)", field="disk_cache", value=args.disk_cache,
                                 reason="needs --host-cache")
    started = time.perf_counter()
    result = simulate(workload, sim, progress=not (args.quiet or args.json),
                      record_timeline=args.plot is not None)
    elapsed = time.perf_counter() - started
    if args.json:
        print(result_json(result, model=label, spec=spec, memory=memory))
    else:
        print(format_report(result, model=label, spec=spec, memory=memory))
        print(f"simulated in {elapsed:.1f} s")
    if args.plot:
        from ..simulate import plot_timeline

        plot_timeline(result, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _run_tier_sweep(args: argparse.Namespace, workload: Any, sim: Any, spec: Any) -> int:
    """``pagedkv simulate --host-cache ...``: the paged run per tier size pair (with the model's
    KV cache groups when ``sim`` has them; sizes are host memory, whole-model blocks of it)."""
    from dataclasses import asdict, replace

    from ..simulate import format_tier_sweep, plot_tier_sweep, simulate_tiers

    block = spec.bytes_per_token * spec.block_size
    sim = replace(sim, disk_bytes_per_s=args.disk_gbps * 1e9)
    hosts = [n // block for n in args.host_cache]
    disks = [n // block for n in args.disk_cache]
    for given, blocks in zip(args.host_cache + args.disk_cache, hosts + disks):
        if given and not blocks:
            raise InvalidConfigError(
                f"invalid tier size {given} bytes: smaller than one block ({block} bytes)",
                field="host_cache/disk_cache", value=given, reason=f"must be >= {block} bytes")
    started = time.perf_counter()
    grouped = sim.groups is not None
    points = simulate_tiers(workload, sim, hosts, disks, progress=not (args.quiet or args.json),
                            grouped=grouped)
    if args.json:
        out: dict[str, Any] = {"block_bytes": block, "points": [asdict(p) for p in points]}
        if grouped:
            out.update({"groups": [list(g) for g in sim.groups],
                        "group_num_blocks": sim.group_num_blocks,
                        "group_block_bytes": list(sim.group_page_bytes())})
        print(json.dumps(out))
    else:
        print(format_tier_sweep(points, sim))
        print(f"simulated in {time.perf_counter() - started:.1f} s")
    if args.plot:
        plot_tier_sweep(points, sim, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0
