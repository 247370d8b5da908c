"""What the ``pagedkv`` subcommands share: the one-line-error parser, argparse value types, and
the model and memory options of ``plan`` and ``simulate``.

Invariants: an argparse type raises :class:`argparse.ArgumentTypeError` naming the offending text
(argparse turns it into one ``error:`` line); :class:`UsageError` is a command-line mistake found
after parsing, which :func:`pagedkv.cli.main` prints as one line with exit status 2.
"""

from __future__ import annotations

import argparse
from typing import Callable, NoReturn, Optional

from .._checks import DEFAULT_BLOCK_SIZE
from ..config import (
    PRESETS,
    CacheSpec,
    MemoryBudget,
    ModelConfig,
    get_preset,
    parse_bytes,
)
from ..errors import InvalidConfigError


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
