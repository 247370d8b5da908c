"""A vLLM v1 ``KVCacheManager`` whose hot paths run straight on pagedkv's Rust core.

This module owns :class:`PagedKVCacheManager`, a drop-in for
``vllm.v1.core.kv_cache_manager.KVCacheManager`` (vLLM 0.33) that vLLM's unchanged ``Scheduler``
drives, and :class:`DropInKVCacheManager`, the name the plugin installs in the scheduler's module
(it builds vLLM's own manager where pagedkv's refuses the configuration).

Layering. vLLM's manager is three layers of generic Python (``KVCacheManager`` ->
``KVCacheCoordinator`` -> one ``SingleTypeKVCacheManager`` per KV cache group) over a
``BlockPool``. For the configuration that serves most models — one full-attention KV cache group,
no decode-context parallelism, no multi-module MTP re-prefill — this manager answers the calls a
scheduler step makes for every running request (``allocate_slots`` of a request that adopts no
new prefix hit, ``free``, ``get_blocks`` / ``get_block_ids``, ``get_computed_blocks``) in one
flat function each, whose decisions are core calls on the
:class:`~pagedkv.vllm.pool.PagedKVBlockPool` underneath: the free-block count that gates an
allocation, which blocks an allocation takes and which cached blocks it evicts
(``KeyedBlockPool.allocate``), the prefix-cache lookups (``KeyedBlockPool.lookup``), and the
release order of a finished request's blocks (``KeyedBlockPool.release``, one batch call).

Everything else (a first allocation that adopts prefix hits or connector tokens, partial-hit
copy-on-write, encoder tokens, KV events, metrics, connector hooks) runs vLLM's own code over the
same pool, so both paths share one state.

Invariants:
  * The per-request tables are vLLM's own structures, ``req_to_blocks`` and ``num_cached_block``
    of the single full-attention manager, kept by both paths; so every vLLM method this class does
    not override (``pop_blocks_for_free``, ``record_blocks_for_zeroing``,
    ``estimate_cached_tokens`` ...) sees the same tables. (pagedkv's ``BlockManager`` keeps its
    own per-sequence tables keyed by its own prefix hash; the binding offers no table keyed by
    vLLM's block hashes, so the tables stay vLLM's.)
  * A fast-path call leaves the pool, the tables and the caching state exactly as vLLM's code
    would (same blocks, same order, same return value); ``tests/test_vllm_manager.py`` replays
    traces on both managers and compares them step by step.
  * A hybrid model (several KV cache groups: full attention beside sliding-window, chunked
    local or Mamba layers) runs vLLM's coordinator and per-group managers over the pagedkv pool,
    whose core keys every block by (vLLM's block hash, group id): the eviction order, the
    reference counts and the prefix map of every group are the core's, the per-group tables
    vLLM's (``fast`` is False). Only a configuration with no KV cache group is refused
    (``InvalidConfigError``); :class:`DropInKVCacheManager` then builds vLLM's own manager.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.core import kv_cache_coordinator
from vllm.v1.core import kv_cache_manager as _stock_mod
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import RequestStatus

from pagedkv.errors import InvalidConfigError
from pagedkv.vllm.pool import PagedKVBlockPool

logger = init_logger(__name__)

StockKVCacheManager = _stock_mod.KVCacheManager
KVCacheBlocks = _stock_mod.KVCacheBlocks

_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def describe_groups(kv_cache_config: KVCacheConfig) -> str:
    """``"0: FullAttentionSpec (2 layers), 1: SlidingWindowSpec (2 layers)"``."""
    return ", ".join(
        f"{i}: {type(g.kv_cache_spec).__name__} ({len(g.layer_names)} layers)"
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
    )


def check_supported(kv_cache_config: KVCacheConfig) -> None:
    """Raise ``InvalidConfigError`` for a configuration the manager refuses: a model with no
    KV cache group (attention-free), which has no blocks to manage."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise InvalidConfigError(
            "pagedkv's vLLM KV cache manager needs at least one KV cache group, got 0 (an "
            "attention-free model); it uses vLLM's own manager",
            field="kv_cache_groups", value=0, reason="at least one group",
        )


