"""The engine's side of the tiered prefix cache: the host tier's bytes, the disk and remote tiers.

The block manager (the Rust core) decides what lives where: which GPU blocks are written back to a
host slot when the pool evicts them (the step's swap-out list), which host slots are loaded into
device blocks on a hit (the swap-in list), and which host-cached blocks it drops to make room (its
*demotions*). The swap engine moves the bytes of the first two, as it does for preemption. This
module owns everything below the host tier:

- **Demotions.** Right after a step is built, before the runner applies its swap lists, the
  demoted host slots still hold their blocks; :meth:`TierCache.after_schedule` copies each one out
  (once the transfers that wrote it have landed) and hands it to the disk and remote stores, whose
  threads write it. The step's own swap-outs may then overwrite those slots.
- **Fetches.** Before a waiting request is admitted, :meth:`TierCache.ready` asks the manager how
  far its prompt's chain is cached on the GPU and the host, then asks the stores for the blocks
  that follow. If they hold some and loading them is cheaper than recomputing them, host slots
  are reserved (never findable, never evicted while reserved) and the stores' threads read the
  records into them; the request waits (``ready`` answers False) while the rest of the batch runs.
  When the reads finish the verified blocks are committed to the host index and the request is
  admitted; its admission then hits them as host blocks (loaded by the step's swap-in list). A read
  that fails or does not verify ends the run there: those blocks are recomputed.

Invariants: a reserved host slot is committed or released exactly once, and only after every read
into it has finished; no bytes reach a store unless they were read from a host slot after the
transfer that wrote it completed; the stores verify every record (hash, tokens, salt digest,
checksum, fingerprint) before its bytes are used, so a corrupt or foreign record is a miss.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

logger = logging.getLogger("pagedkv.engine")

__all__ = ["TierCache", "TierCacheStats", "build_tier_cache", "manager_tier_args"]


@dataclass
class TierCacheStats:
    """The engine's counters of the tiers below the host since it started (each store keeps
    its own :class:`pagedkv.tiers.TierStats` too)."""

    #: Prompt tokens served from each lower tier: blocks fetched into the host tier for a
    #: request, counted when it is admitted.
    fetched_tokens: Dict[str, int] = field(default_factory=lambda: {"disk": 0, "remote": 0})
    #: Bytes read from each lower tier into host slots.
    bytes_read: Dict[str, int] = field(default_factory=lambda: {"disk": 0, "remote": 0})
    #: Bytes handed to each lower tier (demoted host blocks).
    bytes_written: Dict[str, int] = field(default_factory=lambda: {"disk": 0, "remote": 0})
    #: Host blocks demoted (dropped from the host tier to make room).
    demotions: int = 0
    #: Fetches that failed or did not verify (their blocks were recomputed).
    failed_fetches: int = 0
    #: Fetches skipped because recomputing the blocks was modelled cheaper than loading them.
    skipped_fetches: int = 0
    #: Demoted blocks not written because the stores' write queue was full (they are lost, as
    #: an evicted block is without tiers; the step never waits for a store).
    dropped_writes: int = 0


@dataclass
class _Fetch:
    """One request's read of consecutive blocks from the lower tiers into reserved host slots."""

    slots: List[int]
    hashes: List[int]
    parents: List[Optional[int]]
    tokens: List[List[int]]
    salt_digest: int
    futures: List[Tuple[str, "Future[Any]"]]
    started: float


