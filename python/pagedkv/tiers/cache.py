"""The tiered prefix cache below the host tier, as the engine drives it: demotions, fetches, figures.

The block manager (the Rust core) decides what lives where: which GPU blocks are written back to a
host slot when the pool evicts them (the step's swap-out list), which host slots are loaded into
device blocks on a hit (the swap-in list), and which host-cached blocks it drops to make room (its
*demotions*). The swap engine moves the bytes of the first two, as it does for preemption. This
module owns everything below the host tier:

- **Demotions.** Right after a step is built, before the runner applies its swap lists, the
  demoted host slots still hold their blocks; :meth:`TierCache.after_schedule` copies each one out
  (once the transfers that wrote it have landed) and hands it to the stores
  (:class:`~pagedkv.tiers.store.BlockStore`, built from the registry), whose threads write it.
  The step's own swap-outs may then overwrite those slots. The order is enforced: the swap engine
  asks :meth:`TierCache.check_drained` before every swap-out, which raises
  :class:`~pagedkv.errors.TierOrderError` when the manager still holds demotions (after saving
  them). ``after_schedule`` also drains each store's evictions (``take_removed``) and publishes
  them.
- **Fetches.** Before a waiting request is admitted, :meth:`TierCache.ready` asks the manager how
  far its prompt's chain is cached on the GPU and the host, then asks the stores for the blocks
  that follow. If they hold some and loading them is cheaper than recomputing them (each store's
  read rate is measured, an EWMA of its reads; see :meth:`TierCache._worth_loading`), host slots
  are reserved (never findable, never evicted while reserved) and the stores' threads read the
  records into them; the request waits (``ready`` answers False) while the rest of the batch runs.
  When the reads finish the verified blocks are committed to the host index and the request is
  admitted; its admission then hits them as host blocks (loaded by the step's swap-in list). A read
  that fails or does not verify ends the run there: those blocks are recomputed.

**KV cache groups.** With a model whose layers form several groups (full beside sliding or
chunked attention) every group's block is stored under its group's key
(:func:`group_key`: the chain hash mixed with the group, as the prefix cache keys it) and its
record names the group (:class:`~pagedkv.tiers.record.BlockMeta` ``group``, under the MAC), so a
block of one group is never served as another's. A demotion carries its group down. The fetch
follows the host tier's hit rule: for a boundary ``k`` (blocks), group 0 (full) needs its blocks
``[0, k)`` and every other group the blocks the first computed position ``k * B`` reads (a
sliding group the window ending there, a chunked group the current chunk). The cache asks the
manager which of those the device or the host tier hold (``lookup_tiers_groups``), asks each
store which of the others it holds (``holds``), takes the longest boundary every group then
completes (whose missing blocks fit the host tier), and reads only the missing blocks; each is
committed under its group's key on its own (a failed read is a miss of that block only: the
admission then finds the longest boundary that is complete). A model with one group takes the
one-chain path above, unchanged.

The probe never blocks the engine's thread (``ready`` runs while the scheduler builds a step: a
wait there would stall every running request's decode). When demotion writes are still carrying
some of the wanted blocks down (a prompt back right after its blocks were demoted), the probe is
*deferred*: ``ready`` answers False, the sequence counts in :attr:`TierCache.num_fetching` (so an
engine with nothing else to run waits for those writes in :meth:`TierCache.wait` rather than
taking its queue for stuck) and a later ``ready`` asks again. Once the writes are done (or
failed) the probe runs; if they are still running :data:`WRITE_WAIT_S` after the first deferral,
it runs without them (what a stuck store has not written is a miss: recomputed), so a slow or
stuck store delays only the requests that want its blocks, and those by a bounded time.

The admission gate (``ready`` / ``admitted`` / ``forget``) is the scheduler's
:class:`~pagedkv.scheduler.AdmissionGate`; an admission's ``cached_tokens_host`` tells how many of
the fetched blocks it hit. Nothing here imports :mod:`pagedkv.engine`: the engine is seen through
the protocols below.

Invariants: a reserved host slot is committed or released exactly once, and only after every read
into it has finished; the engine's thread never waits for a store's write; no bytes reach a
store unless they were read from a host slot after the transfer that wrote it completed; the
stores verify every record (hash, tokens, salt digest, checksum, fingerprint) before its bytes
are used, so a corrupt or foreign record is a miss.
"""


from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Protocol, Sequence, Tuple, Union

import numpy as np

from ..errors import InvalidArgumentError, InvalidConfigError, TierOrderError
from .disk import load_or_create_hash_key
from .fingerprint import fingerprint_for_spec
from .record import BlockMeta
from .store import BlockStore, build_stores

if TYPE_CHECKING:
    from ..config import CacheSpec
    from ..manager import AdmitResult, BlockManager
    from .host import SwapEngine

logger = logging.getLogger("pagedkv.tiers")

__all__ = ["TierCache", "TierCacheStats", "build_tier_cache", "manager_tier_args",
           "tier_fingerprint", "group_key", "LOAD_RATE_WEIGHT", "PROBE_AFTER_SKIPS",
           "WRITE_WAIT_S"]

