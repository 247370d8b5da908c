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

The subcommands live one per module (:mod:`.plan`, :mod:`.simulate`, :mod:`.demo`, :mod:`.serve`,
:mod:`.router`, :mod:`.bench`), their shared argparse types in :mod:`._args`; this module holds
the command table, the parser and :func:`main`, and re-exports the names other code imports from
``pagedkv.cli``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

from ..errors import PagedKVError
from ._args import UsageError as UsageError
from ._args import _Parser
from .bench import _add_bench_args, _run_bench
from .demo import _add_demo_args, _run_demo
from .plan import _add_plan_args, _run_plan
from .router import _add_router_args as _add_router_args
from .router import _router_index_args as _router_index_args
from .router import _run_router
from .serve import _add_serve_args, _run_serve
from .serve import _serve_limits as _serve_limits
from .serve import serve_engine_fields as serve_engine_fields
from .serve import serve_flags_markdown as serve_flags_markdown
from .simulate import _add_simulate_args, _run_simulate

__all__ = ["main", "build_parser", "SUBCOMMANDS"]


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
        from .._core import __version__ as core_version
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
        from .._optional import from_import_error

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