class TierCache:
    """The disk and remote tiers under the host tier of one engine (module docs).

    Args:
        manager: The block manager (built with ``host_cache=True``).
        host: The host pool's ``[num_host_blocks, bytes_per_block]`` uint8 view
            (:attr:`pagedkv.swap.HostKVPool.raw`).
        swap: The swap engine that moves blocks between the device pool and ``host`` (its events
            order reads of host slots after the transfers that wrote them).
        stores: ``(tier name, store)`` pairs, searched in order (``"disk"`` before ``"remote"``).
        block_size: Tokens per block.
        load_bytes_per_s: Rate of each lower tier for the load-versus-recompute choice.
        prefill_tokens_per_s: The engine's prefill rate (None: always load).
        threads: Reader/writer threads shared by the stores.
        max_pending_writes: Demoted blocks queued for the stores at most (each holds a copy of
            its bytes); beyond it a demotion is dropped and counted.
        events: A KV-event sink (:class:`pagedkv.events.EventSink`) told of every block a lower
            tier stores (``medium="STORAGE"``, ``locality`` ``"LOCAL"`` for the disk, ``"REMOTE"``
            for the shared store); None: no events.
    """

    def __init__(self, manager: Any, host: torch.Tensor, swap: Any,
                 stores: Sequence[Tuple[str, Any]], *, block_size: int,
                 load_bytes_per_s: Optional[Dict[str, float]] = None,
                 prefill_tokens_per_s: Optional[float] = None, threads: int = 2,
                 max_pending_writes: int = 64, events: Any = None) -> None:
        self.manager = manager
        self.host = host
        self.swap = swap
        self.stores = list(stores)
        self.block_size = block_size
        self.block_bytes = int(host.shape[1])
        self.load_bytes_per_s = dict(load_bytes_per_s or {})
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.stats = TierCacheStats()
        self._fetches: Dict[int, _Fetch] = {}
        #: Sequences whose prompt was probed and needs nothing from below (by seq id).
        self._probed: Dict[int, bool] = {}
        #: Per sequence, the tier each committed fetched block came from (until admitted).
        self._fetched_by_seq: Dict[int, List[str]] = {}
        #: The manager's host hits at the last admission (whose share was the fetched blocks').
        self._host_hits = 0
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pagedkv-tier")
        #: Writes to the stores in flight, each with the buffer holding its block's bytes.
        self._writes: List[Tuple["Future[Any]", np.ndarray]] = []
        #: Buffers of finished writes, reused: a copy into warm memory is several times faster
        #: than one into a fresh ``bytes`` (page faults), and it runs on the engine's thread.
        self._spare: List[np.ndarray] = []
        self.max_pending_writes = max_pending_writes
        self.events = events

    # ----------------------------------------------------------------------- figures

    def totals(self, bytes_per_block: int) -> Dict[str, Dict[str, Any]]:
        """Cumulative figures per tier since the engine started: ``hits`` (prompt tokens
        served: ``gpu``, ``host`` and each lower tier; a block fetched from below for a request
        counts for that tier), ``bytes_read`` (served from the tier), ``bytes_written`` (taken
        by it) and ``usage`` (bytes held now; None where unknown)."""
        s = self.manager.stats()
        lower = dict(self.stats.fetched_tokens)
        names = [name for name, _ in self.stores]
        hits = {"gpu": int(s.prefix_hit_tokens - s.host_hit_tokens),
                "host": int(s.host_hit_tokens - sum(lower.values()))}
        hits.update({n: lower.get(n, 0) for n in names})
        read = {"host": int(s.host_loaded_blocks) * bytes_per_block}
        read.update({n: self.stats.bytes_read.get(n, 0) for n in names})
        written = {"host": int(s.offloaded_blocks) * bytes_per_block}
        written.update({n: self.stats.bytes_written.get(n, 0) for n in names})
        usage: Dict[str, Optional[int]] = {"host": int(s.host_cached_blocks) * bytes_per_block}
        for name, store in self.stores:
            usage[name] = store.stats().usage_bytes
        return {"hits": hits, "bytes_read": read, "bytes_written": written, "usage": usage}

    # ----------------------------------------------------------------------- demotions

    def after_schedule(self) -> None:
        """Hands the blocks the manager demoted while building this step to the stores."""
        demoted = self.manager.take_demotions()
        if not demoted:
            return
        if not self.stores:
            # Nothing below the host tier: a demoted block is simply dropped (no copy, no wait).
            self.stats.demotions += len(demoted)
            return
        self._host_written()
        self._reap_writes()
        for slot, h, parent, salt, tokens in demoted:
            self.stats.demotions += 1
            if len(self._writes) >= self.max_pending_writes:
                self.stats.dropped_writes += 1
                continue
            # The slot is reused once this step's swap-outs run: its bytes are copied now.
            buf = self._spare.pop() if self._spare else np.empty(self.block_bytes, np.uint8)
            np.copyto(buf, self.host[slot].numpy())
            meta = _meta(h, parent, salt, tokens)
            self._writes.append((self._pool.submit(self._write, meta, buf), buf))

    def _reap_writes(self) -> None:
        """Returns the buffers of finished writes to the spares."""
        pending = []
        for f, buf in self._writes:
            if f.done():
                self._spare.append(buf)
            else:
                pending.append((f, buf))
        self._writes = pending

    def _write(self, meta: Any, data: np.ndarray) -> None:
        for name, store in self.stores:
            try:
                ok = store.put(meta, data)
            except Exception as exc:  # noqa: BLE001 - a store that cannot write is a miss later
                logger.debug("%s tier: write failed: %s", name, exc)
                continue
            if not ok:
                continue
            self.stats.bytes_written[name] += len(data)
            if self.events is not None:
                self.events.add_stored([meta.block_hash], meta.parent_hash, meta.token_ids,
                                       self.block_size, medium="STORAGE",
                                       locality="LOCAL" if name == "disk" else "REMOTE")

    def _read(self, store: Any, meta: Any, slot: int) -> bool:
        # Straight into the reserved slot: nobody else reads or writes it until it is committed.
        return bool(store.get_into(meta, self.host[slot].numpy()))

    def _host_written(self) -> None:
        """Blocks the host until the transfers queued so far have landed in host memory."""
        done = getattr(self.swap, "_out_done", None)
        if done is not None:
            done.synchronize()

    def _host_read(self) -> None:
        """Blocks until the queued host-to-device transfers have read their host slots."""
        done = getattr(self.swap, "_in_done", None)
        if done is not None:
            done.synchronize()

    # ----------------------------------------------------------------------- fetches

    def ready(self, seq: Any) -> bool:
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
        self._probed[key] = True
        return not self._start(seq)

    @property
    def num_fetching(self) -> int:
        """Requests waiting for their blocks from a lower tier."""
        return len(self._fetches)

    def wait(self, timeout_s: float = 0.05) -> None:
        """Blocks until some fetch finishes (or ``timeout_s``): what an engine with nothing else
        to run does instead of spinning."""
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_futures

        pending = [f for fetch in self._fetches.values() for _, f in fetch.futures if not f.done()]
        if pending:
            wait_futures(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def admitted(self, seq: Any, result: Any) -> None:
        """``seq`` was admitted. The blocks fetched for it that its admission hit (in the host
        tier, where they were put) count for the lower tiers they came from; a fetched block the
        host tier dropped again before the admission is not a hit."""
        names = self._fetched_by_seq.pop(seq.seq_id, None)
        self._probed.pop(seq.seq_id, None)
        if names:
            host_hits = int(self.manager.stats().host_hit_tokens)
            hit_blocks = (host_hits - self._host_hits) // self.block_size
            self._host_hits = host_hits
            for name in names[:max(0, hit_blocks)]:
                self.stats.fetched_tokens[name] += self.block_size
        elif self.stores:
            self._host_hits = int(self.manager.stats().host_hit_tokens)

    def forget(self, seq: Any) -> None:
        """Drops ``seq``'s state (it left unadmitted). A fetch still running is waited for and
        its slots released: a reserved slot is released only after its reads."""
        key = seq.seq_id
        self._probed.pop(key, None)
        self._fetched_by_seq.pop(key, None)
        fetch = self._fetches.pop(key, None)
        if fetch is not None:
            for _, f in fetch.futures:
                try:
                    f.result()
                except Exception:  # noqa: BLE001 - a failed read only means a miss here
                    pass
            self._commit(fetch, 0, len(fetch.slots), False)

    def _start(self, seq: Any) -> bool:
        """Starts reading ``seq``'s lower-tier blocks; True when a fetch is under way."""
        salt = getattr(seq, "cache_salt", None)
        gpu, host, rest, salt_digest, parent = self.manager.lookup_tiers(seq.token_ids,
                                                                         cache_salt=salt)
        if not rest:
            return False
        # The longest run the stores hold between them; each block is read from the first
        # store (the fastest) that has the run from there on.
        plan: List[Tuple[str, Any]] = []
        for name, store in self.stores:
            n = store.longest_prefix([int(h) for h in rest[len(plan):]])
            plan.extend([(name, store)] * n)
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
        self._host_written()
        self._host_read()
        first = gpu + host
        bs = self.block_size
        ids = seq.token_ids
        hashes = [int(h) for h in rest[:n]]
        parents: List[Optional[int]] = [None if parent is None else int(parent)] + hashes[:-1]
        tokens = [list(ids[(first + i) * bs:(first + i + 1) * bs]) for i in range(n)]
        futures = []
        for i, (name, store) in enumerate(plan):
            meta = _meta(hashes[i], parents[i], salt_digest, tokens[i])
            futures.append((name, self._pool.submit(self._read, store, meta, slots[i])))
        self._fetches[seq.seq_id] = _Fetch(slots, hashes, parents, tokens, int(salt_digest),
                                           futures, time.perf_counter())
        return True

    def _worth_loading(self, plan: List[Tuple[str, Any]]) -> bool:
        """Load versus recompute: reading the blocks at each tier's rate against prefilling
        their tokens at the engine's rate."""
        if not self.prefill_tokens_per_s:
            return True
        load_s = 0.0
        for name, _ in plan:
            rate = self.load_bytes_per_s.get(name)
            if rate:
                load_s += self.block_bytes / rate
        return load_s < len(plan) * self.block_size / self.prefill_tokens_per_s

    def _finish(self, key: int, fetch: _Fetch) -> None:
        del self._fetches[key]
        ok_run = 0
        for name, f in fetch.futures:
            try:
                good = bool(f.result())
            except Exception:  # noqa: BLE001
                good = False
            if not good:
                break
            ok_run += 1
            self.stats.bytes_read[name] += self.block_bytes
        if ok_run < len(fetch.slots):
            self.stats.failed_fetches += 1
        if ok_run:
            self._commit(fetch, 0, ok_run, True)
            self._fetched_by_seq[key] = [name for name, _ in fetch.futures[:ok_run]]
        if ok_run < len(fetch.slots):
            self._commit(fetch, ok_run, len(fetch.slots), False)

    def _commit(self, fetch: _Fetch, lo: int, hi: int, ok: bool) -> None:
        flat = [t for block in fetch.tokens[lo:hi] for t in block]
        self.manager.commit_host_blocks(fetch.slots[lo:hi], fetch.hashes[lo:hi],
                                        fetch.parents[lo:hi], fetch.salt_digest, flat, ok)

    def close(self) -> None:
        """Finishes every fetch (releasing its slots) and flushes and closes the stores."""
        for key in list(self._fetches):
            fetch = self._fetches.pop(key)
            for _, f in fetch.futures:
                try:
                    f.result()
                except Exception:  # noqa: BLE001
                    pass
            self._commit(fetch, 0, len(fetch.slots), False)
        for f, _ in self._writes:
            f.result()
        self._writes = []
        self._pool.shutdown(wait=True)
        for _, store in self.stores:
            close = getattr(store, "close", None)
            if close is not None:
                close()


def _meta(h: int, parent: Optional[int], salt: int, tokens: Sequence[int]) -> Any:
    from ..tiers import BlockMeta

    return BlockMeta(block_hash=int(h), parent_hash=None if parent is None else int(parent),
                     salt_digest=int(salt), token_ids=list(tokens))



def tier_fingerprint(model_path: str, spec: Any, *, tp_rank: int = 0, tp_size: int = 1) -> bytes:
    """The identity every lower-tier record carries: model, dtype, block size, layout, TP rank.
    A record whose fingerprint differs is foreign (a miss), so nothing crosses models."""
    from ..tiers import fingerprint_for_spec

    return fingerprint_for_spec(str(model_path), spec, tp_rank=tp_rank, tp_size=tp_size)


def build_stores(config: Any, fp: bytes, block_bytes: int) -> List[Tuple[str, Any]]:
    """The lower tiers ``config`` asks for, disk first; records authenticated under the tier
    secret (``tier_secret_file``, else ``PAGEDKV_TIER_SECRET``; the disk tier's own without one)."""
    from ..tiers.secret import secret_for_config

    stores: List[Tuple[str, Any]] = []
    secret = secret_for_config(config)
    if config.disk_cache_dir is not None:
        from ..tiers import DiskStore

        stores.append(("disk", DiskStore(config.disk_cache_dir, int(config.disk_cache_memory),
                                         fp, block_bytes, secret=secret)))
    if config.remote_cache_url is not None:
        from ..tiers import RemoteStore

        try:
            stores.append(("remote", RemoteStore(config.remote_cache_url, fp, block_bytes,
                                                 timeout_s=config.remote_cache_timeout_s,
                                                 secret=secret)))
        except BaseException:
            for _, store in stores:
                store.close()
            raise
    return stores


def manager_tier_args(config: Any) -> Dict[str, Any]:
    """The block manager's keywords for the tiers ``config`` asks for (the host tier's flags and
    the prefix-hash key: with a disk tier and no ``hash_seed``, the key kept in its directory so
    a restarted engine hashes as before)."""
    args: Dict[str, Any] = {}
    if config.host_cache_memory is not None:
        args["host_cache"] = True
        if config.host_cache_write_through:
            args["host_write_through"] = True
    seed = config.hash_seed
    if seed is None and config.disk_cache_dir is not None:
        from ..tiers import load_or_create_hash_key

        seed = load_or_create_hash_key(config.disk_cache_dir)
    if seed is not None:
        args["hash_seed"] = int(seed)
    return args


def build_tier_cache(config: Any, runner: Any, manager: Any, model_path: str,
                     prefill_tokens_per_s: Optional[float] = None,
                     events: Any = None) -> Optional[TierCache]:
    """The engine's :class:`TierCache` when ``config`` has a host tier (None otherwise)."""
    if config.host_cache_memory is None:
        return None
    swap = runner.swap
    spec = runner.spec
    tp = getattr(runner, "tp_rank", 0), config.tensor_parallel_size
    stores = build_stores(config, tier_fingerprint(model_path, spec, tp_rank=tp[0],
                                                   tp_size=tp[1]), spec.bytes_per_block)
    return TierCache(manager, swap.host.raw, swap, stores, block_size=spec.block_size,
                     prefill_tokens_per_s=prefill_tokens_per_s, events=events)
