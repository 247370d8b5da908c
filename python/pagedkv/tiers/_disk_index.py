"""The disk tier's index: slot allocation, LRU eviction, removal reports and lookups.

Owns ``_DiskIndex``: taking a slot (a free one, else the least recently used unpinned block's),
releasing and forgetting slots, the bounded record of hashes that left the index unasked
(:meth:`~pagedkv.tiers.disk.DiskStore.take_removed`), and the lookups (``contains``,
``longest_prefix``, ``remove``, ``stats``, ``len``).

**Invariants.** Every method that touches the index runs under ``self._lock`` (the ``_``-prefixed
slot helpers expect the caller to hold it). A pinned slot (being read) is never chosen for eviction;
a slot freed while pinned is marked dead and returns to the free heap when its last reader unpins
it. A forgotten block's magic is zeroed first, so no restart indexes it again.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import replace
from typing import Any, List, Optional, Sequence

from ..errors import InvalidArgumentError
from ._disk_segments import _DiskSegments
from .record import StoreClosedError, TierStats


class _DiskIndex(_DiskSegments):
    """Slots, eviction and the lookups of a :class:`~pagedkv.tiers.disk.DiskStore`."""

    # ---------------------------------------------------------------- argument checks

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self!r} is closed", store=repr(self))

    def _check_hash(self, block_hash: Any) -> int:
        if isinstance(block_hash, bool) or not isinstance(block_hash, int) or not 0 <= block_hash < 1 << 128:
            raise InvalidArgumentError(
                f"block hash must be an integer in [0, 2**128), got {block_hash!r}", what="block_hash",
                value=block_hash, reason="out of range",
            )
        return block_hash

    # ---------------------------------------------------------------- slots (under self._lock)

    def _take_slot(self) -> Optional[int]:
        if self._free:
            return heapq.heappop(self._free)
        for block_hash, slot in self._index.items():
            if slot not in self._pins:
                del self._index[block_hash]
                self._stats.evictions += 1
                self._note_removed(block_hash)
                return slot
        return None

    def _note_removed(self, block_hash: int) -> None:
        """Remember a hash that left the index unasked, for :meth:`take_removed` (bounded: the
        oldest are dropped when nobody drains them)."""
        self._removed[block_hash] = None
        self._removed.move_to_end(block_hash)
        while len(self._removed) > self._removed_cap:
            self._removed.popitem(last=False)

    def take_removed(self) -> List[int]:
        """The hashes this store evicted (overwritten to make room) or dropped as bad bytes
        since the last call, oldest first; a hash stored again meanwhile is not among them (it
        is present). Blocks dropped by :meth:`remove` are the caller's own and not reported."""
        with self._lock:
            out = list(self._removed)
            self._removed.clear()
            return out

    def _release(self, slot: int) -> None:
        if slot in self._pins:
            self._dead.add(slot)
        else:
            heapq.heappush(self._free, slot)

    def _forget(self, block_hash: int, slot: int, *, report: bool = False) -> None:
        """Drop a bad or removed block: its magic is zeroed first, so no restart indexes it again.
        ``report``: it leaves unasked (bad bytes), so :meth:`take_removed` reports it."""
        if self._index.get(block_hash) != slot:
            return
        del self._index[block_hash]
        if report:
            self._note_removed(block_hash)
        k, i = divmod(slot, self._geometry)
        fd = self._segments.get(k)
        if fd is not None:
            try:
                os.pwrite(fd, b"\0" * 4, i * self.slot_bytes)
            except OSError:
                self._stats.errors += 1
        self._release(slot)

    # ---------------------------------------------------------------- lookups and maintenance

    def contains(self, block_hash: int) -> bool:
        """Whether the block is stored (its bytes are checked only when read)."""
        self._check_open()
        h = self._check_hash(block_hash)
        with self._lock:
            return h in self._index

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        """How many of the leading ``hashes`` are stored."""
        self._check_open()
        checked = [self._check_hash(h) for h in hashes]
        with self._lock:
            n = 0
            for h in checked:
                if h not in self._index:
                    break
                n += 1
            return n

    def holds(self, hashes: Sequence[int]) -> List[bool]:
        """Which of ``hashes`` are stored, each on its own (not a chain: a sliding group's
        window starts anywhere)."""
        self._check_open()
        checked = [self._check_hash(h) for h in hashes]
        with self._lock:
            return [h in self._index for h in checked]

    def remove(self, block_hash: int) -> bool:
        """Drop one block; ``True`` if it was stored."""
        self._check_open()
        h = self._check_hash(block_hash)
        with self._lock:
            slot = self._index.get(h)
            if slot is None:
                return False
            self._forget(h, slot)
            return True

    def stats(self) -> TierStats:
        """A snapshot of the counters, with the blocks held and the space they use."""
        with self._lock:
            blocks = len(self._index)
            return replace(
                self._stats,
                blocks=blocks,
                usage_bytes=blocks * self.slot_bytes,
                capacity_bytes=self.num_slots * self.slot_bytes,
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)
