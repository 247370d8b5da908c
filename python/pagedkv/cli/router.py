"""``pagedkv router``: the KV-aware router's flags and handler; the router lives in
:mod:`pagedkv.router`.

Invariants: ``--events`` and ``--replay`` pair with ``--replica`` in order (once each, or not at
all); the prefix policy refuses to start without the replicas' hash seed.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from ._args import UsageError, _float, _nonneg_int, _positive_int
from .serve import _hash_seed, _hash_seed_value, _require_serve, _wrap_parse


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
    from ..router.index import DEFAULT_TTL_S

    out: dict[str, Any] = {}
    if args.index_memory is not None:
        out["index_max_bytes"] = args.index_memory
    if args.index_ttl:
        out["index_ttl_s"] = {**DEFAULT_TTL_S, **dict(args.index_ttl)}
    return out


def _router_bytes(text: str) -> int:
    from ..config import parse_bytes

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
    from ..router.app import ReplicaSpec, load_tokenizer, run

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
