"""The block manager's configuration and capacity, read-only.

Owns :class:`_ConfigMixin`: the sizes and flags a :class:`~pagedkv.BlockManager` was built with
(pool, block size, watermark, row width, prefix caching, groups, host pool, KV-event ring), the free
counts, and the KV-event ring's drain. Invariant: nothing here changes the manager, except
:meth:`drain_kv_events`, which only empties the event ring.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from ..groups import KVCacheGroup
from ._base import _ManagerBase

class _ConfigMixin(_ManagerBase):
    """Configuration, free counts and the KV-event ring of :class:`~pagedkv.BlockManager`."""

    __slots__ = ()

    # ----------------------------------------------------------------------------------- config

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self._core.num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._core.block_size

    @property
    def watermark_blocks(self) -> int:
        """Blocks kept back from admissions."""
        return self._core.watermark_blocks

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a block-table row: the most blocks one sequence may hold."""
        return self._core.max_blocks_per_seq

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether full blocks are shared and cached by prefix hash."""
        return self._core.enable_prefix_caching

    @property
    def verify_prefix(self) -> bool:
        """Whether prefix-cache hits also compare token ids."""
        return self._core.verify_prefix

    @property
    def max_provisional(self) -> int:
        """Provisional tokens a sequence may hold past its committed length (0: none)."""
        return self._core.max_provisional

    @property
    def num_groups(self) -> int:
        """Number of KV cache groups (1 without ``groups``)."""
        return self._core.num_groups

    @property
    def groups(self) -> Tuple[KVCacheGroup, ...]:
        """The KV cache groups, group ``g`` at index ``g``."""
        return tuple(KVCacheGroup(kind, size) for kind, size in self._core.groups)  # type: ignore[arg-type]

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host pool (0: swap disabled)."""
        return self._core.num_host_blocks

    @property
    def kv_event_capacity(self) -> int:
        """Records of the KV-event ring (0: events off)."""
        return self._core.kv_event_capacity

    @property
    def kv_events_dropped(self) -> int:
        """KV-event records the full ring overwrote before they were drained."""
        return self._core.kv_events_dropped

    def drain_kv_events(
            self) -> List[Tuple[str, str, List[int], Optional[int], List[int], int, int]]:
        """The recorded KV events, oldest first, as ``(kind, medium, block_hashes, parent_hash,
        token_ids, block_size, group)``, ``group`` the KV cache group of the blocks (0 for a
        manager without groups, and for ``"cleared"``); the ring is then empty
        (``docs/kv-events.md``)."""
        return self._core.drain_kv_events()

    def cached_block_keys(self) -> List[Tuple[int, int]]:
        """``(group, hash)`` of every block the device prefix cache holds (held by a sequence or
        cached-free), sorted: what the device tier's stored and removed events add up to, hash
        being the block's chained prefix hash (the same for every group). O(cached blocks); for
        tests and diagnostics."""
        return self._core.cached_block_keys()

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now: free ones plus cached-free (evictable) ones."""
        return self._core.num_free_blocks()

    @property
    def num_free_host_blocks(self) -> int:
        """Free blocks of the host pool."""
        return self._core.num_free_host_blocks()

    @property
    def num_seqs(self) -> int:
        """Live sequences (same as ``len(manager)``)."""
        return self._core.num_seqs()
