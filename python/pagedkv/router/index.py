"""The router's view of the fleet's caches: block hash -> {replica: tiers}.

Owns :class:`PrefixIndex`, built only from the replicas' KV events (``docs/kv-events.md``).
Invariants: a (hash, replica) entry exists exactly while that replica's last event about the hash
in some tier was ``BlockStored`` (``BlockRemoved`` without a medium, or ``AllBlocksCleared``,
drops every tier); :meth:`PrefixIndex.clear` forgets one replica and no other; every method
takes the one lock, so subscriber threads and the request path may call concurrently. The index
is a hint: a stale entry costs a cache miss on the chosen replica, never a wrong answer (the
replica verifies its own cache).
"""

from __future__ import annotations

import threading
from typing import Dict, List, Sequence, Set

from ..events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, hash_from_wire

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """Which replica holds which block, in which tier (``"GPU"``, ``"CPU"``, ``"STORAGE"``)."""

    def __init__(self) -> None:
        self._where: Dict[int, Dict[int, Set[str]]] = {}
        self._held: Dict[int, Set[int]] = {}
        self._lock = threading.Lock()

    def apply(self, replica: int, batch: KVEventBatch) -> None:
        """Applies one batch of ``replica``'s events, in order."""
        with self._lock:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    tier = event.medium or "GPU"
                    held = self._held.setdefault(replica, set())
                    for wire in event.block_hashes:
                        h = hash_from_wire(wire)
                        self._where.setdefault(h, {}).setdefault(replica, set()).add(tier)
                        held.add(h)
                elif isinstance(event, BlockRemoved):
                    for wire in event.block_hashes:
                        self._drop(replica, hash_from_wire(wire), event.medium)
                elif isinstance(event, AllBlocksCleared):
                    self._clear(replica)

    def _drop(self, replica: int, h: int, tier: object) -> None:
        holders = self._where.get(h)
        tiers = holders.get(replica) if holders else None
        if tiers is None:
            return
        if tier is None:
            tiers.clear()
        else:
            tiers.discard(tier)  # type: ignore[arg-type]
        if not tiers:
            del holders[replica]  # type: ignore[union-attr]
            self._held[replica].discard(h)
            if not holders:
                del self._where[h]

    def clear(self, replica: int) -> None:
        """Forgets everything ``replica`` holds."""
        with self._lock:
            self._clear(replica)

    def _clear(self, replica: int) -> None:
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
