"""The engine's counters: what it has done since it was created or since :meth:`reset`.

Owns :class:`EngineStats` (the snapshot :meth:`LLMEngine.stats
<pagedkv.engine.llm_engine.LLMEngine.stats>` returns) and :class:`StatsTracker`, which the engine
core (steps, preemptions, prefill tokens), output processing (generated tokens, first tokens) and
the engine (requests added and finished) count into.

Invariants: the manager's, the swap engine's and the tier cache's counters are cumulative, so a
reset snapshots them and :meth:`StatsTracker.snapshot` reports the difference; the engine's own
counters restart at zero; reading a snapshot changes nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["EngineStats", "StatsTracker"]


@dataclass
class EngineStats:
    """Counters of an engine since it was created (or since :meth:`LLMEngine.reset_stats`)."""

    #: Requests added / finished.
    num_requests: int
    num_finished_requests: int
    #: Prompt tokens of the requests added (each prompt once, whatever its ``n``).
    num_prompt_tokens: int
    #: Tokens generated, over all samples.
    num_generated_tokens: int
    #: Tokens the model computed in prefill chunks (prompt tokens not served by the prefix cache,
    #: plus whatever preemption made it recompute).
    num_prefill_tokens: int
    #: Scheduler steps run, and the seconds spent inside :meth:`LLMEngine.step`.
    num_steps: int
    busy_time_s: float
    #: ``num_generated_tokens / busy_time_s``.
    generation_tokens_per_s: float
    #: ``(prefill + generated tokens) / busy_time_s``.
    total_tokens_per_s: float
    #: Time to first token over finished requests: mean and max, seconds.
    mean_ttft_s: Optional[float]
    max_ttft_s: Optional[float]
    #: KV blocks in use after each step, as a fraction of the pool: peak and mean over steps.
    peak_kv_utilization: float
    mean_kv_utilization: float
    #: Most sequences running in one step.
    peak_running_seqs: int
    #: The manager's prefix cache: hit ratio and hit tokens (over every admission, recomputes too).
    prefix_hit_ratio: float
    prefix_hit_tokens: int
    #: Prompt tokens of the added requests served from the prefix cache at their first admission,
    #: over all their prompt tokens.
    request_prefix_hit_ratio: float
    #: Sequences preempted, copy-on-write block copies, cache evictions.
    num_preemptions: int
    cow_copies: int
    evictions: int
    #: The pool.
    num_blocks: int
    block_size: int
    #: Preempted sequences by how they were reclaimed (they add up to ``num_preemptions``).
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    #: KV blocks copied to the host pool and back (the swap engine's counts).
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    #: Prompt tokens served from each tier of the prefix cache (``"gpu"``, ``"host"``,
    #: ``"disk"``, ``"remote"``; they add up to ``prefix_hit_tokens``). A block fetched from a
    #: lower tier for a request counts for that tier, not the host tier it passed through.
    prefix_hits_by_tier: Dict[str, int] = field(default_factory=dict)
    #: Bytes each tier served (read from it: host → GPU loads, disk/remote → host fetches) and
    #: took (written to it: GPU → host offloads, host → disk/remote demotions).
    tier_bytes_read: Dict[str, int] = field(default_factory=dict)
    tier_bytes_written: Dict[str, int] = field(default_factory=dict)
    #: Bytes each tier holds now (``None`` where it cannot be known: a shared remote store).
    tier_usage_bytes: Dict[str, Optional[int]] = field(default_factory=dict)
    #: Speculative decoding (all 0 without ``speculative_config``): sequence-steps that carried
    #: drafts, draft tokens verified, drafts accepted, and drafts accepted at each position
    #: (index ``j``: how often the ``j + 1``-th draft was accepted).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_tokens_by_position: List[int] = field(default_factory=list)
    #: ``spec_num_accepted_tokens / spec_num_draft_tokens`` (0 with no drafts).
    spec_acceptance_rate: float = 0.0
    #: Tokens a drafted sequence-step produced on average: ``1 + accepted / drafts``.
    spec_mean_acceptance_length: float = 0.0
    #: Steps whose drafts the cost model dropped: verifying them would not have paid
    #: (``pagedkv.engine.spec_decode.policy``).
    spec_num_steps_skipped: int = 0

    def as_dict(self) -> Dict[str, Any]:
        """The counters as a plain dict (for JSON)."""
        return asdict(self)


_COUNTERS = ("num_requests", "num_finished_requests", "num_prompt_tokens", "num_generated_tokens",
             "num_prefill_tokens", "num_steps", "num_preemptions", "peak_running_seqs",
             "num_preemptions_swap", "num_preemptions_recompute",
             "request_hit_tokens", "request_prompt_tokens")


class StatsTracker:
    """Counts an engine's work; ``core`` is its :class:`~pagedkv.engine.core.EngineCore` (the
    manager, swap engine and tiers whose cumulative counters are read)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.reset()

    def reset(self) -> None:
        """Zeroes the engine's own counters and snapshots the cumulative ones."""
        #: The engine's own counters (:data:`_COUNTERS`), by name.
        self.counters: Dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self.busy = 0.0
        self._util_sum = 0.0
        self._util_peak = 0.0
        self._ttfts: List[float] = []
        core = self.core
        s = core.manager.stats()
        self._base = (s.prefix_query_tokens, s.prefix_hit_tokens, s.cow_copies, s.evictions)
        swap = core.runner.swap
        self._swap_base = (swap.num_swapped_out, swap.num_swapped_in) if swap else (0, 0)
        tiers = core.tiers
        self._tier_base = tiers.totals(core.runner.spec.bytes_per_block) if tiers else {}
        self._spec_base = (dict(getattr(core, "spec_counts", {})),
                           list(getattr(core, "spec_accepted_by_pos", [])))

    def on_request(self, num_prompt_tokens: int) -> None:
        self.counters["num_requests"] += 1
        self.counters["num_prompt_tokens"] += num_prompt_tokens

    def on_first_token(self, req: Any) -> None:
        """``req``'s first token: its prompt and prefix hits count for the request hit ratio."""
        c = self.counters
        c["request_hit_tokens"] += req.metrics.num_cached_tokens
        c["request_prompt_tokens"] += len(req.prompt_token_ids)

    def on_finished(self, req: Any) -> None:
        self.counters["num_finished_requests"] += 1
        ttft = req.metrics.time_to_first_token
        if ttft is not None:
            self._ttfts.append(ttft)

    def record_step(self, num_seqs: int, num_tokens: int, elapsed: float) -> None:
        """A step that ran ``num_seqs`` sequences and generated ``num_tokens`` in ``elapsed``
        seconds; samples the pool's utilization after it."""
        c = self.counters
        c["num_steps"] += 1
        c["num_generated_tokens"] += num_tokens
        c["peak_running_seqs"] = max(c["peak_running_seqs"], num_seqs)
        self.busy += elapsed
        s = self.core.manager.stats()
        util = s.used_blocks / s.num_blocks
        self._util_sum += util
        self._util_peak = max(self._util_peak, util)

    def snapshot(self) -> EngineStats:
        """What the engine has done since the last :meth:`reset`."""
        c = self.counters
        s = self.core.manager.stats()
        swap = self.core.runner.swap
        query = s.prefix_query_tokens - self._base[0]
        hits = s.prefix_hit_tokens - self._base[1]
        busy = self.busy
        gen = c["num_generated_tokens"]
        return EngineStats(
            num_requests=c["num_requests"],
            num_finished_requests=c["num_finished_requests"],
            num_prompt_tokens=c["num_prompt_tokens"],
            num_generated_tokens=gen,
            num_prefill_tokens=c["num_prefill_tokens"],
            num_steps=c["num_steps"],
            busy_time_s=busy,
            generation_tokens_per_s=gen / busy if busy > 0 else 0.0,
            total_tokens_per_s=(gen + c["num_prefill_tokens"]) / busy if busy > 0 else 0.0,
            mean_ttft_s=sum(self._ttfts) / len(self._ttfts) if self._ttfts else None,
            max_ttft_s=max(self._ttfts) if self._ttfts else None,
            peak_kv_utilization=self._util_peak,
            mean_kv_utilization=self._util_sum / c["num_steps"] if c["num_steps"] else 0.0,
            peak_running_seqs=c["peak_running_seqs"],
            prefix_hit_ratio=hits / query if query else 0.0,
            prefix_hit_tokens=hits,
            request_prefix_hit_ratio=(c["request_hit_tokens"] / c["request_prompt_tokens"]
                                      if c["request_prompt_tokens"] else 0.0),
            num_preemptions=c["num_preemptions"],
            num_preemptions_swap=c["num_preemptions_swap"],
            num_preemptions_recompute=c["num_preemptions_recompute"],
            swapped_out_blocks=(swap.num_swapped_out - self._swap_base[0]) if swap else 0,
            swapped_in_blocks=(swap.num_swapped_in - self._swap_base[1]) if swap else 0,
            cow_copies=s.cow_copies - self._base[2],
            evictions=s.evictions - self._base[3],
            num_blocks=s.num_blocks,
            block_size=s.block_size,
            **self._tier_stats(hits),
            **self._spec_stats(),
        )

    def _spec_stats(self) -> Dict[str, Any]:
        """The speculative fields of :class:`EngineStats`: the core's counts less those at
        :meth:`reset`."""
        counts = getattr(self.core, "spec_counts", None)
        if not counts:
            return {}
        base, base_pos = self._spec_base
        d = {k: v - base.get(k, 0) for k, v in counts.items()}
        by_pos = [v - (base_pos[i] if i < len(base_pos) else 0)
                  for i, v in enumerate(self.core.spec_accepted_by_pos)]
        drafts, tokens, acc = d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]
        return {"spec_num_drafts": drafts, "spec_num_draft_tokens": tokens,
                "spec_num_accepted_tokens": acc, "spec_accepted_tokens_by_position": by_pos,
                "spec_acceptance_rate": acc / tokens if tokens else 0.0,
                "spec_mean_acceptance_length": 1.0 + acc / drafts if drafts else 0.0,
                "spec_num_steps_skipped": d.get("num_steps_skipped", 0)}

    def _tier_stats(self, hits: int) -> Dict[str, Any]:
        """The per-tier fields of :class:`EngineStats` (the GPU's hits alone without a host tier):
        the tier cache's totals less those at :meth:`reset`."""
        tiers = self.core.tiers
        if tiers is None:
            return {"prefix_hits_by_tier": {"gpu": hits}}
        now = tiers.totals(self.core.runner.spec.bytes_per_block)
        base = self._tier_base

        def since(key: str) -> Dict[str, int]:
            return {k: v - base[key].get(k, 0) for k, v in now[key].items()}

        return {"prefix_hits_by_tier": since("hits"), "tier_bytes_read": since("bytes_read"),
                "tier_bytes_written": since("bytes_written"), "tier_usage_bytes": now["usage"]}