class PagedKVCacheManager(StockKVCacheManager):
    """vLLM's ``KVCacheManager`` contract (same constructor, same methods) on pagedkv's core.

    Always builds its pool as :class:`~pagedkv.vllm.pool.PagedKVBlockPool`. ``fast`` tells
    whether the flat paths are on (one full-attention group, DCP/PCP 1, no re-prefilled tokens,
    scheduler block size = hash block size); otherwise every method is vLLM's own code over the
    pagedkv pool.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, *args: Any, **kwargs: Any) -> None:
        check_supported(kv_cache_config)
        saved = kv_cache_coordinator.BlockPool
        kv_cache_coordinator.BlockPool = PagedKVBlockPool  # type: ignore[misc]
        try:
            super().__init__(kv_cache_config, *args, **kwargs)
        finally:
            kv_cache_coordinator.BlockPool = saved  # type: ignore[misc]
        coord = self.coordinator
        stm = coord.single_type_managers[0]
        pool = self.block_pool
        self._stm = stm
        self._pool = pool
        self._core = pool._core
        self._bs = stm.block_size
        self.fast = (
            len(coord.single_type_managers) == 1
            and type(stm) is FullAttentionManager
            and stm.dcp_world_size == 1
            and stm.pcp_world_size == 1
            and getattr(coord, "num_reprefillable_tokens", 0) == 0
            and pool.hash_block_size == stm.block_size
            and not self.mamba_shared_prefix_checkpoint
        )
        self._drop_eagle = 0 in getattr(coord, "drop_eagle_group_ids", ())
        self._release_mode = pool._release_mode
        # vLLM's cache_full_blocks adds nothing but the keys when no event is published and the
        # spec is prefix-cacheable (full attention: every block is reachable).
        self._cache_direct = (
            not self.enable_kv_cache_events and stm.kv_cache_spec.prefix_cacheable
        )
        if not self.fast:
            logger.info(
                "pagedkv KV cache manager: %s uses vLLM's manager code over pagedkv's pool",
                describe_groups(kv_cache_config),
            )

    # ---- lookups ---------------------------------------------------------------------------

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[Any, int, int]:
        if not self.fast or (
            self.enable_kv_cache_events
            and getattr(request, "kv_cache_report_mode", "incremental") == "full"
        ):
            return super().get_computed_blocks(request, max_cache_hit_length)
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        bs = self._bs
        n = max_cache_hit_length // bs
        hashes = request.block_hashes
        lookup = self._core.lookup
        blocks = self._pool.blocks
        hit: list[Any] = []
        for h in hashes[:n] if len(hashes) > n else hashes:
            b = lookup(make_block_hash_with_group_id(h, 0))
            if b is None:
                break
            hit.append(blocks[b])
        if self._drop_eagle and hit:
            hit.pop()
        if not hit:
            return self.empty_kv_cache_blocks, 0, 0
        return KVCacheBlocks((hit,)), len(hit) * bs, 0

    # ---- the per-step path -----------------------------------------------------------------

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> Any:
        stm = self._stm
        rid = request.request_id
        if (
            not self.fast
            or num_new_tokens <= 0
            or num_new_computed_tokens
            or num_external_computed_tokens
            or num_encoder_tokens
            or full_sequence_must_fit
            or (
                new_computed_blocks is not None
                and new_computed_blocks is not self.empty_kv_cache_blocks
            )
            or rid in stm._partial_hit_reqs
        ):
            return super().allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                new_computed_blocks,
                num_lookahead_tokens,
                num_external_computed_tokens,
                delay_cache_blocks,
                num_encoder_tokens,
                full_sequence_must_fit,
                reserved_blocks,
                has_scheduled_reqs,
                skip_zeroing_group_ids,
            )
        max_len = self.max_model_len
        computed = request.num_computed_tokens
        if computed > max_len:
            computed = max_len
        main = computed + num_new_tokens
        need = main + num_lookahead_tokens
        if need > max_len:
            need = max_len
        bs = self._bs
        req_blocks = stm.req_to_blocks[rid]
        n_new = -(-need // bs) - len(req_blocks)
        if n_new < 0:
            n_new = 0
        required = n_new
        if has_scheduled_reqs and request.status in _WAITING:
            required += self.watermark_blocks
        if required > self._core.num_free - reserved_blocks:
            return None
        if n_new:
            new = self._pool.get_new_blocks(n_new)
            req_blocks.extend(new)
            if stm._record_new_block_ids:
                stm.new_block_ids.extend([b.block_id for b in new])
        if not delay_cache_blocks and self.enable_caching:
            # vLLM's cache_blocks, skipped when no block became full (most decode steps).
            hashed = len(request.block_hashes) * bs
            full = (main if main < hashed else hashed) // bs
            if full > stm.num_cached_block.get(rid, 0):
                nt = request.num_tokens
                to_cache = main if main < nt else nt
                full = (to_cache if to_cache < hashed else hashed) // bs
                cached = stm.num_cached_block.get(rid, 0)
                if full > cached:
                    self._cache(request, req_blocks, cached, full, to_cache)
        if n_new:
            return KVCacheBlocks((new,))
        return self.empty_kv_cache_blocks

    def _cache(
        self, request: Any, req_blocks: list[Any], cached: int, full: int, to_cache: int
    ) -> None:
        """Key blocks ``cached:full`` of a request by vLLM's block hashes, as vLLM's
        ``cache_blocks`` would; directly into the core when no event is published and no block
        is being promoted from a partial key, else through vLLM's code."""
        pool = self._pool
        if self._cache_direct:
            new = req_blocks[cached:full]
            if not any(b.block_hash is not None for b in new):
                bs = self._bs
                hashes = request.block_hashes
                insert = pool._insert_block_hash
                for i, blk in enumerate(new, cached):
                    if not blk.is_null:
                        insert(make_block_hash_with_group_id(hashes[i], 0), blk, (i + 1) * bs)
                self._stm.num_cached_block[request.request_id] = full
                return
        self.coordinator.cache_blocks(request, to_cache)

    def free(self, request: Any) -> None:
        if not self.fast:
            return super().free(request)
        stm = self._stm
        rid = request.request_id
        blocks = stm.req_to_blocks.pop(rid, None)
        stm.num_cached_block.pop(rid, None)
        stm._partial_hit_reqs.pop(rid, None)
        if not blocks:
            return None
        # One core call, tail first (the tail is evicted first when caching is on).
        ids = [b.block_id for b in reversed(blocks) if not b.is_null]
        self._core.release(ids, self._release_mode)
        return None

    def get_blocks(self, request_id: str) -> Any:
        if not self.fast:
            return super().get_blocks(request_id)
        blocks = self._stm.req_to_blocks.get(request_id)
        return KVCacheBlocks((blocks,)) if blocks else self.empty_kv_cache_blocks

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        if not self.fast:
            return super().get_block_ids(request_id)
        blocks = self._stm.req_to_blocks.get(request_id)
        return ([b.block_id for b in blocks] if blocks else [],)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        if self.fast:
            return None  # full attention skips no token
        return super().remove_skipped_blocks(
            request_id, processed_computed_tokens, num_prompt_tokens
        )

    def new_step_starts(self) -> None:
        if self.fast:
            return None  # FullAttentionManager.new_step_starts does nothing
        return super().new_step_starts()

    # ---- pagedkv additions -----------------------------------------------------------------

    def check_coherence(self) -> None:
        """Every table's blocks are held by the core at least once per holder; the pool is
        coherent with its core (see :meth:`PagedKVBlockPool.check_coherence`)."""
        core, pool = self._core, self._pool
        # Per group: a group's tables take one reference per holder. Not checked: the tables of
        # vLLM's host-backed sparse auxiliary groups (hot / resident pages), which keep pages
        # after releasing them, as they do on vLLM's own pool, and blocks of another pool (the
        # sparse source group's host pages), which that pool counts.
        for g, stm in enumerate(self.coordinator.single_type_managers):
            if any(c.__name__ == "_HiSparseAuxiliaryManager" for c in type(stm).__mro__):
                continue
            counts: dict[int, int] = {}
            for blocks in stm.req_to_blocks.values():
                for b in blocks:
                    if not b.is_null and b.pool is pool:
                        counts[b.block_id] = counts.get(b.block_id, 0) + 1
            for bid, n in counts.items():
                assert core.ref_count(bid) >= n, (
                    f"group {g}, block {bid}: held by {n} requests, core count "
                    f"{core.ref_count(bid)}"
                )
                assert not core.is_free(bid), (
                    f"group {g}, block {bid}: held by a request but free in the core"
                )
        self._pool.check_coherence()


class DropInKVCacheManager(PagedKVCacheManager):
    """What the plugin binds as the scheduler's ``KVCacheManager``: pagedkv's manager where it
    takes the configuration, vLLM's own (with vLLM's pool) where it refuses it (no KV cache
    group), with one warning saying why."""

    def __new__(cls, kv_cache_config: KVCacheConfig, *args: Any, **kwargs: Any) -> Any:
        try:
            check_supported(kv_cache_config)
        except InvalidConfigError as e:
            logger.warning("%s: falling back to vLLM's KVCacheManager", e)
            return StockKVCacheManager(kv_cache_config, *args, **kwargs)
        return super().__new__(cls)
