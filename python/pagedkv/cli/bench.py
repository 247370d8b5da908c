"""``pagedkv bench``: the benchmark subcommands (``bench serve``); the load generator lives in
:mod:`pagedkv.serve.bench`.

Invariant: ``pagedkv bench`` without a benchmark prints its help on stderr and exits with 2.
"""

from __future__ import annotations

import argparse
import sys

from ._args import _Parser


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH", parser_class=_Parser)
    s = sub.add_parser("serve", help="load an OpenAI-compatible server with streaming requests "
                                     "(Poisson arrivals); throughput, TTFT and ITL percentiles",
                       description="load an OpenAI-compatible server with streaming requests "
                                   "(Poisson arrivals); throughput, TTFT and ITL percentiles")
    from ..serve.bench import add_arguments

    add_arguments(s)
    p.set_defaults(bench_parser=p)


def _run_bench(args: argparse.Namespace) -> int:
    if getattr(args, "bench_command", None) != "serve":
        args.bench_parser.print_help(sys.stderr)
        return 2
    import importlib.util

    from .._optional import missing

    if importlib.util.find_spec("httpx") is None:
        raise missing("httpx", "pagedkv bench serve", extra="serve")
    from ..serve.bench import run_from_args

    return run_from_args(args)
