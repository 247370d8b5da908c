"""A modelled disk tier for the simulator: the real admission path, no bytes.

Owns :class:`ModelledDiskTier`, an admission gate (:attr:`pagedkv.scheduler.Scheduler.
admission_gate`) for ``pagedkv simulate --disk-cache``. It keeps an LRU of the block hashes the
manager's host tier demotes (``take_demotions``), under a capacity in blocks, as a disk store
would hold them; before a waiting sequence is admitted it asks the manager how far the prompt's
chain is cached (``lookup_tiers``), finds how many of the following blocks the LRU holds, and
moves them into reserved host blocks at once (``reserve_host_blocks`` + ``commit_host_blocks``),
so the admission then hits them as host blocks — the same calls the engine's
:class:`~pagedkv.tiers.TierCache` makes, with the read taking no simulated steps. The disk is
modelled for a manager of one KV cache group only: the binding's demotions and reservations name
group 0's chain (as the engine, which refuses its disk tier with several groups).

It also models each admission's time to first token from what the prompt needed:
``uncached tokens / prefill rate + Σ_g host-loaded blocks of group g × its block bytes / host
link + Σ_g disk-loaded blocks of group g × its block bytes / disk rate`` (queueing excluded; the
simulator counts queueing in steps). The loaded blocks are the ones the manager actually queued:
the step built after the admission carries them on its swap-in list (:meth:`step_built`), each
mapped to its group through the admitted sequence's tables. With KV cache groups a hit loads
only the blocks missing from the device — a windowed group's last window, say, not its whole
history — and each group's block holds only that group's layers.

Invariants: a hash is in the LRU at most once and the LRU never exceeds its capacity; every
reserved host block is committed in the same call that reserved it; an admission's TTFT is
recorded once, when the step after it is built (:meth:`step_built`), or at :meth:`flush`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from ..errors import InvalidConfigError
from .cache import WaitingSeq

if TYPE_CHECKING:
    from ..manager import AdmitResult, BlockManager


@dataclass
class TierModelStats:
    """What the modelled tiers served."""

    #: Prompt tokens served per tier at admission (``"gpu"``, ``"host"``, ``"disk"``).
    hit_tokens: Dict[str, int] = field(default_factory=lambda: {"gpu": 0, "host": 0, "disk": 0})
    #: Prompt tokens admitted (the denominator of the hit ratios).
    prompt_tokens: int = 0
    #: Modelled TTFT of every admission, seconds (queueing excluded).
    ttft_s: List[float] = field(default_factory=list)
    demoted_blocks: int = 0
    disk_evictions: int = 0
    #: Blocks admissions loaded, per tier (``"host"``, ``"disk"``), one count per KV cache group.
    loaded_blocks: Dict[str, List[int]] = field(default_factory=dict)
    #: Bytes those loads moved, per tier (each group's blocks at its own size).
    loaded_bytes: Dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})


class _Admission:
    """One admission waiting for the step that carries its loads."""

    __slots__ = ("uncached", "fetched", "loads")

    def __init__(self, uncached: int, fetched: FrozenSet[int], num_groups: int) -> None:
        self.uncached = uncached
        self.fetched = fetched
        #: Blocks loaded per group: host tier, then disk (fetched into the host tier).
        self.loads = ([0] * num_groups, [0] * num_groups)


class ModelledDiskTier:
    """The simulator's disk tier and TTFT model (module docs).

    Args:
        manager: A block manager (built with ``host_cache=True`` when ``host_cache``).
        host_cache: The manager has a host tier (without one only TTFT is modelled).
        capacity_blocks: Blocks the modelled disk holds (0: no disk, the gate only models TTFT).
            Needs a manager of one KV cache group.
        block_bytes: KV bytes of one block (all layers), without groups.
        group_block_bytes: KV bytes one block of each of the manager's groups moves between
            tiers, group 0 first (default: ``(block_bytes,)``, one group).
        prefill_tokens_per_s, host_bytes_per_s, disk_bytes_per_s: The rates of the TTFT model.

    Raises:
        InvalidConfigError: ``group_block_bytes`` does not give one positive size per group, or
            a disk on a manager with several groups.
    """

    def __init__(self, manager: "BlockManager", capacity_blocks: int, *, host_cache: bool = True,
                 block_size: int, block_bytes: int,
                 prefill_tokens_per_s: float, host_bytes_per_s: float,
                 disk_bytes_per_s: float,
                 group_block_bytes: Optional[Sequence[int]] = None) -> None:
        num_groups = int(manager.num_groups)
        sizes = tuple(group_block_bytes) if group_block_bytes is not None else (block_bytes,)
        if len(sizes) != num_groups or any(isinstance(b, bool) or not isinstance(b, int)
                                           or b < 1 for b in sizes):
            raise InvalidConfigError(
                f"invalid tier model: group_block_bytes = {group_block_bytes!r}: must give one "
                f"size >= 1 per KV cache group ({num_groups})", field="group_block_bytes",
                value=group_block_bytes, reason=f"must have {num_groups} sizes >= 1")
        if capacity_blocks > 0 and num_groups > 1:
            raise InvalidConfigError(
                f"invalid tier model: capacity_blocks = {capacity_blocks}: the modelled disk "
                f"holds one KV cache group's chain, the manager has {num_groups} groups",
                field="capacity_blocks", value=capacity_blocks, reason="one group only")
        self.manager = manager
        self.capacity = int(capacity_blocks)
        self.host_cache = host_cache
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.group_block_bytes: Tuple[int, ...] = sizes
        self.rates = (prefill_tokens_per_s, host_bytes_per_s, disk_bytes_per_s)
        #: hash -> (parent hash, salt digest, token ids)
        self.lru: "OrderedDict[int, Tuple[Optional[int], int, List[int]]]" = OrderedDict()
        self.stats = TierModelStats()
        self.stats.loaded_blocks = {"host": [0] * num_groups, "disk": [0] * num_groups}
        #: seq_id -> host blocks filled from the modelled disk for its admission.
        self._fetched: Dict[int, List[int]] = {}
        #: Device block -> (the admission whose table holds it in its cached prefix, group), for
        #: the admissions of the step being built.
        self._blocks: Dict[int, Tuple[_Admission, int]] = {}
        self._pending: List[_Admission] = []

    def drain(self) -> None:
        """Takes the host tier's demotions into the modelled disk (LRU, capacity-bound)."""
        if not self.host_cache:
            return
        for _slot, h, parent, salt, tokens in self.manager.take_demotions():
            self.stats.demoted_blocks += 1
            if self.capacity <= 0:
                continue
            if h in self.lru:
                self.lru.move_to_end(h)
                continue
            self.lru[h] = (parent, salt, list(tokens))
            if len(self.lru) > self.capacity:
                self.lru.popitem(last=False)
                self.stats.disk_evictions += 1

    def ready(self, seq: WaitingSeq) -> bool:
        if seq.seq_id in self._fetched:
            return True
        if self.capacity <= 0:
            self._fetched[seq.seq_id] = []
            return True
        self.drain()
        found = self.manager.lookup_tiers(seq.token_ids, cache_salt=seq.cache_salt)
        rest, salt = found[2], found[3]
        n = 0
        while n < len(rest) and int(rest[n]) in self.lru:
            n += 1
        self._fetched[seq.seq_id] = []
        if n == 0:
            return True
        hashes = [int(h) for h in rest[:n]]
        parents = [self.lru[h][0] for h in hashes]
        toks = [self.lru[h][2] for h in hashes]
        for h in hashes:
            self.lru.move_to_end(h)
        try:
            slots = self.manager.reserve_host_blocks(n)
        except Exception:  # noqa: BLE001 - no room on the host: those blocks are recomputed
            return True
        self.drain()  # what reserving demoted
        self.manager.commit_host_blocks(slots, hashes, parents, salt,
                                        [t for block in toks for t in block], True)
        self._fetched[seq.seq_id] = list(slots)
        return True

    def forget(self, seq: WaitingSeq) -> None:
        self._fetched.pop(seq.seq_id, None)

    def admitted(self, seq: WaitingSeq, result: "AdmitResult") -> None:
        """Accounts one admission's hits by tier (the admission's own split of its cached
        tokens, the fetched blocks counted for the disk) and notes which of its blocks the next
        step may load, for its modelled TTFT (:meth:`step_built`)."""
        fetched = self._fetched.pop(seq.seq_id, [])
        total = len(seq.token_ids)
        host = int(result.cached_tokens_host)
        gpu = int(result.cached_tokens_gpu)
        disk = min(host, len(fetched) * self.block_size)
        host -= disk
        s = self.stats
        s.prompt_tokens += total
        s.hit_tokens["gpu"] += gpu
        s.hit_tokens["host"] += host
        s.hit_tokens["disk"] += disk
        groups = len(self.group_block_bytes)
        adm = _Admission(total - gpu - host - disk, frozenset(fetched), groups)
        self._pending.append(adm)
        if host + disk == 0:
            return  # nothing from the host tier: no load to find
        cached = int(result.cached_tokens) // self.block_size
        for g in range(groups):
            for b in self.manager.block_table(seq.seq_id, g)[:cached]:
                if b >= 0 and b not in self._blocks:
                    self._blocks[b] = (adm, g)

    def step_built(self, swap_in: Any) -> None:
        """Attributes the step's swap-in ``(host_block, device_block)`` pairs to the admissions
        made since the last call (a swapped-out sequence's return holds none of their blocks),
        by group and tier, and records each admission's modelled TTFT."""
        if self._blocks:
            for host_block, device_block in swap_in:
                hit = self._blocks.get(int(device_block))
                if hit is not None:
                    adm, g = hit
                    adm.loads[int(host_block) in adm.fetched][g] += 1
        self.flush()

    def flush(self) -> None:
        """Records the modelled TTFT of every admission not yet recorded, with the loads found."""
        s = self.stats
        prefill, link, disk_rate = self.rates
        sizes = self.group_block_bytes
        for adm in self._pending:
            moved = []
            for tier, loads in zip(("host", "disk"), adm.loads):
                nbytes = sum(n * b for n, b in zip(loads, sizes))
                per = s.loaded_blocks[tier]
                for g, n in enumerate(loads):
                    per[g] += n
                s.loaded_bytes[tier] += nbytes
                moved.append(nbytes)
            s.ttft_s.append(adm.uncached / prefill + moved[0] / link + moved[1] / disk_rate)
        self._pending.clear()
        self._blocks.clear()
