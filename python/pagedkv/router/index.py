"""The router's view of the fleet's caches: per replica, per tier, which blocks it holds.

Owns :class:`PrefixIndex`, built only from the replicas' KV events (``docs/kv-events.md``).

Layout (compact on purpose: ``benches/bench_router.py --index`` measures the bytes per entry):
per replica, one ``dict`` per tier (``"GPU"``, ``"CPU"``, ``"STORAGE"``, ...) mapping a block's
hash (an ``int``) to the epoch it was last stored in (one shared ``int`` object per epoch, so the
value costs a pointer). Each tier's dict is kept in last-seen order (a store of a block it holds
moves it to the end), so its oldest entries are its first.

Invariants:

* a (hash, replica, tier) entry exists while that replica's last event about the hash in that
  tier was ``BlockStored``, and it was stored less than the tier's TTL ago (``ttl_s``, for tiers
  whose removals the replica cannot report, such as a shared Redis tier); ``BlockRemoved``
  without a medium, or ``AllBlocksCleared``, drops every tier; :meth:`PrefixIndex.clear` forgets
  one replica and no other;
* only full-attention KV cache groups are indexed. An event without ``group_idx`` (a one-group
  replica) is; one with a group counts when that group is known to be full for the replica:
  learned from its ``BlockStored`` events' ``kv_cache_spec_kind`` (``"full_attention"`` or
  ``"mla_attention"``; a store without a kind keeps what an earlier one taught of its group,
  and a group never described is taken as full only if it is group 0, the group pagedkv's chain
  lives in). A sliding or chunked group's blocks never count as a prefix match
  (a hit needs the full groups' whole prefix; a window alone serves nothing), and a removal from
  such a group, or from a group not yet known, leaves the entry the full group announced. With
  several full groups an entry stands for the last such event of any of them. At most
  :data:`MAX_GROUPS_PER_REPLICA` groups are learned per replica;
* bounded whatever a replica publishes: a hash outside ``[0, 2**128)`` (never a prompt's) is not
  kept; a replica holds at most ``max_bytes_per_replica // ENTRY_BYTES`` (block, tier) entries and
  at most :data:`MAX_TIERS_PER_REPLICA` tiers. A store at the bound is always indexed: room is
  made by evicting the oldest entries of the lower tiers first (every tier but ``"GPU"``, the
  tier least recently stored first), and ``"GPU"`` entries only when no other is left, so lower
  tiers can never crowd out the blocks a replica holds on its devices (evictions are counted in
  :attr:`PrefixIndex.evicted`);
* a batch is applied in slices of :data:`APPLY_SLICE` hashes, the lock taken per slice and the GIL
  given up between slices: a request looking up the index (:meth:`PrefixIndex.match`) waits for
  one slice at most, never for a whole giant batch (a lookup may see a batch half applied; the
  index is a hint);
* every method takes the one lock, so subscriber threads and the request path may call
  concurrently. A stale entry costs a cache miss on the chosen replica, never a wrong answer
  (the replica verifies its own cache).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Set

from ..events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WireHash,
    hash_from_wire,
)

__all__ = ["PrefixIndex", "DEFAULT_MAX_BYTES_PER_REPLICA", "DEFAULT_TTL_S", "ENTRY_BYTES",
           "APPLY_SLICE", "MAX_TIERS_PER_REPLICA", "MAX_GROUPS_PER_REPLICA", "FULL_SPEC_KINDS"]

logger = logging.getLogger("pagedkv.router")

#: What one (block, tier) entry costs the router, as the bound counts it: a 128-bit ``int`` key
#: (48 B) and a dict slot at its usual load (~50 B), rounded up. ``bench_router.py --index``
#: measures the real figure with tracemalloc (``docs/performance.md``).
ENTRY_BYTES = 104
#: The default bound of one replica's entries: 256 MiB, about 2.6 million (block, tier) entries.
DEFAULT_MAX_BYTES_PER_REPLICA = 256 << 20
#: Default time-to-live by tier, in seconds, counted from the last ``BlockStored``: a shared
#: storage tier (Redis) cannot report the blocks it loses, so its entries age out; tiers absent
#: here (GPU, CPU: their removals are published) never expire.
DEFAULT_TTL_S: Mapping[str, float] = {"STORAGE": 600.0}
#: Hashes applied per lock hold.
APPLY_SLICE = 4096
#: Distinct tiers (media) one replica may have; events naming more are not indexed.
MAX_TIERS_PER_REPLICA = 8
#: KV cache groups whose kind one replica may teach the index; a group beyond is not indexed.
MAX_GROUPS_PER_REPLICA = 64
#: ``kv_cache_spec_kind`` values (vLLM's ``KVCacheSpecKind``) whose blocks the index follows:
#: every earlier position's KV is kept, so a block is a prefix match on its own.
FULL_SPEC_KINDS = frozenset({"full_attention", "mla_attention"})
_HASH_LIMIT = 1 << 128
_DEVICE_TIER = "GPU"


def _key(wire: WireHash) -> Optional[int]:
    """The index key of a wire hash; None for one no prompt hashes to (outside [0, 2**128))."""
    h = hash_from_wire(wire)
    return h if 0 <= h < _HASH_LIMIT else None


def _yield_between(start: int, total: int) -> None:
    """Between two slices of one event: lets the request path's threads run (gives the GIL up)
    before the next slice, so a lookup waits for one slice, not for the batch."""
    if start + APPLY_SLICE < total:
        time.sleep(0)


def _bad(what: str, value: object, reason: str) -> Exception:
    from ..errors import InvalidArgumentError

    return InvalidArgumentError(f"invalid argument: {what} = {value!r}: {reason}", what=what,
                                value=value, reason=reason)


class _Replica:
    """One replica's entries: tier -> {hash: last-seen epoch}, its counts, and what it taught
    the index of its KV cache groups (group -> full)."""

    __slots__ = ("tiers", "entries", "blocks", "expired_at", "groups")

    def __init__(self) -> None:
        self.tiers: Dict[str, Dict[int, int]] = {}
        self.entries = 0
        #: Distinct hashes over all tiers.
        self.blocks = 0
        self.expired_at = -1
        self.groups: Dict[int, bool] = {}

    def holds(self, h: int) -> bool:
        for entries in self.tiers.values():
            if h in entries:
                return True
        return False


class PrefixIndex:
    """Which replica holds which block, in which tier (``"GPU"``, ``"CPU"``, ``"STORAGE"``).

    Args:
        max_bytes_per_replica: The bound of one replica's entries, in bytes (counted as
            :data:`ENTRY_BYTES` per entry); at least one entry's worth.
        ttl_s: Time-to-live by tier name, in seconds since the entry was last stored (``None``
            or a missing tier: never expires). Default :data:`DEFAULT_TTL_S`.
        clock: Seconds, monotonic (tests pass their own).

    Raises:
        InvalidArgumentError: A bound below one entry, a TTL that is not a positive number.
    """

    def __init__(self, max_bytes_per_replica: int = DEFAULT_MAX_BYTES_PER_REPLICA, *,
                 ttl_s: Optional[Mapping[str, Optional[float]]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if (isinstance(max_bytes_per_replica, bool) or not isinstance(max_bytes_per_replica, int)
                or max_bytes_per_replica < ENTRY_BYTES):
            raise _bad("max_bytes_per_replica", max_bytes_per_replica,
                       f"must be an int >= {ENTRY_BYTES} (one entry)")
        ttls: Dict[str, float] = {}
        for tier, ttl in (DEFAULT_TTL_S if ttl_s is None else ttl_s).items():
            if ttl is None:
                continue
            if (isinstance(ttl, bool) or not isinstance(ttl, (int, float))
                    or not 0 < ttl < math.inf):
                raise _bad("ttl_s", {tier: ttl}, "a TTL must be a positive number of seconds")
            ttls[str(tier)] = float(ttl)
        self.max_bytes_per_replica = max_bytes_per_replica
        #: (block, tier) entries one replica may hold.
        self.max_entries_per_replica = max_bytes_per_replica // ENTRY_BYTES
        self.ttl_s: Dict[str, float] = ttls
        self._clock = clock
        self._replicas: Dict[int, _Replica] = {}
        self._epoch = self._epoch_now()
        #: Per replica: entries evicted to stay within the bound.
        self.evicted: Dict[int, int] = {}
        #: Per replica: entries dropped because their TTL passed.
        self.expired: Dict[int, int] = {}
        #: Per replica: stored entries not indexed because they named one tier (or KV cache
        #: group) too many.
        self.refused: Dict[int, int] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------- time

    def _epoch_now(self) -> int:
        """The current epoch (whole seconds), as one shared ``int`` object while it lasts."""
        e = int(self._clock())
        old = getattr(self, "_epoch", None)
        return old if old == e else e

    def _expire(self, replica: int, rep: _Replica) -> None:
        """Drops ``rep``'s entries past their tier's TTL (at most once per epoch)."""
        if rep.expired_at == self._epoch or not self.ttl_s:
            return
        rep.expired_at = self._epoch
        for tier, ttl in self.ttl_s.items():
            entries = rep.tiers.get(tier)
            if not entries:
                continue
            cutoff = self._epoch - ttl
            old: List[int] = []
            for h, seen in entries.items():  # last-seen order: stop at the first young one
                if seen > cutoff:
                    break
                old.append(h)
            if old:
                for h in old:
                    self._drop_one(rep, tier, h)
                self.expired[replica] = self.expired.get(replica, 0) + len(old)

    # ------------------------------------------------------------------------- updates

    def apply(self, replica: int, batch: KVEventBatch) -> None:
        """Applies one batch of ``replica``'s events, in order, :data:`APPLY_SLICE` hashes per
        lock hold."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.group_idx is not None:
                    with self._lock:
                        full = self._learn_group(replica, event)
                    if not full:
                        continue
                tier = event.medium or _DEVICE_TIER
                wires = event.block_hashes
                for start in range(0, len(wires), APPLY_SLICE):
                    keys = [k for k in map(_key, wires[start:start + APPLY_SLICE])
                            if k is not None]
                    with self._lock:
                        self._store(replica, tier, keys)
                    _yield_between(start, len(wires))
            elif isinstance(event, BlockRemoved):
                if event.group_idx is not None:
                    with self._lock:
                        rep = self._replicas.get(replica)
                        if rep is None or not rep.groups.get(event.group_idx, False):
                            continue
                wires = event.block_hashes
                for start in range(0, len(wires), APPLY_SLICE):
                    keys = [k for k in map(_key, wires[start:start + APPLY_SLICE])
                            if k is not None]
                    with self._lock:
                        self._remove(replica, event.medium, keys)
                    _yield_between(start, len(wires))
            elif isinstance(event, AllBlocksCleared):
                with self._lock:
                    self._clear(replica)

    def _learn_group(self, replica: int, event: BlockStored) -> bool:
        """Notes the kind of ``event``'s group for ``replica``; whether its blocks are indexed
        (a full-attention group, within :data:`MAX_GROUPS_PER_REPLICA`)."""
        g = event.group_idx
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            return False
        rep = self._replicas.get(replica)
        if rep is None:
            rep = self._replicas[replica] = _Replica()
        kind = event.kv_cache_spec_kind
        if kind is not None:
            full = kind in FULL_SPEC_KINDS
        else:  # what an earlier store said of the group, else group 0 only
            full = rep.groups.get(g, g == 0)
        if g not in rep.groups and len(rep.groups) >= MAX_GROUPS_PER_REPLICA:
            if not self.refused.get(replica):
                logger.warning("replica %d publishes more than %d KV cache groups (group %d is "
                               "one too many): its blocks in those are not indexed", replica,
                               MAX_GROUPS_PER_REPLICA, g)
            self.refused[replica] = self.refused.get(replica, 0) + len(event.block_hashes)
            return False
        rep.groups[g] = full
        return full

    def full_groups(self, replica: int) -> Set[int]:
        """The KV cache groups of ``replica`` the index follows (learned from its stores)."""
        with self._lock:
            rep = self._replicas.get(replica)
            return set() if rep is None else {g for g, full in rep.groups.items() if full}

    def _store(self, replica: int, tier: str, keys: List[int]) -> None:
        self._epoch = self._epoch_now()
        rep = self._replicas.get(replica)
        if rep is None:
            rep = self._replicas[replica] = _Replica()
        self._expire(replica, rep)
        entries = rep.tiers.get(tier)
        if entries is None:
            if len(rep.tiers) >= MAX_TIERS_PER_REPLICA:
                self._refuse(replica, tier, len(keys))
                return
            entries = rep.tiers[tier] = {}
        epoch = self._epoch
        cap = self.max_entries_per_replica
        for h in keys:
            if entries.pop(h, None) is not None:
                entries[h] = epoch  # seen again: the youngest now
                continue
            if rep.entries >= cap:
                self._evict(replica, rep, max(1, min(cap // 64, 4096)))
                if rep.tiers.get(tier) is not entries:  # the eviction emptied this tier
                    entries = rep.tiers[tier] = {}
            if not rep.holds(h):
                rep.blocks += 1
            entries[h] = epoch
            rep.entries += 1
        if not entries and rep.tiers.get(tier) is entries:
            del rep.tiers[tier]

    def _remove(self, replica: int, tier: Optional[str], keys: List[int]) -> None:
        rep = self._replicas.get(replica)
        if rep is None:
            return
        for h in keys:
            if tier is None:
                for name in list(rep.tiers):
                    self._drop_one(rep, name, h)
            else:
                # An empty medium names the tier apply() filed it under.
                self._drop_one(rep, tier or _DEVICE_TIER, h)

    def _drop_one(self, rep: _Replica, tier: str, h: int) -> bool:
        entries = rep.tiers.get(tier)
        if entries is None or entries.pop(h, None) is None:
            return False
        rep.entries -= 1
        if not entries:
            del rep.tiers[tier]
        if not rep.holds(h):
            rep.blocks -= 1
        return True

    def _evict(self, replica: int, rep: _Replica, n: int) -> None:
        """Evicts up to ``n`` entries: the lower tiers' oldest first (the tier whose oldest entry
        is the oldest first), the device tier's oldest last."""
        victims: List[tuple[str, int]] = []
        lower = sorted((next(iter(entries.values())), tier)
                       for tier, entries in rep.tiers.items() if tier != _DEVICE_TIER and entries)
        for _, tier in lower + [(0, _DEVICE_TIER)]:
            entries = rep.tiers.get(tier)
            if entries:
                victims.extend((tier, h) for h in itertools.islice(entries, n - len(victims)))
            if len(victims) >= n:
                break
        for tier, h in victims:
            self._drop_one(rep, tier, h)
        if not self.evicted.get(replica):
            logger.warning("replica %d reached the index's bound (max_bytes_per_replica = %d, "
                           "%d entries): its oldest lower-tier entries make room", replica,
                           self.max_bytes_per_replica, self.max_entries_per_replica)
        self.evicted[replica] = self.evicted.get(replica, 0) + len(victims)

    def _refuse(self, replica: int, tier: str, n: int) -> None:
        if not self.refused.get(replica):
            logger.warning("replica %d publishes more than %d tiers (%r is one too many): its "
                           "blocks in those are not indexed", replica, MAX_TIERS_PER_REPLICA,
                           tier[:64])
        self.refused[replica] = self.refused.get(replica, 0) + n

    def clear(self, replica: int) -> None:
        """Forgets everything ``replica`` holds."""
        with self._lock:
            self._clear(replica)

    def _clear(self, replica: int) -> None:
        self._replicas.pop(replica, None)

    # ------------------------------------------------------------------------- queries

    def _live(self, replica: int) -> Optional[_Replica]:
        rep = self._replicas.get(replica)
        if rep is not None:
            self._epoch = self._epoch_now()
            self._expire(replica, rep)
        return rep

    def blocks(self, replica: int) -> int:
        """Blocks ``replica`` holds in any tier."""
        with self._lock:
            rep = self._live(replica)
            return 0 if rep is None else rep.blocks

    def entries(self, replica: int) -> int:
        """(block, tier) entries of ``replica`` (what the bound counts)."""
        with self._lock:
            rep = self._live(replica)
            return 0 if rep is None else rep.entries

    def tiers(self, replica: int, h: int) -> Set[str]:
        """The tiers ``replica`` holds block ``h`` in (empty: none)."""
        with self._lock:
            rep = self._live(replica)
            if rep is None:
                return set()
            return {tier for tier, entries in rep.tiers.items() if h in entries}

    def match(self, hashes: Sequence[int]) -> Dict[int, int]:
        """For each replica holding ``hashes[0]``: how many leading blocks of ``hashes`` it holds
        (in any tier); replicas holding none are absent."""
        out: Dict[int, int] = {}
        with self._lock:
            for replica in list(self._replicas):
                rep = self._live(replica)
                if rep is None:
                    continue
                tiers = list(rep.tiers.values())
                n = 0
                for h in hashes:
                    for entries in tiers:
                        if h in entries:
                            break
                    else:
                        break
                    n += 1
                if n:
                    out[replica] = n
        return out
