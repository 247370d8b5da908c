"""The router's view of the fleet's caches: block hash -> {replica: tiers}.

Owns :class:`PrefixIndex`, built only from the replicas' KV events (``docs/kv-events.md``).
Invariants: a (hash, replica) entry exists exactly while that replica's last event about the hash
in some tier was ``BlockStored`` (``BlockRemoved`` without a medium, or ``AllBlocksCleared``,
drops every tier); :meth:`PrefixIndex.clear` forgets one replica and no other; every method
takes the one lock, so subscriber threads and the request path may call concurrently. The index
is a hint: a stale entry costs a cache miss on the chosen replica, never a wrong answer (the
replica verifies its own cache). It is bounded whatever a replica publishes: a hash outside
``[0, 2**128)`` (never a prompt's) is not kept, and a replica holds at most
``max_entries_per_replica`` (block, tier) entries; its stores past that are not indexed (counted in
:attr:`PrefixIndex.refused`) until removals make room.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, List, Optional, Sequence, Set

from ..events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WireHash,
    hash_from_wire,
)

__all__ = ["PrefixIndex", "DEFAULT_MAX_ENTRIES_PER_REPLICA"]

logger = logging.getLogger("pagedkv.router")

#: (block, tier) entries one replica may hold in the index (about 0.5 KiB each): room for a
#: replica's GPU, CPU and storage tiers, and a bound on what one that never removes can make the
#: router hold.
DEFAULT_MAX_ENTRIES_PER_REPLICA = 1 << 22
_HASH_LIMIT = 1 << 128


def _key(wire: WireHash) -> Optional[int]:
    """The index key of a wire hash; None for one no prompt hashes to (outside [0, 2**128))."""
    h = hash_from_wire(wire)
    return h if 0 <= h < _HASH_LIMIT else None


class PrefixIndex:
    """Which replica holds which block, in which tier (``"GPU"``, ``"CPU"``, ``"STORAGE"``)."""

    def __init__(self, max_entries_per_replica: int = DEFAULT_MAX_ENTRIES_PER_REPLICA) -> None:
        if (isinstance(max_entries_per_replica, bool) or not isinstance(max_entries_per_replica, int)
                or max_entries_per_replica < 1):
            from ..errors import InvalidArgumentError

            raise InvalidArgumentError(
                f"invalid argument: max_entries_per_replica = {max_entries_per_replica!r}: must be "
                f"an int >= 1", what="max_entries_per_replica", value=max_entries_per_replica,
                reason="must be an int >= 1")
        self.max_entries_per_replica = max_entries_per_replica
        self._where: Dict[int, Dict[int, Set[str]]] = {}
        self._held: Dict[int, Set[int]] = {}
        self._entries: Dict[int, int] = {}
        #: Per replica: stored (block, tier) entries not indexed because it was at the bound.
        self.refused: Dict[int, int] = {}
        self._lock = threading.Lock()

    def apply(self, replica: int, batch: KVEventBatch) -> None:
        """Applies one batch of ``replica``'s events, in order."""
        with self._lock:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    tier = event.medium or "GPU"
                    held = self._held.setdefault(replica, set())
                    for wire in event.block_hashes:
                        h = _key(wire)
                        if h is None:
                            continue
                        tiers = self._where.get(h, {}).get(replica)
                        if tiers is not None and tier in tiers:
                            continue
                        if self._entries.get(replica, 0) >= self.max_entries_per_replica:
                            self._refuse(replica)
                            continue
                        self._where.setdefault(h, {}).setdefault(replica, set()).add(tier)
                        held.add(h)
                        self._entries[replica] = self._entries.get(replica, 0) + 1
                elif isinstance(event, BlockRemoved):
                    for wire in event.block_hashes:
                        h = _key(wire)
                        if h is not None:
                            self._drop(replica, h, event.medium)
                elif isinstance(event, AllBlocksCleared):
                    self._clear(replica)

    def _drop(self, replica: int, h: int, tier: object) -> None:
        holders = self._where.get(h)
        tiers = holders.get(replica) if holders else None
        if tiers is None:
            return
        before = len(tiers)
        if tier is None:
            tiers.clear()
        else:
            # An empty medium names the tier apply() filed it under.
            tiers.discard(tier or "GPU")
        self._entries[replica] -= before - len(tiers)
        if not tiers:
            del holders[replica]  # type: ignore[union-attr]
            self._held[replica].discard(h)
            if not holders:
                del self._where[h]

    def clear(self, replica: int) -> None:
        """Forgets everything ``replica`` holds."""
        with self._lock:
            self._clear(replica)

    def _refuse(self, replica: int) -> None:
        refused = self.refused.get(replica, 0)
        if not refused:
            logger.warning("replica %d holds %d (block, tier) entries, the index's bound "
                           "max_entries_per_replica = %d: its further stored blocks are not "
                           "indexed until it removes some", replica, self._entries[replica],
                           self.max_entries_per_replica)
        self.refused[replica] = refused + 1

    def _clear(self, replica: int) -> None:
        self._entries.pop(replica, None)
        for h in self._held.pop(replica, set()):
            holders = self._where.get(h)
            if holders is not None:
                holders.pop(replica, None)
                if not holders:
                    del self._where[h]

    def blocks(self, replica: int) -> int:
        """Blocks ``replica`` holds in any tier."""
        with self._lock:
            return len(self._held.get(replica, ()))

    def tiers(self, replica: int, h: int) -> Set[str]:
        """The tiers ``replica`` holds block ``h`` in (empty: none)."""
        with self._lock:
            return set(self._where.get(h, {}).get(replica, ()))

    def match(self, hashes: Sequence[int]) -> Dict[int, int]:
        """For each replica holding ``hashes[0]``: how many leading blocks of ``hashes`` it holds
        (in any tier); replicas holding none are absent."""
        out: Dict[int, int] = {}
        with self._lock:
            alive: List[int] = []
            for i, h in enumerate(hashes):
                holders = self._where.get(h)
                if not holders:
                    break
                alive = list(holders) if i == 0 else [r for r in alive if r in holders]
                if not alive:
                    break
                for r in alive:
                    out[r] = i + 1
        return out
