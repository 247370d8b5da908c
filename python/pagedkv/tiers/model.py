"""A modelled disk tier for the simulator: the real admission path, no bytes.

Owns :class:`ModelledDiskTier`, an admission gate (:attr:`pagedkv.scheduler.Scheduler.
admission_gate`) for ``pagedkv simulate --disk-cache``. It keeps an LRU of the block hashes the
manager's host tier demotes (``take_demotions``), under a capacity in blocks, as a disk store
would hold them; before a waiting sequence is admitted it asks the manager how far the prompt's
chain is cached (``lookup_tiers``), finds how many of the following blocks the LRU holds, and
moves them into reserved host blocks at once (``reserve_host_blocks`` + ``commit_host_blocks``),
so the admission then hits them as host blocks — the same calls the engine's
:class:`~pagedkv.tiers.TierCache` makes, with the read taking no simulated steps.

It also models each admission's time to first token from what the prompt needed:
``uncached tokens / prefill rate + host-loaded bytes / host link + disk-loaded bytes / disk
rate`` (queueing excluded; the simulator counts queueing in steps).

Invariants: a hash is in the LRU at most once and the LRU never exceeds its capacity; every
reserved host block is committed in the same call that reserved it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

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


class ModelledDiskTier:
    """The simulator's disk tier and TTFT model (module docs).

    Args:
        manager: A block manager (built with ``host_cache=True`` when ``host_cache``).
        host_cache: The manager has a host tier (without one only TTFT is modelled).
        capacity_blocks: Blocks the modelled disk holds (0: no disk, the gate only models TTFT).
        block_bytes: KV bytes of one block (all layers).
        prefill_tokens_per_s, host_bytes_per_s, disk_bytes_per_s: The rates of the TTFT model.
    """

    def __init__(self, manager: "BlockManager", capacity_blocks: int, *, host_cache: bool = True,
                 block_size: int, block_bytes: int,
                 prefill_tokens_per_s: float, host_bytes_per_s: float,
                 disk_bytes_per_s: float) -> None:
        self.manager = manager
        self.capacity = int(capacity_blocks)
        self.host_cache = host_cache
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.rates = (prefill_tokens_per_s, host_bytes_per_s, disk_bytes_per_s)
        #: hash -> (parent hash, salt digest, token ids)
        self.lru: "OrderedDict[int, Tuple[Optional[int], int, List[int]]]" = OrderedDict()
        self.stats = TierModelStats()
        self._fetched: Dict[int, int] = {}

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
            self._fetched[seq.seq_id] = 0
            return True
        self.drain()
        found = self.manager.lookup_tiers(seq.token_ids, cache_salt=seq.cache_salt)
        rest, salt = found[2], found[3]
        n = 0
        while n < len(rest) and int(rest[n]) in self.lru:
            n += 1
        self._fetched[seq.seq_id] = n
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
            self._fetched[seq.seq_id] = 0
            return True
        self.drain()  # what reserving demoted
        self.manager.commit_host_blocks(slots, hashes, parents, salt,
                                        [t for block in toks for t in block], True)
        return True

    def forget(self, seq: WaitingSeq) -> None:
        self._fetched.pop(seq.seq_id, None)

    def admitted(self, seq: WaitingSeq, result: "AdmitResult") -> None:
        """Accounts one admission's hits by tier (the admission's own split of its cached
        tokens, the fetched blocks counted for the disk) and its modelled TTFT."""
        fetched_blocks = self._fetched.pop(seq.seq_id, 0)
        total = len(seq.token_ids)
        host = int(result.cached_tokens_host)
        gpu = int(result.cached_tokens_gpu)
        disk = min(host, fetched_blocks * self.block_size)
        host -= disk
        s = self.stats
        s.prompt_tokens += total
        s.hit_tokens["gpu"] += gpu
        s.hit_tokens["host"] += host
        s.hit_tokens["disk"] += disk
        prefill, link, disk_rate = self.rates
        bpt = self.block_bytes / self.block_size
        s.ttft_s.append((total - gpu - host - disk) / prefill + host * bpt / link
                        + disk * bpt / disk_rate)
