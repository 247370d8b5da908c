"""The small result types the block manager returns or takes.

Owns :class:`AdmitResult` (one admission), :class:`CostModel` (the swap-or-recompute rates),
:class:`Decision` (what :meth:`~pagedkv.BlockManager.decide` chose) and :class:`Stats` (a snapshot of
the counters). All are immutable: named tuples filled straight from the extension's tuples, and a
frozen dataclass built from the core's ``stats()`` dict, so a value never changes after it is
returned.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, NamedTuple, Tuple


class AdmitResult(NamedTuple):
    """Outcome of one admission."""

    #: Prompt tokens whose KV was found in the prefix cache (a multiple of the block size).
    cached_tokens: int
    #: Blocks freshly allocated for the prompt.
    new_blocks: int
    #: Blocks in the sequence's table after admission (cached ones included).
    num_blocks: int
    #: Tokens the sequence holds after admission: ``cached_tokens + min(max_new_tokens,
    #: len(prompt) - cached_tokens)``, the whole prompt without ``max_new_tokens``. The first step
    #: computes ``[cached_tokens, num_tokens)``; the rest of the prompt is fed with :meth:`append`.
    num_tokens: int
    #: Of ``cached_tokens``, those found on the device (shared blocks).
    cached_tokens_gpu: int
    #: Of ``cached_tokens``, those found in the host tier: loaded into freshly allocated device
    #: blocks by the next step's swap-in list, not computed (0 without a host tier).
    cached_tokens_host: int


class CostModel(NamedTuple):
    """Rates the swap-or-recompute choice is made from (measured on the device, or given).

    Swap cost = 2 × the victim's KV bytes / ``host_link_bytes_per_s``. A step is modelled as
    costing ``max(step_floor_s, tokens / prefill_tokens_per_s)``: below that knee it is bound by
    what it pays whatever it carries (launch overhead, weight reads), so a recompute folded into
    steps that run anyway (beside the running decodes) costs only what it adds to them, chunk by
    chunk of at most ``max_step_tokens``. With the defaults (no floor, no chunking) recompute
    cost = tokens / ``prefill_tokens_per_s``. See :meth:`BlockManager.decide`.
    """

    #: Host <-> device copy bandwidth, bytes per second, one direction.
    host_link_bytes_per_s: float
    #: Prefill throughput once a step is compute-bound, tokens per second.
    prefill_tokens_per_s: float
    #: KV bytes per token over all layers (``2 * kv_heads * head_dim * dtype_bytes * layers``).
    kv_bytes_per_token: float
    #: Seconds a step costs however few tokens it carries (0: every token costs 1 / rate).
    step_floor_s: float = 0.0
    #: Most tokens one step carries (the scheduler's ``max_num_batched_tokens``); 0 = no limit.
    max_step_tokens: int = 0


class Decision(NamedTuple):
    """What :meth:`BlockManager.decide` chose, and why."""

    #: ``"swap"`` or ``"recompute"``.
    mode: str
    #: Estimated seconds to swap the victim out and back in.
    swap_cost_s: float
    #: Estimated seconds to recompute it.
    recompute_cost_s: float
    #: Whether the host pool has room for the swap now (when not, the mode is recompute).
    swap_possible: bool
    #: Distinct device blocks a swap would copy (over every KV cache group).
    swap_blocks: int
    #: Tokens a recompute would re-run.
    recompute_tokens: int
    #: Tokens of other work each step was assumed to carry beside the recompute.
    batch_tokens: int = 0


@dataclass(frozen=True)
class Stats:
    """A snapshot of the manager's state and counters (the core's ``metrics::Stats``)."""

    #: Blocks in the pool.
    num_blocks: int
    #: Tokens per block.
    block_size: int
    #: Blocks on the free list (never cached, or dropped from the cache).
    free_blocks: int
    #: Refcount-0 blocks kept for their cached content; reusable (evicted) on demand.
    cached_free_blocks: int
    #: Blocks held by a sequence or by a pending copy.
    used_blocks: int
    #: Live sequences.
    num_seqs: int
    #: Sum of sequence lengths (a shared block counts for every sequence holding it).
    used_tokens: int
    #: ``used_tokens / (num_blocks * block_size)``; can exceed 1 with sharing.
    kv_utilization: float
    #: ``used_blocks * block_size``: slots set aside, partly filled tail blocks included.
    allocated_token_slots: int
    #: Prompt tokens looked up in the prefix cache.
    prefix_query_tokens: int
    #: Of those, tokens served from cached blocks.
    prefix_hit_tokens: int
    #: ``prefix_hit_tokens / prefix_query_tokens`` (0 before any lookup).
    prefix_hit_ratio: float
    #: Cached-free blocks evicted to satisfy an allocation.
    evictions: int
    #: Verify mode: hash hits whose cached token ids differed (served as misses).
    prefix_collisions: int
    #: Blocks with a reference count above one.
    shared_blocks: int
    #: Copy-on-write block copies queued so far.
    cow_copies: int
    #: Preemptions so far, both modes, counted per sequence.
    preemptions: int
    #: Sequences swapped out so far.
    preemptions_swap: int
    #: Running sequences preempted by recompute so far.
    preemptions_recompute: int
    #: Device -> host block copies queued so far (a block shared in a group once).
    swapped_out_blocks: int
    #: Host -> device block copies queued so far.
    swapped_in_blocks: int
    #: Prompt tokens served from the host tier (also counted in ``prefix_hit_tokens``).
    host_hit_tokens: int
    #: Host -> device loads queued by admissions hitting the host tier.
    host_loaded_blocks: int
    #: Device -> host copies queued to keep evicted cached blocks in the host tier.
    offloaded_blocks: int
    #: Host-cached blocks dropped from the host tier to make room (see :meth:`take_demotions`).
    demotions: int
    #: Host blocks holding cached blocks of the host tier now.
    host_cached_blocks: int
    #: Blocks of the host pool.
    num_host_blocks: int
    #: Free blocks of the host pool.
    host_free_blocks: int
    #: Sequences swapped out now.
    swapped_seqs: int
    #: ``used_blocks / num_blocks`` with cached-free blocks counted as free (vLLM's KV cache
    #: usage; unlike :attr:`kv_utilization` it never exceeds 1).
    kv_cache_usage: float
    #: Sequences per block-count bucket: bucket 0 holds 0–1 blocks, bucket ``k >= 1`` holds
    #: ``(2**(k-1), 2**k]`` blocks, the last bucket everything above.
    blocks_per_seq: Tuple[int, ...]

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take: free plus cached-free."""
        return self.free_blocks + self.cached_free_blocks

    def as_dict(self) -> dict[str, Any]:
        """The snapshot as a plain dict (``blocks_per_seq`` as a list), e.g. for JSON."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["blocks_per_seq"] = list(self.blocks_per_seq)
        return d
