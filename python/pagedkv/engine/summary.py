"""The engine's start-up summary: one log line a person reads once the engine is built.

Owns :func:`startup_summary` (the text) and :func:`log_startup` (logs it at INFO on the
``pagedkv.engine`` logger). The line names the model, device and dtype, the KV pool (blocks,
tokens, GiB; with KV cache groups, pages of how many layers and the groups' kinds), how many
requests of the longest length the engine serves fit in the pool at once (its maximum concurrency
at that length; with groups, over each group's peak need,
:meth:`pagedkv.layer_groups.LayerGrouping.need_blocks`), the tiers of the prefix cache and swap
space, and the preemption policy with the cost model's rates.

Invariant: it only reads the built engine (no side effects, nothing measured).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, List

__all__ = ["startup_summary", "log_startup"]

logger = logging.getLogger("pagedkv.engine")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _kinds(groups: Any) -> str:
    """``"1 full, 5 sliding(1024)"``: how many groups of each kind."""
    counts: dict = {}
    for g in groups:
        name = g.kind + (f"({g.size})" if g.size else "")
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {name}" for name, n in counts.items())


def startup_summary(engine: Any) -> str:
    """The summary line of a built :class:`~pagedkv.engine.llm.LLMEngine`."""
    runner, manager, cfg = engine.runner, engine.manager, engine.config
    bpb = int(runner.spec.bytes_per_block)
    blocks = int(manager.num_blocks)
    bs = int(engine.block_size)
    tokens = blocks * bs
    max_len = int(engine.max_model_len)
    model = os.path.basename(os.path.normpath(engine.model_path)) or "in-memory model"
    tiers: List[str] = [f"{engine.device.type} pool"]
    swap = getattr(runner, "swap", None)
    if swap is not None:
        host = int(swap.host.num_blocks)
        tiers.append(f"host {host} blocks ({_gib(host * bpb)})")
    if cfg.disk_cache_dir is not None:
        tiers.append(f"disk {cfg.disk_cache_dir}")
    if cfg.remote_cache_url is not None:
        tiers.append("remote")
    preempt = str(cfg.preemption_mode)
    rates = getattr(engine, "cost_rates", None)
    if rates is not None:
        link, tps, floor = rates
        link_s = "n/a" if math.isnan(link) else f"{link / 1e9:.1f} GB/s"
        preempt += (f" (cost model: host link {link_s}, prefill {tps:.0f} tok/s, "
                    f"step floor {floor * 1e3:.1f} ms)")
    tp = int(getattr(runner, "tp_size", 1))
    grouping = getattr(runner, "grouping", None)
    pool = f"KV pool {blocks} blocks x {bs} tokens = {tokens} tokens, {_gib(blocks * bpb)}"
    concurrency = tokens / max(max_len, 1)
    if grouping is not None and grouping.saves_memory:
        # A page holds one group's `slots` layers; a request holds its peak over every group
        # (a model whose every layer slides: one sliding group).
        n = grouping.num_groups
        pool = (f"KV pool {blocks} pages x {bs} tokens x {grouping.slots} layers, "
                f"{_gib(blocks * bpb)}, {n} KV cache group{'s' if n > 1 else ''} "
                f"({_kinds(grouping.groups)})")
        concurrency = blocks / max(grouping.need_blocks(max(max_len, 1), bs), 1)
    return (f"pagedkv engine: {model} on {engine.device} ({runner.spec.dtype}"
            f"{f', tensor parallel {tp}' if tp > 1 else ''}); "
            f"{pool}; "
            f"max concurrency {concurrency:.2f}x at {max_len} tokens per request; "
            f"tiers: {', '.join(tiers)}; preemption {preempt}")


def log_startup(engine: Any) -> None:
    """Logs :func:`startup_summary` at INFO."""
    logger.info("%s", startup_summary(engine))