#: Weight of the newest read in each store's measured read rate (an exponentially weighted mean).
LOAD_RATE_WEIGHT = 0.25
#: After this many fetches in a row skipped as slower than recomputing, the next one is loaded
#: anyway: a rate measured on a slow moment (a cold disk, a busy server) is measured again.
PROBE_AFTER_SKIPS = 16

_U128_MASK = (1 << 128) - 1
#: The per-group mix of the prefix cache's keys (the core's ``groups::group_hash``).
_GROUP_MIX = 0x9E3779B97F4A7C15F39CC0605CEDC835
#: Keys of stored blocks remembered with their (group, chain hash) for the removal events of a
#: model with several groups, at most (the oldest are forgotten: their removal is then announced
#: by key alone).
_MAX_KEY_GROUPS = 1 << 20
#: With KV cache groups, how long (seconds, monotonic, from its first deferral) a sequence's probe
#: is deferred at most while writes still carry blocks it asks for down to the stores (a prompt
#: arriving right after its blocks were demoted would otherwise miss them and recompute); after
#: that it probes without them. The engine's thread never waits for a write.
WRITE_WAIT_S = 1.0


def group_key(h: int, g: int) -> int:
    """The key group ``g``'s block of chain hash ``h`` is cached and stored under: ``h`` itself
    for group 0 (a model with one group keys exactly as without groups), ``h`` mixed with the
    group otherwise (a bijection per group, its own inverse), as the block manager keys it.

    Raises:
        InvalidArgumentError: ``h`` is not in ``[0, 2**128)`` or ``g`` is not an int >= 0.
    """
    if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= _U128_MASK:
        raise InvalidArgumentError(f"invalid argument: h = {h!r}: must be an int in [0, 2**128)",
                                   what="h", value=h, reason="not a u128")
    if isinstance(g, bool) or not isinstance(g, int) or g < 0:
        raise InvalidArgumentError(f"invalid argument: g = {g!r}: must be an int >= 0",
                                   what="g", value=g, reason="not a group index")
    return h if g == 0 else h ^ ((g * _GROUP_MIX) & _U128_MASK)


def _first_block(kind: str, size: int, k: int, bs: int) -> int:
    """The first block a query at position ``k * bs`` reads under a group of ``kind`` (window or
    chunk ``size``): the blocks before it are dead at boundary ``k``."""
    p = k * bs
    if kind == "sliding":
        return max(0, p + 1 - size) // bs
    if kind == "chunked":
        return p // size * size // bs
    return 0


class WaitingSeq(Protocol):
    """What the cache reads of a waiting sequence (:class:`pagedkv.scheduler.Sequence`)."""

    @property
    def seq_id(self) -> int: ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def cache_salt(self) -> Union[bytes, str, None]: ...


class StorageEvents(Protocol):
    """Where the lower tiers' KV events go (:class:`pagedkv.events.EventSink`)."""

    def add_stored(self, block_hashes: Sequence[int], parent_hash: Optional[int],
                   token_ids: Sequence[int], block_size: int, *, medium: str = ...,
                   locality: Optional[str] = ..., group_idx: Optional[int] = ...) -> None: ...

    def add_removed(self, block_hashes: Sequence[int], *, medium: str = ...,
                    locality: Optional[str] = ..., group_idx: Optional[int] = ...) -> None: ...


@dataclass
class TierCacheStats:
    """The engine's counters of the tiers below the host since it started, per store name (each
    store keeps its own :class:`pagedkv.tiers.TierStats` too)."""

    #: Prompt tokens served from each lower tier: blocks fetched into the host tier for a
    #: request, counted when its admission hits them.
    fetched_tokens: Dict[str, int] = field(default_factory=dict)
    #: Bytes read from each lower tier into host slots.
    bytes_read: Dict[str, int] = field(default_factory=dict)
    #: Bytes handed to each lower tier (demoted host blocks).
    bytes_written: Dict[str, int] = field(default_factory=dict)
    #: Blocks each lower tier reported evicted (``take_removed``), published as removed events.
    removed_blocks: Dict[str, int] = field(default_factory=dict)
    #: Host blocks demoted (dropped from the host tier to make room).
    demotions: int = 0
    #: Fetches that failed or did not verify (their blocks were recomputed).
    failed_fetches: int = 0
    #: Fetches not started because loading the blocks, at the stores' measured read rates, was
    #: slower than prefilling them.
    skipped_fetches: int = 0
    #: Demoted blocks not written because the stores' write queue was full (they are lost, as
    #: an evicted block is without tiers; the step never waits for a store).
    dropped_writes: int = 0


#: One read's outcome: whether the block verified, and the seconds the store took.
_ReadResult = Tuple[bool, float]


@dataclass
class _Fetch:
    """One request's read of consecutive blocks from the lower tiers into reserved host slots."""

    slots: List[int]
    hashes: List[int]
    parents: List[Optional[int]]
    tokens: List[List[int]]
    salt_digest: int
    #: The prompt's block index of the first fetched block (its GPU and host hits before it);
    #: with KV cache groups, the boundary the device and the host tier completed before.
    first: int
    futures: List[Tuple[BlockStore, "Future[_ReadResult]"]]
    #: With KV cache groups: each block's group (its ``hashes`` and ``parents`` are chain
    #: hashes), and per position from ``first`` to the fetch's boundary, the store credited with
    #: it. None on the one-group path.
    groups: Optional[List[int]] = None
    credit: Optional[List[str]] = None


