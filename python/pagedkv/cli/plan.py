"""``pagedkv plan``: the capacity planner's flags and handler; the arithmetic lives in
:mod:`pagedkv.capacity`.

Invariant: the handler only maps flags to :func:`pagedkv.capacity.make_plan` and prints its
result (warnings on stderr, the table or JSON on stdout).
"""

from __future__ import annotations

import argparse
import sys

from ._args import _add_memory_args, _add_model_args, _budget, _positive_int, _resolve_model


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
    g.add_argument("--no-kv-groups", action="store_true",
                   help="plan a model with sliding-window or chunked layers as full attention only "
                        "(default: add the group-aware pool: KV cache groups sharing one page size)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _run_plan(args: argparse.Namespace) -> int:
    from ..capacity import default_seq_lens, format_plan, make_plan, parse_seq_lens, plan_json

    label, model, spec, weights, source = _resolve_model(args, default_model=None)
    model_max_len = None if model is None else model.max_position_embeddings
    if args.seq_lens is not None:
        seq_lens = parse_seq_lens(args.seq_lens)
    else:
        seq_lens = default_seq_lens(args.max_model_len or model_max_len)
    kinds = None if model is None or args.no_kv_groups else model.layer_kinds
    plan = make_plan(spec, _budget(args, weights), seq_lens, args.max_model_len,
                     model=label, weights_source=source, model_max_len=model_max_len,
                     layer_kinds=kinds)
    for warning in plan.warnings:
        print(f"pagedkv plan: warning: {warning}", file=sys.stderr)
    print(plan_json(plan) if args.json else format_plan(plan))
    return 0
