"""A vLLM v1 ``BlockPool`` whose bookkeeping lives in pagedkv's Rust core.

This module owns :class:`PagedKVBlockPool`, a drop-in for ``vllm.v1.core.block_pool.BlockPool``
(vLLM 0.33), and the two views it hands out where vLLM code and tests expect the stock pool's
data structures (``free_block_queue`` and ``cached_block_hash_to_block``).

What the core (``pagedkv._core.KeyedBlockPool``) holds, authoritatively:
  * every block's reference count;
  * the eviction order of free blocks (uncached frees to the front, cached frees to the back in
    release order, a hit on a free block revives it, allocation takes from the front and evicts);
  * the prefix map from vLLM's keys (``BlockHashWithGroupId``: hash bytes + 4-byte group id) to
    blocks, several blocks per key allowed, and every key of every block.

What stays in Python, as vLLM's own objects:
  * ``self.blocks``: one ``KVCacheBlock`` per block id (a subclass whose ``ref_cnt`` reads and
    writes the core's count, so a manager that retains a block with ``block.ref_cnt += 1`` stays
    coherent), ``block.block_hash`` (the first key, kept by vLLM's own insert/remove paths, which
    run through the core-backed map), ``is_null`` (block 0);
  * KV cache events, metrics-collector hooks, reuse watchers and partial-block entries, which
    are inherited from vLLM's class and run on top of the core-backed structures.

Invariants (checked by :meth:`PagedKVBlockPool.check_coherence`): for every block,
``block.ref_cnt`` is the core count; ``block.block_hash`` is ``None`` iff the core has no key for
it, and otherwise is one of its keys; the null block is never free and never keyed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping, Sequence
import weakref
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared
from vllm.logger import init_logger
from vllm.v1.core import block_pool as _stock
from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock

from pagedkv._core import KeyedBlockPool

logger = init_logger(__name__)

StockBlockPool = _stock.BlockPool


class CoreBlock(KVCacheBlock):
    """A ``KVCacheBlock`` whose reference count is the core's.

    Reading ``ref_cnt`` asks the core; assigning it sets the core's count of a held block (the
    managers' direct retains). Moving a count to or from zero has to go through the pool, which
    also keeps the eviction order: assigning that raises ``InvalidArgumentError``.
    """

    __slots__ = ("_core",)

    @property  # type: ignore[override]
    def ref_cnt(self) -> int:
        return self._core.ref_count(self.block_id)

    @ref_cnt.setter
    def ref_cnt(self, value: int) -> None:
        try:
            core = self._core
        except AttributeError:
            # The dataclass __init__ assigns the default 0 before the core is attached.
            return
        if value != core.ref_count(self.block_id):
            core.set_ref(self.block_id, value)

    # The free-list links are the core's: read-only views (the dataclass __init__ assigns None).
    @property  # type: ignore[override]
    def prev_free_block(self) -> Any:
        return self._link(0)

    @prev_free_block.setter
    def prev_free_block(self, value: Any) -> None:
        pass

    @property  # type: ignore[override]
    def next_free_block(self) -> Any:
        return self._link(1)

    @next_free_block.setter
    def next_free_block(self, value: Any) -> None:
        pass

    def _link(self, side: int) -> Any:
        try:
            core = self._core
        except AttributeError:
            return None
        nb = core.free_neighbours(self.block_id)
        if nb is None:
            return None
        other = nb[side]
        queue = self.pool.free_block_queue
        if other is None:
            return queue.fake_free_list_tail if side else queue.fake_free_list_head
        return self.pool.blocks[other]


class _End:
    """One end of the free list as ``FreeKVCacheBlockQueue`` shows it (a fake head or tail)."""

    __slots__ = ("_pool", "_is_head")
    block_id = -1

    def __init__(self, pool: PagedKVBlockPool, is_head: bool) -> None:
        self._pool, self._is_head = pool, is_head

    def _edge(self, wanted_side: bool) -> Any:
        q = self._pool.free_block_queue
        if wanted_side != self._is_head:
            return None  # nothing before the head, nothing after the tail
        core = self._pool._core
        b = core.free_front if self._is_head else core.free_back
        if b is None:
            return q.fake_free_list_tail if self._is_head else q.fake_free_list_head
        return self._pool.blocks[b]

    @property
    def next_free_block(self) -> Any:
        return self._edge(True)

    @property
    def prev_free_block(self) -> Any:
        return self._edge(False)


class CoreFreeQueue:
    """Read-only view of the core's eviction order, shaped like ``FreeKVCacheBlockQueue``.

    Offers what vLLM code and tests read: ``num_free_blocks``, ``get_all_free_blocks``,
    ``iter_blocks_after``, and walking the list from ``fake_free_list_head`` /
    ``fake_free_list_tail`` through the blocks' ``next_free_block`` / ``prev_free_block``
    (each link is a core query). Changing the order goes through the pool's methods.
    """

    def __init__(self, pool: PagedKVBlockPool) -> None:
        self._pool = pool
        self.fake_free_list_head = _End(pool, True)
        self.fake_free_list_tail = _End(pool, False)

    @property
    def num_free_blocks(self) -> int:
        return self._pool._core.num_free

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        blocks = self._pool.blocks
        return [blocks[i] for i in self._pool._core.free_order()]

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        order = self._pool._core.free_order()
        start = 0
        if cursor is not None:
            try:
                start = order.index(cursor.block_id) + 1
            except ValueError:
                start = len(order)
        blocks = self._pool.blocks
        for i in order[start:]:
            yield blocks[i]


class CoreCacheView(MutableMapping):  # type: ignore[type-arg]
    """``BlockHashToBlockMap._cache`` as a live view of the core's map.

    Values have vLLM's shape: one ``KVCacheBlock``, or ``{block_id: block}`` for several.
    Writing through it edits the core's map only, as writing into vLLM's dict edits only the
    dict: the blocks' ``block_hash`` fields are left as they were (the pool then stops checking
    its coherence, see :meth:`PagedKVBlockPool.check_coherence`). ``copy.copy`` gives a dict.
    """

    def __init__(self, pool: PagedKVBlockPool) -> None:
        self._pool = pool

    def _value(self, ids: int | list[int]) -> Any:
        blocks = self._pool.blocks
        return blocks[ids] if isinstance(ids, int) else {i: blocks[i] for i in ids}

    def _snapshot(self) -> dict[bytes, Any]:
        return {k: self._value(ids) for k, ids in self._pool._core.entries().items()}

    def __getitem__(self, key: bytes) -> Any:
        ids = self._pool._core.entries().get(key)
        if ids is None:
            raise KeyError(key)
        return self._value(ids)

    def __setitem__(self, key: bytes, value: Any) -> None:
        core = self._pool._core
        self._pool._direct_edits = True
        if key in self:
            del self[key]
        blocks = list(value.values()) if isinstance(value, dict) else [value]
        for b in blocks:
            core.insert(key, b.block_id)
        # (a dict of one block comes back as a single block: the core keeps no empty shapes)

    def __delitem__(self, key: bytes) -> None:
        core = self._pool._core
        ids = core.entries().get(key)
        if ids is None:
            raise KeyError(key)
        self._pool._direct_edits = True
        for i in [ids] if isinstance(ids, int) else ids:
            core.remove(key, i)

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._pool._core.entries()))

    def __len__(self) -> int:
        return self._pool._core.num_keys

    def clear(self) -> None:
        self._pool._direct_edits = True
        self._pool._core.clear_keys()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CoreCacheView):
            other = other._snapshot()
        return self._snapshot() == other

    def __copy__(self) -> dict[bytes, Any]:
        return self._snapshot()

    def __repr__(self) -> str:
        return f"CoreCacheView({self._snapshot()!r})"


class CoreHashMap:
    """The core's key → blocks map behind ``BlockHashToBlockMap``'s methods."""

    def __init__(self, pool: PagedKVBlockPool) -> None:
        self._pool = pool
        self._core = pool._core
        self._cache = CoreCacheView(pool)

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        b = self._core.lookup(key)
        return None if b is None else self._pool.blocks[b]

    def contain(self, key: bytes, block_id: int) -> bool:
        return self._core.contains(key, block_id)

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        # The pool's own paths call the core directly; a call here is a direct edit.
        self._pool._direct_edits = True
        self._core.insert(key, block.block_id)

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        self._pool._direct_edits = True
        if self._core.remove(key, block_id):
            return self._pool.blocks[block_id]
        return None

    def __len__(self) -> int:
        return self._core.num_keys

    def __bool__(self) -> bool:
        return self._core.num_keys > 0


class PagedKVBlockPool(StockBlockPool):
    """vLLM's ``BlockPool`` contract (same constructor, same methods) on pagedkv's core.

    The hot calls of a scheduler step (``get_new_blocks``, ``touch``, ``free_blocks``,
    ``get_cached_block``, ``get_num_free_blocks``) are one core call each; the rest of vLLM's
    methods (``cache_full_blocks``, ``cache_partial_block``, ``evict_blocks``, events ...) are
    vLLM's own code running over the core-backed map.
    """

    #: Pools built since the last clear, held weakly (the pytest plugin checks them after a test).
    _live: weakref.WeakSet[PagedKVBlockPool] = weakref.WeakSet()

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: Any = None,
        num_hash_lookahead_tokens: int = 0,
        medium: str = _stock.MEDIUM_GPU,
    ) -> None:
        # Same precondition as vLLM's pool, same exception type.
        assert isinstance(num_gpu_blocks, int) and num_gpu_blocks > 0
        self.num_gpu_blocks = num_gpu_blocks
        self.medium = medium
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        # Block 0 is vLLM's null block; a one-block pool is all null (nothing allocatable).
        # null_keys: vLLM's BlockHashToBlockMap keys whatever block its caller names (its caching
        # path skips the null block, as this pool's does; its tests key block 0 by hand), so the
        # drop-in lifts the core's refusal to keep vLLM's behaviour.
        self._core = KeyedBlockPool(num_gpu_blocks, reserve_null=True, null_keys=True)
        self._release_mode = "cache" if enable_caching else "front"
        blocks: list[KVCacheBlock] = []
        for idx in range(num_gpu_blocks):
            blk = CoreBlock(idx, pool=self)
            blk._core = self._core
            blocks.append(blk)
        self.blocks = blocks
        self.free_block_queue = CoreFreeQueue(self)  # type: ignore[assignment]
        self.cached_block_hash_to_block = CoreHashMap(self)  # type: ignore[assignment]
        # Secondary keys of a block (its first key is block.block_hash), as vLLM keeps them.
        self.cached_block_hashes_by_block: dict[int, set[bytes]] = {}
        self.null_block = blocks[0]
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue = []
        self.metrics_collector = metrics_collector
        self._reuse_watchers = {}
        # Set when a caller edits the map directly (``_cache``), bypassing the blocks' fields.
        self._direct_edits = False
        PagedKVBlockPool._live.add(self)

    # ---- the hot path: one core call each --------------------------------------------------

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: list[int]
    ) -> list[KVCacheBlock] | None:
        ids = self._core.lookup_groups(block_hash, kv_cache_group_ids)
        if ids is None:
            return None
        blocks = self.blocks
        return [blocks[i] for i in ids]

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self._core.num_free:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ids, evicted = self._core.allocate(num_blocks)
        blocks = self.blocks
        ret = [blocks[i] for i in ids]
        if self._reuse_watchers:
            self._notify_reuse(ret)
        for i in evicted:
            # The core dropped the keys; drop vLLM's view of them and report the removal.
            blk = blocks[i]
            removed = [blk.block_hash] if blk.block_hash is not None else []
            removed.extend(self.cached_block_hashes_by_block.pop(i, ()))
            blk.reset_hash()
            self._emit_block_removed_events(removed)
        mc = self.metrics_collector
        if mc:
            for blk in ret:
                if self.enable_caching:
                    mc.on_block_evicted(blk)
                mc.on_block_allocated(blk)
        return ret

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        ids = []
        for b in blocks:
            if b.is_null:
                continue
            if b.pool is self:
                ids.append(b.block_id)
            else:
                b.ref_cnt += 1  # not ours (see free_blocks): only its own count
        self._core.touch(ids)
        mc = self.metrics_collector
        if mc:
            for b in blocks:
                if not b.is_null:
                    mc.on_block_accessed(b)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        ids: list[int] = []
        other: dict[Any, list[KVCacheBlock]] | None = None
        for b in ordered_blocks:
            if b.is_null:
                continue
            p = b.pool
            if p is self:
                ids.append(b.block_id)
            elif p is None:
                # A block object no pool made (tests build them): as in vLLM, only its own
                # count drops; it was never in any free list, so it joins none.
                b.ref_cnt -= 1
            else:
                if other is None:
                    other = {}
                other.setdefault(p, []).append(b)
        self._core.release(ids, self._release_mode)
        if other:
            for p, bs in other.items():
                p.free_blocks(bs)

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Any) -> None:
        ids = []
        for b in blocks:
            assert b.ref_cnt > 0 and not b.is_null
            ids.append(b.block_id)
            self._reuse_watchers[b.block_id] = on_reuse
        # Still being read: last-resort eviction candidates, whatever their caching state.
        self._core.release(ids, "back")

    def _insert_block_hash(
        self, block_hash_with_group_id: bytes, block: KVCacheBlock, num_tokens: int | None
    ) -> None:
        key = block_hash_with_group_id
        if block.block_hash == key or self._core.contains(key, block.block_id):
            return
        if block.pool is not self:
            # A block object this pool did not make (tests build them): the core keys its id,
            # but the hash lands on that object, not on ours, so stop checking coherence.
            self._direct_edits = True
        # The first key of a block is its block_hash; later ones are secondary, as in vLLM.
        if block.block_hash is None:
            block.set_block_hash(key, num_tokens=num_tokens)
        else:
            self.cached_block_hashes_by_block.setdefault(block.block_id, set()).add(key)
        self._core.insert(key, block.block_id)

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[bytes]:
        keys = [] if block.block_hash is None else [block.block_hash]
        keys.extend(self.cached_block_hashes_by_block.pop(block.block_id, ()))
        if not keys:
            return []
        core, bid = self._core, block.block_id
        removed = [k for k in keys if core.remove(k, bid)]
        block.reset_hash()
        return removed

    def get_num_free_blocks(self) -> int:
        return self._core.num_free

    def reset_prefix_cache(self) -> bool:
        if not self._core.reset():
            used = self.num_gpu_blocks - self._core.num_free - 1
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet", used
            )
            return False
        self.cached_block_hashes_by_block.clear()
        if self._reuse_watchers:
            self._notify_reuse([self.blocks[i] for i in list(self._reuse_watchers)])
        for b in self.blocks:
            b.reset_hash()
        if self.metrics_collector:
            self.metrics_collector.reset()
        logger.info("Successfully reset prefix cache")
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # ---- pagedkv additions -----------------------------------------------------------------

    def check_coherence(self) -> None:
        """Raise ``AssertionError`` if vLLM's block objects disagree with the core, and
        ``InvariantViolationError`` if the core's own invariants are broken.

        After a direct edit of ``cached_block_hash_to_block._cache`` (which, as with vLLM's
        dict, does not update the blocks' fields) only the core's invariants are checked."""
        self._core.check_invariants()
        if self._direct_edits:
            return
        core = self._core
        for b in self.blocks:
            keys = core.keys_of(b.block_id)
            if b.block_hash is None:
                assert not keys, f"block {b.block_id}: core keys {keys} but no block_hash"
            else:
                assert b.block_hash in keys, f"block {b.block_id}: block_hash not in the core"
                extra = set(keys) - {b.block_hash}
                assert extra == self.cached_block_hashes_by_block.get(b.block_id, set()), (
                    f"block {b.block_id}: secondary keys disagree"
                )
        assert self.null_block.is_null and not core.is_free(0)

    def core_stats(self) -> dict[str, int]:
        """The core's counters: lookups, hits, evictions, revivals."""
        return dict(self._core.stats())