@dataclass
class _Deferral:
    """A grouped probe put off while demotion writes carry some of the wanted blocks down."""

    #: ``time.monotonic()`` at the sequence's first deferral (the bound runs from there).
    since: float
    #: The writes it waits for (the last probe's; done or failed ones included).
    writes: List["Future[None]"]

    def left(self, now: float) -> float:
        """Seconds until :data:`WRITE_WAIT_S` has passed since the first deferral."""
        return self.since + WRITE_WAIT_S - now

    def due(self, now: float) -> bool:
        """Whether the probe runs now: every write finished, or :data:`WRITE_WAIT_S` passed."""
        return self.left(now) <= 0 or all(f.done() for f in self.writes)


class TierCache:
    """The lower tiers under the host tier of one engine (module docs).

    Args:
        manager: The block manager (built with ``host_cache=True``); the cache is the only caller
            of its ``take_demotions``.
        swap: The swap engine over the host pool (its ``host.raw`` is the ``[num_host_blocks,
            bytes_per_block]`` uint8 view the stores read and write); the cache registers
            :meth:`check_drained` with it.
        stores: The lower tiers, searched in order (fastest first); names unique.
        block_size: Tokens per block.
        load_bytes_per_s: Starting read rate of stores (by name) until one is measured.
        prefill_tokens_per_s: The engine's prefill rate (None: always load).
        threads: Reader/writer threads shared by the stores.
        max_pending_writes: Demoted blocks queued for the stores at most (each holds a copy of
            its bytes); beyond it a demotion is dropped and counted.
        events: A KV-event sink told of every block a lower tier stores or drops
            (``medium="STORAGE"``, ``locality`` the store's); None: no events.

    Raises:
        InvalidConfigError: Two stores share a name, or one is named ``gpu`` or ``host``.
    """

    def __init__(self, manager: "BlockManager", swap: "SwapEngine",
                 stores: Sequence[BlockStore], *, block_size: int,
                 load_bytes_per_s: Optional[Dict[str, float]] = None,
                 prefill_tokens_per_s: Optional[float] = None, threads: int = 2,
                 max_pending_writes: int = 64, events: Optional[StorageEvents] = None) -> None:
        self.manager = manager
        self.swap = swap
        self.host = swap.host.raw
        self.stores = list(stores)
        self.block_size = block_size
        self.block_bytes = int(self.host.shape[1])
        names = [s.name for s in self.stores]
        for i, name in enumerate(names):
            if name in names[:i] or name in ("gpu", "host"):
                raise InvalidConfigError(
                    f"tier store name {name!r} is taken (stores: {', '.join(names)}; gpu, host)",
                    field="name", value=name, reason="must be unique, not gpu or host")
        #: Each store's read rate, bytes/s: measured (an EWMA over its reads), else as given.
        self.load_bytes_per_s = {n: float(r) for n, r in (load_bytes_per_s or {}).items()}
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.threads = threads
        self.stats = TierCacheStats(
            fetched_tokens=dict.fromkeys(names, 0), bytes_read=dict.fromkeys(names, 0),
            bytes_written=dict.fromkeys(names, 0), removed_blocks=dict.fromkeys(names, 0))
        self._fetches: Dict[int, _Fetch] = {}
        #: Sequences whose prompt was probed and needs nothing from below (by seq id).
        self._probed: Dict[int, bool] = {}
        #: Per sequence, the first fetched block's index and the store of each committed fetched
        #: block (until admitted).
        self._fetched_by_seq: Dict[int, Tuple[int, List[str]]] = {}
        self._skips_in_row = 0
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pagedkv-tier")
        #: Writes to the stores in flight, each with the buffer holding its block's bytes.
        self._writes: List[Tuple["Future[None]", np.ndarray]] = []
        #: Buffers of finished writes, reused: a copy into warm memory is several times faster
        #: than one into a fresh ``bytes`` (page faults), and it runs on the engine's thread.
        self._spare: List[np.ndarray] = []
        self.max_pending_writes = max_pending_writes
        self.events = events
        #: The manager's KV cache groups (group ``g`` at index ``g``): more than one takes the
        #: grouped fetch (module docs).
        self.groups = tuple(manager.groups)
        self._grouped = len(self.groups) > 1
        #: Stored keys of a grouped model -> (group, chain hash), for their removal events.
        self._key_groups: Dict[int, Tuple[int, int]] = {}
        #: A grouped model's writes in flight by key (until reaped).
        self._writing: Dict[int, "Future[None]"] = {}
        #: Sequences whose grouped probe waits for writes still carrying their blocks down (by
        #: seq id; module docs).
        self._deferred: Dict[int, _Deferral] = {}
        swap.add_swap_out_check(self.check_drained)

    # ----------------------------------------------------------------------- figures

    def totals(self, bytes_per_block: int) -> Dict[str, Dict[str, Optional[int]]]:
        """Cumulative figures per tier since the engine started: ``hits`` (prompt tokens
        served: ``gpu``, ``host`` and each store by name; a block fetched from below for a
        request counts for that store), ``bytes_read`` (served from the tier), ``bytes_written``
        (taken by it) and ``usage`` (bytes held now; None where unknown)."""
        s = self.manager.stats()
        st = self.stats
        hits: Dict[str, Optional[int]] = {
            "gpu": int(s.prefix_hit_tokens - s.host_hit_tokens),
            "host": int(s.host_hit_tokens - sum(st.fetched_tokens.values()))}
        read: Dict[str, Optional[int]] = {"host": int(s.host_loaded_blocks) * bytes_per_block}
        written: Dict[str, Optional[int]] = {"host": int(s.offloaded_blocks) * bytes_per_block}
        usage: Dict[str, Optional[int]] = {"host": int(s.host_cached_blocks) * bytes_per_block}
        for store in self.stores:
            n = store.name
            hits[n] = st.fetched_tokens[n]
            read[n] = st.bytes_read[n]
            written[n] = st.bytes_written[n]
            usage[n] = store.stats().usage_bytes
        return {"hits": hits, "bytes_read": read, "bytes_written": written, "usage": usage}

    # ----------------------------------------------------------------------- demotions

    def after_schedule(self) -> None:
        """Hands the blocks the manager demoted while building this step to the stores, and
        publishes the blocks the stores evicted since the last step. Must run after every
        :meth:`pagedkv.scheduler.Scheduler.schedule` and before the step executes (the swap
        engine refuses a swap-out before it: :meth:`check_drained`)."""
        self._drain_removed()
        self._hand_down(self.manager.take_demotions_by_group())

    def check_drained(self) -> None:
        """Raises :class:`~pagedkv.errors.TierOrderError` when the manager holds demoted host
        blocks that :meth:`after_schedule` has not taken: a swap-out now would overwrite their
        slots before their bytes reach the stores. The swap engine calls it before every
        swap-out (one ``take_demotions`` call, well under a microsecond when there are none). The
        blocks it finds are handed to the stores before it raises (their slots still hold them:
        nothing is queued), so a broken order loses nothing but the step."""
        demoted = self.manager.take_demotions_by_group()
        if demoted:
            self._hand_down(demoted)
            raise TierOrderError(
                f"{len(demoted)} demoted host block(s) not copied out before a swap-out: call "
                "TierCache.after_schedule() between Scheduler.schedule() and the step's execution",
                pending=len(demoted), rule="after_schedule between schedule and execute")

    def _hand_down(self,
                   demoted: List[Tuple[int, int, Optional[int], int, List[int], int]]) -> None:
        """Copies demoted host blocks out of their slots for the stores' threads to write."""
        if not demoted:
            return
        self.stats.demotions += len(demoted)
        if not self.stores:
            return  # nothing below the host tier: a demoted block is dropped (no copy, no wait)
        self.swap.host_written()
        self._reap_writes()
        for slot, h, parent, salt, tokens, group in demoted:
            if len(self._writes) >= self.max_pending_writes:
                self.stats.dropped_writes += 1
                continue
            # The slot is reused once this step's swap-outs run: its bytes are copied now.
            buf = self._spare.pop() if self._spare else np.empty(self.block_bytes, np.uint8)
            np.copyto(buf, self.host[slot].numpy())
            meta = _meta(h, parent, salt, tokens, group)
            fut = self._pool.submit(self._write, meta, buf)
            self._writes.append((fut, buf))
            if self._grouped:
                self._writing[meta.block_hash] = fut

    def _drain_removed(self) -> None:
        for store in self.stores:
            removed = store.take_removed()
            if not removed:
                continue
            self.stats.removed_blocks[store.name] += len(removed)
            if self.events is None:
                continue
            if not self._grouped:
                self.events.add_removed([int(h) for h in removed], medium="STORAGE",
                                        locality=store.locality)
                continue
            for key in removed:
                g, h = self._key_groups.pop(int(key), (None, int(key)))
                self.events.add_removed([h], medium="STORAGE", locality=store.locality,
                                        group_idx=g)

    def _reap_writes(self) -> None:
        """Returns the buffers of finished writes to the spares."""
        pending = []
        for f, buf in self._writes:
            if f.done():
                self._spare.append(buf)
            else:
                pending.append((f, buf))
        self._writes = pending
        if self._writing:
            self._writing = {k: f for k, f in self._writing.items() if not f.done()}

    def _write(self, meta: BlockMeta, data: np.ndarray) -> None:
        for store in self.stores:
            try:
                ok = store.put(meta, data)
            except Exception as exc:  # noqa: BLE001 - a store that cannot write is a miss later
                logger.debug("%s tier: write failed: %s", store.name, exc)
                continue
            if not ok:
                continue
            self.stats.bytes_written[store.name] += len(data)
            if self.events is None:
                continue
            tokens = [int(t) for t in meta.token_ids]
            if not self._grouped:
                self.events.add_stored([meta.block_hash], meta.parent_hash, tokens,
                                       self.block_size, medium="STORAGE", locality=store.locality)
                continue
            # A grouped model's events name the chain hash and the group, as the host tier's.
            g = meta.group
            h = group_key(meta.block_hash, g)
            parent = None if meta.parent_hash is None else group_key(meta.parent_hash, g)
            self._remember_key(meta.block_hash, g, h)
            self.events.add_stored([h], parent, tokens, self.block_size, medium="STORAGE",
                                   locality=store.locality, group_idx=g)

    def _remember_key(self, key: int, g: int, h: int) -> None:
        """Notes a stored key's group and chain hash (for its removal event), bounded. Runs on
        the writer threads: dict operations are atomic under the GIL; a lost race only costs a
        removal event its group."""
        keys = self._key_groups
        keys[key] = (g, h)
        while len(keys) > _MAX_KEY_GROUPS:
            try:
                del keys[next(iter(keys))]
            except (StopIteration, KeyError, RuntimeError):
                break

    def _read(self, store: BlockStore, meta: BlockMeta, slot: int) -> _ReadResult:
        # Straight into the reserved slot: nobody else reads or writes it until it is committed.
        t0 = time.perf_counter()
        ok = bool(store.get_into(meta, self.host[slot].numpy()))
        return ok, time.perf_counter() - t0

    # ----------------------------------------------------------------------- fetches

    def ready(self, seq: WaitingSeq) -> bool:
        """Whether ``seq`` (a waiting sequence) may be admitted now: its lower-tier blocks, if
        any, are in host slots (or their fetch failed and they will be recomputed)."""
        key = seq.seq_id
        fetch = self._fetches.get(key)
        if fetch is not None:
            if not all(f.done() for _, f in fetch.futures):
                return False
            self._finish(key, fetch)
            return True
        if self._probed.get(key) or not self.stores:
            return True
        deferral = self._deferred.get(key)
        if deferral is not None and not deferral.due(time.monotonic()):
            return False  # its blocks are still being written: asked again on a later step
        started = self._start(seq)
        if started is None:
            return False  # deferred (module docs)
        self._deferred.pop(key, None)
        self._probed[key] = True
        return not started

    @property
    def num_fetching(self) -> int:
        """Requests waiting for their blocks from a lower tier: those whose reads are under way
        and those whose probe is deferred until writes carrying their blocks down finish."""
        return len(self._fetches) + len(self._deferred)

    def wait(self, timeout_s: float = 0.05) -> None:
        """Blocks until some fetch finishes, or some deferred probe's writes do (or its bound
        passes), or ``timeout_s``: what an engine with nothing else to run does instead of
        spinning. Returns at once when a deferred probe can run now."""
        pending = [f for fetch in self._fetches.values() for _, f in fetch.futures if not f.done()]
        if self._deferred:
            now = time.monotonic()
            for d in self._deferred.values():
                live = [f for f in d.writes if not f.done()]
                left = d.left(now)
                if not live or left <= 0:
                    return
                timeout_s = min(timeout_s, left)
                pending.extend(live)
        if pending:
            wait_futures(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def admitted(self, seq: WaitingSeq, result: "AdmitResult") -> None:
        """``seq`` was admitted with ``result``. The fetched blocks its admission hit as host
        blocks count for the stores they came from: those past the blocks cached before them, up
        to the admission's ``cached_tokens_host`` (a fetched block the host tier dropped again
        before the admission, or one after a dropped block, is not a hit)."""
        self._probed.pop(seq.seq_id, None)
        self._deferred.pop(seq.seq_id, None)
        got = self._fetched_by_seq.pop(seq.seq_id, None)
        if got is None:
            return
        first, names = got
        bs = self.block_size
        n = min(len(names), max(0, int(result.cached_tokens) // bs - first),
                int(result.cached_tokens_host) // bs)
        for name in names[:n]:
            self.stats.fetched_tokens[name] += bs

    def forget(self, seq: WaitingSeq) -> None:
        """Drops ``seq``'s state (it left unadmitted). A fetch still running is waited for and
        its slots released: a reserved slot is released only after its reads."""
        key = seq.seq_id
        self._probed.pop(key, None)
        self._deferred.pop(key, None)  # the writes it waited for go on: they are the stores'
        self._fetched_by_seq.pop(key, None)
        fetch = self._fetches.pop(key, None)
        if fetch is not None:
            _settle(fetch)
            self._commit(fetch, 0, len(fetch.slots), False)

    def _start(self, seq: WaitingSeq) -> Optional[bool]:
        """Starts reading ``seq``'s lower-tier blocks; True when a fetch is under way, None when
        the grouped probe is deferred (:meth:`_start_groups`)."""
        if self._grouped:
            return self._start_groups(seq)
        gpu, host, rest, salt_digest, parent = self.manager.lookup_tiers(
            seq.token_ids, cache_salt=seq.cache_salt)
        if not rest:
            return False
        # The longest run the stores hold between them; each block is read from the first
        # store (the fastest) that has the run from there on.
        plan: List[BlockStore] = []
        for store in self.stores:
            n = store.longest_prefix([int(h) for h in rest[len(plan):]])
            plan.extend([store] * n)
            if len(plan) == len(rest):
                break
        # A run longer than the host tier can take now is fetched in part: its head is what
        # an admission can use (a block after a gap in the chain is never a hit).
        n = min(len(plan), self.manager.host_blocks_available())
        plan = plan[:n]
        if n == 0:
            return False
        if not self._worth_loading(plan):
            self.stats.skipped_fetches += 1
            return False
        try:
            slots = self.manager.reserve_host_blocks(n)
        except Exception as exc:  # noqa: BLE001 - a full host pool only means recompute
            logger.debug("no host slots for %d fetched blocks: %s", n, exc)
            return False
        # Reserving may have demoted host blocks into these very slots: save them first, and
        # let every transfer still reading or writing a slot finish before the reads fill it.
        self.after_schedule()
        self.swap.host_written()
        self.swap.host_read()
        first = gpu + host
        bs = self.block_size
        ids = seq.token_ids
        hashes = [int(h) for h in rest[:n]]
        parents: List[Optional[int]] = [None if parent is None else int(parent)]
        parents.extend(hashes[:-1])
        tokens = [list(ids[(first + i) * bs:(first + i + 1) * bs]) for i in range(n)]
        futures = []
        for i, store in enumerate(plan):
            meta = _meta(hashes[i], parents[i], salt_digest, tokens[i])
            futures.append((store, self._pool.submit(self._read, store, meta, slots[i])))
        self._fetches[seq.seq_id] = _Fetch(slots, hashes, parents, tokens, int(salt_digest),
                                           first, futures)
        return True

    def _worth_loading(self, plan: Sequence[BlockStore], gain: Optional[int] = None) -> bool:
        """Load versus recompute: reading the blocks at each store's measured rate, spread over
        the reader threads, against prefilling their tokens at the engine's rate. A store not
        measured yet counts as free (its first reads measure it); after
        :data:`PROBE_AFTER_SKIPS` skipped fetches in a row the next one loads anyway. ``gain``:
        the blocks of prompt the fetch adds to the hit (``len(plan)`` when None; with KV cache
        groups a position may need several groups' blocks, or none of group 0's)."""
        if not self.prefill_tokens_per_s:
            return True
        load_s = 0.0
        for store in plan:
            rate = self.load_bytes_per_s.get(store.name)
            if rate:
                load_s += self.block_bytes / rate
        load_s /= max(1, min(self.threads, len(plan)))
        gain = len(plan) if gain is None else gain
        if load_s < gain * self.block_size / self.prefill_tokens_per_s:
            self._skips_in_row = 0
            return True
        self._skips_in_row += 1
        if self._skips_in_row > PROBE_AFTER_SKIPS:
            self._skips_in_row = 0
            return True
        return False

    def _measured(self, store: BlockStore, seconds: float) -> None:
        """Folds one verified read of ``seconds`` into ``store``'s read rate."""
        if seconds <= 0:
            return
        rate = self.block_bytes / seconds
        old = self.load_bytes_per_s.get(store.name)
        self.load_bytes_per_s[store.name] = rate if old is None else (
            old + LOAD_RATE_WEIGHT * (rate - old))

    def _settled(self, store: BlockStore, future: "Future[_ReadResult]") -> bool:
        """Whether one block's read (a done future of ``(verified, seconds)``) succeeded; its
        time feeds the store's measured load rate. A read that raised is a miss."""
        try:
            good, seconds = future.result()
        except Exception:  # noqa: BLE001 - a read that raised is a miss
            return False
        if good:
            self._measured(store, seconds)
        return bool(good)

    def _finish(self, key: int, fetch: _Fetch) -> None:
        del self._fetches[key]
        if fetch.groups is not None:
            self._finish_groups(key, fetch)
            return
        ok_run = 0
        broken = False
        for store, f in fetch.futures:
            good = self._settled(store, f)
            if not good:
                broken = True
            if broken:
                continue
            ok_run += 1
            self.stats.bytes_read[store.name] += self.block_bytes
        if ok_run < len(fetch.slots):
            self.stats.failed_fetches += 1
        if ok_run:
            self._commit(fetch, 0, ok_run, True)
            self._fetched_by_seq[key] = (fetch.first,
                                         [s.name for s, _ in fetch.futures[:ok_run]])
        if ok_run < len(fetch.slots):
            self._commit(fetch, ok_run, len(fetch.slots), False)

    def _commit(self, fetch: _Fetch, lo: int, hi: int, ok: bool) -> None:
        if fetch.groups is not None:
            self._commit_some(fetch, list(range(lo, hi)), ok)
            return
        flat = [t for block in fetch.tokens[lo:hi] for t in block]
        self.manager.commit_host_blocks(fetch.slots[lo:hi], fetch.hashes[lo:hi],
                                        fetch.parents[lo:hi], fetch.salt_digest, flat, ok)

    def _commit_some(self, fetch: _Fetch, which: List[int], ok: bool) -> None:
        """Commits the grouped fetch's blocks ``which`` (indices into it) under their groups."""
        if not which:
            return
        assert fetch.groups is not None
        flat = [t for i in which for t in fetch.tokens[i]]
        self.manager.commit_host_blocks(
            [fetch.slots[i] for i in which], [fetch.hashes[i] for i in which],
            [fetch.parents[i] for i in which], fetch.salt_digest, flat, ok,
            groups=[fetch.groups[i] for i in which])

    # ----------------------------------------------------------------------- KV cache groups

    def _boundaries(self, have: List[np.ndarray], n: int) -> np.ndarray:
        """``ok[k]`` for ``k`` in ``[0, n]``: whether every group has the blocks boundary ``k``
        needs among ``have[g]`` (a bool per block)."""
        bs = self.block_size
        ok = np.ones(n + 1, dtype=bool)
        for g, grp in enumerate(self.groups):
            miss = np.concatenate(([0], np.cumsum(~have[g])))
            lo = np.array([_first_block(grp.kind, grp.size, k, bs) for k in range(n + 1)])
            ok &= miss[np.arange(n + 1)] == miss[lo]
        return ok

    def _start_groups(self, seq: WaitingSeq) -> Optional[bool]:
        """The grouped fetch (module docs); True when one is under way, None when the probe is
        deferred: writes still carry some of the wanted blocks down (recorded in
        ``_deferred``, from the first deferral on, until :data:`WRITE_WAIT_S` has passed). Never
        waits."""
        hashes, salt_digest, present = self.manager.lookup_tiers_groups(
            seq.token_ids, cache_salt=seq.cache_salt)
        n = len(hashes)
        if n == 0:
            return False
        cached = [np.asarray(p, dtype=bool) for p in present]
        # Every block not cached above, asked of each store in turn (one question per store).
        source: Dict[Tuple[int, int], BlockStore] = {}
        want = [(g, i) for g in range(len(self.groups)) for i in range(n) if not cached[g][i]]
        # Blocks demoted a moment ago may still be on their way down: the probe is put off
        # until those writes finish (never waited for here), WRITE_WAIT_S at most.
        writing = self._writing
        inflight = [writing[k] for k in (group_key(int(hashes[i]), g) for g, i in want)
                    if k in writing and not writing[k].done()]
        if inflight:
            now = time.monotonic()
            deferral = self._deferred.get(seq.seq_id)
            if deferral is None:
                self._deferred[seq.seq_id] = _Deferral(now, inflight)
                return None
            if deferral.left(now) > 0:
                deferral.writes = inflight
                return None
            # Bound passed: probe without them (what they have not written is a miss; ``ready``
            # drops the deferral).
        for store in self.stores:
            if not want:
                break
            keys = [group_key(int(hashes[i]), g) for g, i in want]
            holds = getattr(store, "holds", None)
            # A backend without ``holds`` is asked one key at a time.
            held = holds(keys) if holds is not None else [
                store.longest_prefix([key]) == 1 for key in keys]
            rest = []
            for gi, got in zip(want, held):
                if got:
                    source[gi] = store
                else:
                    rest.append(gi)
            want = rest
        if not source:
            return False
        have = [c.copy() for c in cached]
        for g, i in source:
            have[g][i] = True
        before = np.flatnonzero(self._boundaries(cached, n))
        k_now = int(before[-1])
        complete = self._boundaries(have, n)
        # Blocks each boundary would load (those of its needed ranges not cached above).
        bs = self.block_size
        absent = [np.concatenate(([0], np.cumsum(~c))) for c in cached]
        budget = self.manager.host_blocks_available()
        k = n
        while k > k_now:
            if complete[k]:
                loads = sum(int(absent[g][k] - absent[g][_first_block(grp.kind, grp.size, k, bs)])
                            for g, grp in enumerate(self.groups))
                if 0 < loads <= budget:
                    break
            k -= 1
        if k <= k_now:
            return False
        need = [(g, i) for g, grp in enumerate(self.groups)
                for i in range(_first_block(grp.kind, grp.size, k, bs), k) if not cached[g][i]]
        plan = [source[gi] for gi in need]
        if not self._worth_loading(plan, gain=k - k_now):
            self.stats.skipped_fetches += 1
            return False
        try:
            slots = self.manager.reserve_host_blocks(len(need))
        except Exception as exc:  # noqa: BLE001 - a full host pool only means recompute
            logger.debug("no host slots for %d fetched blocks: %s", len(need), exc)
            return False
        self.after_schedule()
        self.swap.host_written()
        self.swap.host_read()
        ids = seq.token_ids
        chain = [int(h) for h in hashes]
        groups = [g for g, _ in need]
        blocks = [i for _, i in need]
        parents: List[Optional[int]] = [None if i == 0 else chain[i - 1] for i in blocks]
        tokens = [list(ids[i * bs:(i + 1) * bs]) for i in blocks]
        futures = []
        for j, (g, i) in enumerate(need):
            parent = parents[j]
            meta = _meta(group_key(chain[i], g), None if parent is None else group_key(parent, g),
                         int(salt_digest), tokens[j], g)
            futures.append((plan[j], self._pool.submit(self._read, plan[j], meta, slots[j])))
        # Each position the fetch adds is credited to the store of group 0's block there, else
        # to the store that supplied most of the fetch.
        counts: Dict[str, int] = {}
        for st in plan:
            counts[st.name] = counts.get(st.name, 0) + 1
        main = max(self.stores, key=lambda st: counts.get(st.name, 0)).name
        by_pos = {i: st.name for (g, i), st in zip(need, plan) if g == 0}
        credit = [by_pos.get(i, main) for i in range(k_now, k)]
        self._fetches[seq.seq_id] = _Fetch(slots, [chain[i] for i in blocks], parents, tokens,
                                           int(salt_digest), k_now, futures, groups, credit)
        return True

    def _finish_groups(self, key: int, fetch: _Fetch) -> None:
        """Commits each verified block of a grouped fetch under its group's key and releases the
        others (each block on its own: the admission takes the longest complete boundary)."""
        good_idx: List[int] = []
        bad_idx: List[int] = []
        for i, (store, f) in enumerate(fetch.futures):
            if self._settled(store, f):
                self.stats.bytes_read[store.name] += self.block_bytes
                good_idx.append(i)
            else:
                bad_idx.append(i)
        if bad_idx:
            self.stats.failed_fetches += 1
        self._commit_some(fetch, good_idx, True)
        self._commit_some(fetch, bad_idx, False)
        if good_idx and fetch.credit:
            self._fetched_by_seq[key] = (fetch.first, list(fetch.credit))

    def close(self) -> None:
        """Finishes every fetch (releasing its slots) and flushes and closes the stores."""
        self._deferred.clear()
        for key in list(self._fetches):
            fetch = self._fetches.pop(key)
            _settle(fetch)
            self._commit(fetch, 0, len(fetch.slots), False)
        for f, _ in self._writes:
            f.result()
        self._writes = []
        self._pool.shutdown(wait=True)
        for store in self.stores:
            store.close()


def _settle(fetch: _Fetch) -> None:
    """Waits for every read of ``fetch`` (a failed one only means a miss)."""
    for _, f in fetch.futures:
        try:
            f.result()
        except Exception:  # noqa: BLE001
            pass


def _meta(h: int, parent: Optional[int], salt: int, tokens: Sequence[int],
          group: int = 0) -> BlockMeta:
    return BlockMeta(block_hash=int(h), parent_hash=None if parent is None else int(parent),
                     salt_digest=int(salt), token_ids=np.asarray(tokens, dtype=np.uint32),
                     group=int(group))


# --------------------------------------------------------------------------- building one


class TierConfig(Protocol):
    """The settings the tiers read (:class:`pagedkv.engine.config.EngineConfig`); each backend's
    ``from_config`` reads its own besides."""

    @property
    def host_cache_memory(self) -> Union[int, str, None]: ...

    @property
    def host_cache_write_through(self) -> bool: ...

    @property
    def hash_seed(self) -> Optional[int]: ...

    @property
    def disk_cache_dir(self) -> Optional[str]: ...

    @property
    def tensor_parallel_size(self) -> int: ...


class TierRunner(Protocol):
    """What the tiers need of the model runner (:class:`pagedkv.engine.model_runner.ModelRunner`)."""

    @property
    def swap(self) -> Optional["SwapEngine"]: ...

    @property
    def spec(self) -> "CacheSpec": ...

    @property
    def tp_rank(self) -> int: ...


def tier_fingerprint(model_path: str, spec: "CacheSpec", *, tp_rank: int = 0,
                     tp_size: int = 1) -> bytes:
    """The identity every lower-tier record carries: model, dtype, block size, layout, TP rank.
    A record whose fingerprint differs is foreign (a miss), so nothing crosses models."""
    return fingerprint_for_spec(str(model_path), spec, tp_rank=tp_rank, tp_size=tp_size)


def manager_tier_args(config: TierConfig) -> Dict[str, Union[bool, int]]:
    """The block manager's keywords for the tiers ``config`` asks for (the host tier's flags and
    the prefix-hash key: with a disk tier and no ``hash_seed``, the key kept in its directory so
    a restarted engine hashes as before)."""
    args: Dict[str, Union[bool, int]] = {}
    if config.host_cache_memory is not None:
        args["host_cache"] = True
        if config.host_cache_write_through:
            args["host_write_through"] = True
    seed = config.hash_seed
    if seed is None and config.disk_cache_dir is not None:
        seed = load_or_create_hash_key(config.disk_cache_dir)
    if seed is not None:
        args["hash_seed"] = int(seed)
    return args


def build_tier_cache(config: TierConfig, runner: TierRunner, manager: "BlockManager",
                     model_path: str, prefill_tokens_per_s: Optional[float] = None,
                     events: Optional[StorageEvents] = None) -> Optional[TierCache]:
    """The engine's :class:`TierCache` when ``config`` has a host tier (None otherwise), over
    the stores the registry (:mod:`pagedkv.tiers.store`) builds from ``config``."""
    swap = runner.swap
    if config.host_cache_memory is None or swap is None:
        return None
    spec = runner.spec
    fp = tier_fingerprint(model_path, spec, tp_rank=runner.tp_rank,
                          tp_size=config.tensor_parallel_size)
    stores = build_stores(config, fp, spec.bytes_per_block)
    return TierCache(manager, swap, stores, block_size=spec.block_size,
                     prefill_tokens_per_s=prefill_tokens_per_s, events=events)
