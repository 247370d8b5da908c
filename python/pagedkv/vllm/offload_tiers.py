"""pagedkv's disk and Redis stores as secondary tiers of vLLM's tiered offloading.

vLLM 0.33's ``TieringOffloadingSpec`` keeps a CPU primary tier (the host chunks the GPU copies
into) and cascades every chunk stored there to a list of *secondary tiers*; a chunk found in a
secondary tier is promoted back into a primary slot before the GPU loads it. A secondary tier is
a ``SecondaryTierManager`` that vLLM builds from ``{"type": <class>, "module_path": <module>,
...}`` in ``kv_connector_extra_config["secondary_tiers"]``, the other keys being constructor
keywords. This module provides two of them::

    {"type": "PagedKVDiskTier", "module_path": "pagedkv.vllm.offload_tiers",
     "path": "/var/cache/pagedkv-vllm", "capacity_bytes": 100000000000}
    {"type": "PagedKVRemoteTier", "module_path": "pagedkv.vllm.offload_tiers",
     "url": "redis://cache:6379/0"}

It owns :class:`PagedKVDiskTier` (over :class:`~pagedkv.tiers.disk.DiskStore`),
:class:`PagedKVRemoteTier` (over :class:`~pagedkv.tiers.remote.RemoteStore`), their common base
(:class:`_StoreTier`: the job pool, the results, the events) and :func:`layout_fingerprint` /
:func:`key_meta`, the identity and the per-chunk record metadata. The stores are pagedkv's own,
built through the backend registry (:func:`pagedkv.tiers.store.backend` and the backend's
``from_config``), not copies.

**What a record is.** One chunk of the primary view (``primary_kv_view[c]``,
``block_size_bytes`` bytes: every layer's and every rank's KV of ``blocks_per_chunk`` blocks) is
one pagedkv record. vLLM's ``OffloadKey`` (the block hash bytes, then the 4-byte group index) is
mapped onto the record's :class:`~pagedkv.tiers.record.BlockMeta` by :func:`key_meta`: a 256-bit
BLAKE2b digest of the whole key gives the record's ``block_hash`` (its first 128 bits: the index
key on disk, the Redis key) and its ``salt_digest`` (the other 128 bits), and the key's group is
the record's ``group``. All three are in the record's header, under its checksum and its MAC, and
a read verifies them: a record under a key's slot or Redis key that was written for another key
is refused. This interface carries **no token ids** (a ``SecondaryTierManager`` sees keys and
chunk ids only), so records carry none and a read cannot check the chunk's tokens the way
pagedkv's own engine does: the key (vLLM's chained block hash over the tokens and its extra keys)
stands for them. Two prompts whose vLLM block hashes collide would share a record; vLLM's
``sha256`` prefix-caching hash makes that out of reach, its ``xxhash`` options do not.

**Identity.** Every record carries the tier's fingerprint (:func:`layout_fingerprint`): the model
(its name, or the digest of its weights when the name is a local checkpoint, plus an optional
``model_revision``), the KV dtype, tokens per hash, blocks per chunk, every KV cache group (tokens
per block, layer names, sliding window), the bytes per block and per chunk, the parallel layout
(world, TP, PP, PCP and DCP sizes, replicated and canonical layouts) and the record format. Two
engines whose fingerprints differ never serve each other's chunks from one directory or one
Redis: on Redis the fingerprint is in the key itself, on disk a record of another fingerprint is
refused when read (``foreign``); either way it is a miss.

**Trust.** As for pagedkv's own tiers (``docs/tiers.md``): every record is authenticated with an
HMAC-SHA256 under the tier secret (``tier_secret_file``, else ``PAGEDKV_TIER_SECRET``; the disk
tier without either keeps its own key in its directory; the Redis tier without either refuses to
start with :class:`~pagedkv.errors.TierSecretError`). A value another party wrote into the
directory or the server, or a real record moved under another key, fails its MAC or its key check
and is a failed key, never bytes in a primary slot. The disk directory must be the engine user's
own (0700, no links: :class:`~pagedkv.errors.UnsafePathError`).

**Threads.** Every read and write runs on the tier's own worker threads (``threads``, default 2)
behind a bounded queue (``max_queued_jobs``): ``submit_store`` / ``submit_load`` only enqueue, and
a job that finds the queue full fails at once (reported by the next ``get_finished_jobs``), never
blocking the scheduler. The disk tier answers ``lookup`` from its in-memory index on the caller's
thread (a dictionary look-up under the store's index lock, which is never held across I/O).
The Redis tier never touches the network from ``lookup``: an unknown key answers ``RETRY`` and
joins the step's probe, sent at ``on_schedule_end`` to a probe thread as one pipelined
``EXISTS``; the answer is read at least once and kept ``lookup_cache_s`` seconds (stores and
failed loads update it).

**Invariants.** A promotion's key is in ``successful_keys`` only when its record verified and its
payload is in the slot; a slot whose read failed is zeroed before its job is reported, so an
unverified byte never stays in the primary tier. A key whose load failed is a miss (no promotion
livelock on a record that keeps failing): on disk until it is stored again, on Redis for
``lookup_cache_s`` (the store deleted a value that did not verify; a timeout may pass); a
promotion the full queue refused is not held against its keys. A store failure (the store
refused a chunk, an I/O or server error, a full queue) is a failed cascade job. ``drain_jobs``
returns only when no job is queued or running. Bad options raise
:class:`~pagedkv.errors.InvalidConfigError` naming the option and its value, before anything is
opened.

Importing this module imports vLLM and checks its version like :mod:`pagedkv.vllm.offload`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Optional, Tuple

import numpy as np
import xxhash

from pagedkv.errors import InvalidArgumentError, InvalidConfigError
# Imports vLLM and refuses any release but the one tested (MissingDependencyError).
from pagedkv.vllm.offload import TESTED_VLLM_RELEASE

from vllm.v1.kv_offload.base import (  # noqa: E402
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.base import (  # noqa: E402
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from pagedkv.tiers.fingerprint import model_identity  # noqa: E402
from pagedkv.tiers.record import FORMAT_VERSION, BlockMeta  # noqa: E402
from pagedkv.tiers.store import BlockStore, backend  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = [
    "TESTED_VLLM_RELEASE",
    "PagedKVDiskTier",
    "PagedKVRemoteTier",
    "key_hash",
    "key_meta",
    "layout_fingerprint",
]

_log = logging.getLogger("pagedkv")

_FP_DOMAIN = b"pagedkv.vllm.offload_tiers.fingerprint\x00"
_KEY_PERSON = b"pagedkv-vllm-key"  # BLAKE2b personalisation (16 bytes)
#: Version of the key -> record mapping below; part of every fingerprint.
KEY_SCHEME = 1
_NO_TOKENS = np.zeros(0, dtype="<u4")
_NO_TOKENS.setflags(write=False)
#: Keys whose failed load is remembered (a miss until stored again), at most.
_REFUSED_CAP = 65536


# ------------------------------------------------------------------------------------ identity


def _digest(key: bytes) -> bytes:
    """The 256-bit BLAKE2b of a whole ``OffloadKey`` (hash bytes and group)."""
    return hashlib.blake2b(bytes(key), digest_size=32, person=_KEY_PERSON).digest()


def key_hash(key: bytes) -> int:
    """The store key of ``key``: the first 128 bits of its digest (the record's ``block_hash``)."""
    return int.from_bytes(_digest(key)[:16], "little")


def key_meta(key: bytes) -> BlockMeta:
    """The record metadata of vLLM's ``OffloadKey`` ``key`` (module docs): ``block_hash`` and
    ``salt_digest`` the two halves of a 256-bit BLAKE2b of the whole key, ``group`` its group
    index, no token ids."""
    digest = _digest(key)
    return BlockMeta(
        block_hash=int.from_bytes(digest[:16], "little"),
        parent_hash=None,
        salt_digest=int.from_bytes(digest[16:], "little"),
        token_ids=_NO_TOKENS,
        group=get_offload_group_idx(OffloadKey(bytes(key))),
    )


def _model_name(name: str) -> str:
    """The model's identity: the digest of its weights when ``name`` is a local checkpoint."""
    if name and os.path.exists(name):
        return model_identity(name)
    return name


def layout_fingerprint(spec: "OffloadingSpec", chunk_bytes: int, model_revision: str = "") -> bytes:
    """The 16-byte identity of the chunks ``spec`` offloads (module docs): what namespaces a
    directory or a Redis server shared by engines. A pure function of the spec's configuration
    (stable across processes and machines)."""
    cfg = spec.config
    par = cfg.parallel
    fields: Dict[str, Any] = {
        "format": FORMAT_VERSION,
        "key_scheme": KEY_SCHEME,
        "model": _model_name(str(cfg.model.name)),
        "model_revision": model_revision,
        "dtype": str(cfg.model.dtype),
        "tokens_per_hash": int(cfg.cache.tokens_per_hash),
        "blocks_per_chunk": int(cfg.cache.blocks_per_chunk),
        "groups": [
            [int(g.tokens_per_block), list(g.layer_names), int(g.group_id),
             g.sliding_window_size_in_chunks]
            for g in cfg.groups
        ],
        "worker_kv_bytes_per_block": int(cfg.worker_kv_bytes_per_block),
        "chunk_bytes": int(chunk_bytes),
        "world_size": int(par.world_size),
        "tp_size": int(par.tp_size),
        "pp_size": int(par.pp_size),
        "pcp_size": int(par.pcp_size),
        "dcp_size": int(par.dcp_size),
        "replicated_layout": bool(cfg.replicated_layout),
        "canonical_layout": bool(cfg.canonical_layout),
        "kv_cache_layout": cfg.kv_cache_layout,
    }
    body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return xxhash.xxh3_128_digest(_FP_DOMAIN + body)


# ------------------------------------------------------------------------------------ options


def _bad(field: str, value: Any, reason: str, tier: str) -> InvalidConfigError:
    return InvalidConfigError(
        f"{tier} option {field!r} {reason}, got {value!r}", field=field, value=value, reason=reason)


def _int_option(tier: str, field: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(field, value, f"must be an integer >= {minimum}", tier)
    return value


def _seconds_option(tier: str, field: str, value: Any, *, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise _bad(field, value, "must be a number of seconds " + (">= 0" if allow_zero else "> 0"),
                   tier)
    return float(value)


def _str_option(tier: str, field: str, value: Any, *, optional: bool = False) -> Optional[str]:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise _bad(field, value, "must be a non-empty string", tier)
    return value


def _locality_option(tier: str, value: Any, default: Locality) -> Locality:
    if value is None:
        return default
    try:
        return Locality(value)
    except ValueError:
        raise _bad("locality", value, "must be 'LOCAL' or 'REMOTE'", tier) from None


def _no_unknown(tier: str, unknown: Dict[str, Any]) -> None:
    if unknown:
        name = sorted(unknown)[0]
        raise _bad(name, unknown[name], "is not an option of this tier", tier)


# ------------------------------------------------------------------------------------ the jobs


@dataclass
class _Job:
    """One submitted job: its keys, their primary chunk ids and (made by the workers) their record
    metas, split into parts."""

    job_id: int
    keys: List[OffloadKey]
    metas: List[Optional[BlockMeta]]
    chunks: List[int]
    is_load: bool
    parts_left: int
    ok: List[bool]
    started: float
    bytes_moved: int = 0
    #: Keys whose part found the queue full (failed without being tried).
    rejected: int = 0


class _StoreTier(SecondaryTierManager):
    """A secondary tier over one pagedkv :class:`~pagedkv.tiers.store.BlockStore` (module docs).

    Subclasses build the store and answer ``lookup``; this class runs the jobs (a pool of
    ``threads`` workers behind a queue of at most ``max_queued_jobs`` parts), reports them and
    keeps the events."""

    medium: ClassVar[Medium] = Medium.STORAGE
    _label: ClassVar[str] = "tier"

    def __init__(
        self,
        offloading_spec: "OffloadingSpec",
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: "Optional[BackpressureDetector]",
        *,
        threads: Any,
        max_queued_jobs: Any,
        enable_kv_events: Any,
        locality: Locality,
        model_revision: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        tier = self._label
        self._threads = _int_option(tier, "threads", threads, 1)
        self._max_queued = _int_option(tier, "max_queued_jobs", max_queued_jobs, 1)
        if not isinstance(enable_kv_events, bool):
            raise _bad("enable_kv_events", enable_kv_events, "must be true or false", tier)
        if model_revision is not None:
            model_revision = _str_option(tier, "model_revision", model_revision)
        self.locality = locality
        self._view = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 or \
            primary_kv_view.format != "B" else primary_kv_view
        self._chunk_bytes = self.block_size_bytes
        self._zeros = bytes(self._chunk_bytes)
        self._num_chunks = self._view.nbytes // self._chunk_bytes
        #: The identity every record of this tier carries.
        self.fingerprint = layout_fingerprint(offloading_spec, self._chunk_bytes,
                                              model_revision or "")
        self._events: Optional[List[OffloadingEvent]] = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                _log.warning("%s: enable_kv_events is set but KV cache events are off in vLLM; "
                             "the tier emits none", tier)
        self._store: Optional[BlockStore] = None
        #: Whether stored keys are remembered by hash (the store reports evictions, events on).
        self._track_removals = False
        # Scheduler-thread state.
        self._jobs: Dict[int, _Job] = {}
        self._refused: "OrderedDict[OffloadKey, None]" = OrderedDict()
        #: block hash -> key, for the keys this tier stored (to report the store's evictions).
        self._key_of: Dict[int, OffloadKey] = {}
        # Shared with the workers.
        self._tasks: "queue.Queue[Optional[Tuple[_Job, int, int]]]" = queue.Queue(self._max_queued)
        self._done: "queue.SimpleQueue[_Job]" = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._in_flight = 0
        self._workers: List[threading.Thread] = []
        self._shut = False

    def _start(self, store: BlockStore) -> None:
        """Adopt the built store (its payload size must be a chunk's) and start the workers."""
        if store.block_bytes != self._chunk_bytes:
            store.close()
            raise _bad("block_bytes", store.block_bytes, f"must be {self._chunk_bytes}",
                       self._label)
        self._store = store
        for i in range(self._threads):
            t = threading.Thread(target=self._work, name=f"pagedkv-{self.tier_type}-{i}",
                                 daemon=True)
            t.start()
            self._workers.append(t)

    @property
    def store(self) -> BlockStore:
        """The pagedkv store under this tier."""
        assert self._store is not None
        return self._store

    # ------------------------------------------------------------------ the workers

    def _slot(self, chunk: int) -> memoryview:
        start = chunk * self._chunk_bytes
        return self._view[start : start + self._chunk_bytes]

    def _zero(self, slot: memoryview) -> None:
        """Clears a primary slot whose promotion failed: no unverified byte stays in it."""
        slot[:] = self._zeros

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            job, lo, hi = task
            moved = 0
            for i in range(lo, hi):
                slot = self._slot(job.chunks[i])
                try:
                    meta = job.metas[i] = key_meta(job.keys[i])
                    if job.is_load:
                        ok = self.store.get_into(meta, slot)
                        if not ok:
                            self._zero(slot)
                    else:
                        ok = self.store.put(meta, slot)
                except Exception:  # noqa: BLE001 - a failing store is a failed key, never a crash
                    _log.warning("%s: %s of one chunk raised; counted as failed", self.tier_type,
                                 "load" if job.is_load else "store", exc_info=True)
                    ok = False
                    if job.is_load:
                        self._zero(slot)
                job.ok[i] = ok
                if ok:
                    moved += self._chunk_bytes
            self._part_done(job, moved)

    def _part_done(self, job: _Job, moved: int) -> None:
        with self._idle:
            job.bytes_moved += moved
            job.parts_left -= 1
            last = job.parts_left == 0
        if last:
            self._done.put(job)
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def _submit(self, meta: TransferJob, is_load: bool) -> None:
        keys = [OffloadKey(bytes(k)) for k in meta.keys]
        chunks = [int(c) for c in np.asarray(meta.chunk_ids).reshape(-1)]
        if len(keys) != len(chunks):
            raise InvalidArgumentError(
                f"job {meta.job_id} names {len(chunks)} chunks for {len(keys)} keys",
                what="chunk_ids", value=len(chunks), reason=f"must be {len(keys)}")
        bad = [c for c in chunks if not 0 <= c < self._num_chunks]
        if bad:
            raise InvalidArgumentError(
                f"job {meta.job_id} names chunk {bad[0]}, outside [0, {self._num_chunks})",
                what="chunk_ids", value=bad[0], reason=f"must be in [0, {self._num_chunks})")
        n = len(keys)
        parts = max(1, min(self._threads, n))
        job = _Job(meta.job_id, keys, [None] * n, chunks, is_load, parts, [False] * n,
                   time.monotonic())
        self._jobs[job.job_id] = job
        with self._idle:
            self._in_flight += 1
        bounds = [n * p // parts for p in range(parts + 1)]
        for p in range(parts):
            try:
                if self._shut:  # no worker is left to take it
                    raise queue.Full
                self._tasks.put_nowait((job, bounds[p], bounds[p + 1]))
            except queue.Full:
                # Queue full (or shut down): this part fails at once (its keys stay False),
                # without blocking.
                if is_load:
                    for i in range(bounds[p], bounds[p + 1]):
                        self._zero(self._slot(chunks[i]))
                with self._idle:
                    job.rejected += bounds[p + 1] - bounds[p]
                self._part_done(job, 0)

    # ------------------------------------------------------------------ SecondaryTierManager

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue the cascade of ``job_metadata``'s chunks into the store (never blocks)."""
        self._submit(job_metadata, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queue the promotion of ``job_metadata``'s keys into their primary chunks (never
        blocks)."""
        self._submit(job_metadata, is_load=True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The jobs finished since the last call: a load lists the keys that verified
        (``successful_keys``) when some did not; a store fails when any chunk was not stored."""
        results: List[JobResult] = []
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                break
            self._jobs.pop(job.job_id, None)
            elapsed = time.monotonic() - job.started
            good = [k for k, ok in zip(job.keys, job.ok) if ok]
            failed = [k for k, ok in zip(job.keys, job.ok) if not ok]
            if job.is_load:
                if not job.rejected:  # a full queue says nothing about the records
                    self._loaded(good, failed)
                results.append(JobResult(
                    job_id=job.job_id, success=not failed,
                    successful_keys=tuple(good) if failed and good else None,
                    transfer_time=elapsed, transfer_bytes=job.bytes_moved))
            else:
                self._stored(good, [m.block_hash for m, ok in zip(job.metas, job.ok)
                                    if ok and m is not None])
                results.append(JobResult(job_id=job.job_id, success=not failed,
                                         transfer_time=elapsed, transfer_bytes=job.bytes_moved))
        return results

    def _loaded(self, good: List[OffloadKey], failed: List[OffloadKey]) -> None:
        """A load's outcome (a subclass makes its failed keys misses)."""

    def _stored(self, keys: List[OffloadKey], hashes: List[int]) -> None:
        """A store's chunks that landed: no longer refused, their eviction reported by key (when
        the store reports evictions and events are on)."""
        for key in keys:
            self._refused.pop(key, None)
        if self._track_removals:
            for key, h in zip(keys, hashes):
                self._key_of[h] = key
        if self._events is not None and keys:
            self._events.append(OffloadingEvent(keys=list(keys), medium=self.medium, removed=False,
                                                locality=self.locality))

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored events for the chunks that landed, removed events for the ones the store
        evicted (those this process stored; ``medium`` ``STORAGE``, the tier's locality)."""
        if self._events is None:
            return ()
        removed: List[OffloadKey] = []
        for h in self.store.take_removed():
            key = self._key_of.pop(h, None)
            if key is not None:
                removed.append(key)
        if removed:
            self._events.append(OffloadingEvent(keys=removed, medium=self.medium, removed=True,
                                                locality=self.locality))
        events, self._events = self._events, []
        return events

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        """Blocks until every submitted job has finished (its result waits for
        ``get_finished_jobs``)."""
        with self._idle:
            while self._in_flight:
                self._idle.wait()

    def shutdown(self) -> None:
        """Finishes the queued jobs, stops the workers and closes the store. Idempotent."""
        if self._shut:
            return
        self._shut = True
        self.drain_jobs()
        for _ in self._workers:
            self._tasks.put(None)
        for t in self._workers:
            t.join()
        if self._store is not None:
            self._store.close()
        try:
            self._view.release()  # the workers are gone: no slice of it is left
        except BufferError:  # pragma: no cover - a caller still holds a slice
            pass


class PagedKVDiskTier(_StoreTier):
    """pagedkv's disk tier (:class:`~pagedkv.tiers.disk.DiskStore`) as a vLLM secondary tier.

    Options (``kv_connector_extra_config["secondary_tiers"]`` keys):
        path: The cache directory (created 0700; one engine at a time).
        capacity_bytes: Disk space its segment files may take (at least one chunk's slot).
        threads: I/O worker threads (default 2).
        max_queued_jobs: Job parts waiting for a worker, at most (default 256); a job that finds
            the queue full fails at once.
        tier_secret_file: The fleet's tier secret (a 0600 file); default ``PAGEDKV_TIER_SECRET``,
            else a key the directory keeps.
        model_revision: Mixed into the fingerprint (a hub revision, a weights digest).
        enable_kv_events: Emit stored/removed events (when vLLM's KV events are on).
        locality: Its events' locality (default ``LOCAL``).

    ``lookup`` answers from the store's index on the caller's thread (HIT or MISS, never RETRY).
    """

    _label = "PagedKVDiskTier"

    def __init__(
        self,
        offloading_spec: "OffloadingSpec",
        primary_kv_view: memoryview,
        tier_type: str,
        path: Any = None,
        capacity_bytes: Any = None,
        threads: Any = 2,
        max_queued_jobs: Any = 256,
        tier_secret_file: Any = None,
        model_revision: Any = None,
        enable_kv_events: Any = False,
        locality: Any = None,
        backpressure_detector: "Optional[BackpressureDetector]" = None,
        **unknown: Any,
    ) -> None:
        tier = self._label
        _no_unknown(tier, unknown)
        path = _str_option(tier, "path", path)
        capacity = _int_option(tier, "capacity_bytes", capacity_bytes, 1)
        secret_file = _str_option(tier, "tier_secret_file", tier_secret_file, optional=True)
        super().__init__(
            offloading_spec, primary_kv_view, tier_type, backpressure_detector, threads=threads,
            max_queued_jobs=max_queued_jobs, enable_kv_events=enable_kv_events,
            locality=_locality_option(tier, locality, Locality.LOCAL),
            model_revision=model_revision)
        config = SimpleNamespace(disk_cache_dir=path, disk_cache_memory=capacity,
                                 tier_secret_file=secret_file)
        store = backend("disk")(config, self.fingerprint, self._chunk_bytes)
        assert store is not None
        self._track_removals = self._events is not None
        self._start(store)

    def _loaded(self, good: List[OffloadKey], failed: List[OffloadKey]) -> None:
        """A key whose load failed is a miss until it is stored again: the index may still hold
        it (an I/O error), and a HIT would promote it again and again."""
        for key in failed:
            self._refused[key] = None
            self._refused.move_to_end(key)
        while len(self._refused) > _REFUSED_CAP:
            self._refused.popitem(last=False)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._refused:
            return LookupResult.MISS
        present = self.store.holds([key_hash(key)])[0]
        return LookupResult.HIT if present else LookupResult.MISS


@dataclass
class _Probe:
    """The Redis tier's knowledge of one key: ``present`` (None while the probe is out), when it
    stops being trusted, and whether no lookup has read it yet (a probe's answer is read at least
    once, however short ``lookup_cache_s``: else a key could be RETRY forever)."""

    present: Optional[bool]
    until: float
    unread: bool = False


class PagedKVRemoteTier(_StoreTier):
    """pagedkv's Redis/Valkey tier (:class:`~pagedkv.tiers.remote.RemoteStore`) as a vLLM
    secondary tier, shared by every engine of one fingerprint and one tier secret.

    Options:
        url: ``redis://host:port/db`` (``rediss://``, ``unix://``).
        timeout_s: Bound on each connect, send and receive (default 1 s: every operation runs on
            the tier's threads, none on the scheduler's, and a chunk of several blocks is MiBs).
        lookup_cache_s: How long an existence answer is trusted (default 2 s).
        threads, max_queued_jobs, tier_secret_file, model_revision, enable_kv_events: as for
            :class:`PagedKVDiskTier` (the secret is required: the file or ``PAGEDKV_TIER_SECRET``).
        locality: Its events' locality (default ``REMOTE``).

    ``lookup`` never touches the network: an unknown key is ``RETRY`` until the step's probe
    (one pipelined ``EXISTS``, on the probe thread) answers.
    """

    _label = "PagedKVRemoteTier"

    def __init__(
        self,
        offloading_spec: "OffloadingSpec",
        primary_kv_view: memoryview,
        tier_type: str,
        url: Any = None,
        timeout_s: Any = 1.0,
        lookup_cache_s: Any = 2.0,
        threads: Any = 2,
        max_queued_jobs: Any = 256,
        tier_secret_file: Any = None,
        model_revision: Any = None,
        enable_kv_events: Any = False,
        locality: Any = None,
        backpressure_detector: "Optional[BackpressureDetector]" = None,
        **unknown: Any,
    ) -> None:
        tier = self._label
        _no_unknown(tier, unknown)
        url = _str_option(tier, "url", url)
        timeout_s = _seconds_option(tier, "timeout_s", timeout_s)
        self._cache_s = _seconds_option(tier, "lookup_cache_s", lookup_cache_s, allow_zero=True)
        secret_file = _str_option(tier, "tier_secret_file", tier_secret_file, optional=True)
        super().__init__(
            offloading_spec, primary_kv_view, tier_type, backpressure_detector, threads=threads,
            max_queued_jobs=max_queued_jobs, enable_kv_events=enable_kv_events,
            locality=_locality_option(tier, locality, Locality.REMOTE),
            model_revision=model_revision)
        config = SimpleNamespace(remote_cache_url=url, remote_cache_timeout_s=timeout_s,
                                 tier_secret_file=secret_file)
        store = backend("remote")(config, self.fingerprint, self._chunk_bytes)
        assert store is not None
        self._probes: Dict[OffloadKey, _Probe] = {}
        self._batch: List[OffloadKey] = []
        self._probe_in: "queue.SimpleQueue[Optional[List[OffloadKey]]]" = queue.SimpleQueue()
        self._probe_out: "queue.SimpleQueue[List[Tuple[OffloadKey, bool]]]" = queue.SimpleQueue()
        self._probes_out = 0
        self._start(store)
        self._prober = threading.Thread(target=self._probe_loop, name=f"pagedkv-{tier_type}-probe",
                                        daemon=True)
        self._prober.start()

    def _probe_loop(self) -> None:
        while True:
            keys = self._probe_in.get()
            if keys is None:
                return
            try:
                found = self.store.holds([key_hash(k) for k in keys])
            except Exception:  # noqa: BLE001 - an unanswerable probe is a miss
                _log.warning("%s: existence probe raised; answered as misses", self.tier_type,
                             exc_info=True)
                found = [False] * len(keys)
            self._probe_out.put(list(zip(keys, found)))

    def _drain_probes(self) -> None:
        now = time.monotonic()
        while True:
            try:
                answers = self._probe_out.get_nowait()
            except queue.Empty:
                return
            self._probes_out -= 1
            for key, present in answers:
                probe = self._probes.get(key)
                if probe is not None and probe.present is None:  # else a store or load answered
                    self._probes[key] = _Probe(bool(present), now + self._cache_s, unread=True)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._drain_probes()
        probe = self._probes.get(key)
        now = time.monotonic()
        if probe is not None:
            if probe.present is None:
                return LookupResult.RETRY
            if probe.unread or now <= probe.until:
                probe.unread = False
                return LookupResult.HIT if probe.present else LookupResult.MISS
        self._probes[key] = _Probe(None, math.inf)
        self._batch.append(key)
        return LookupResult.RETRY

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Sends the step's unknown keys to the probe thread (one round trip)."""
        self._drain_probes()
        if self._batch:
            batch, self._batch = self._batch, []
            self._probe_in.put(batch)
            self._probes_out += 1
        if len(self._probes) > 4 * _REFUSED_CAP:
            now = time.monotonic()
            for key in [k for k, p in self._probes.items()
                        if p.present is not None and p.until < now]:
                del self._probes[key]

    def has_pending_work(self) -> bool:
        return super().has_pending_work() or self._probes_out > 0

    def _loaded(self, good: List[OffloadKey], failed: List[OffloadKey]) -> None:
        """A key whose load failed is a miss for ``lookup_cache_s`` (a value that did not verify
        was deleted by the store; a timeout may pass)."""
        until = time.monotonic() + self._cache_s
        for key in failed:
            self._probes[key] = _Probe(False, until)

    def _stored(self, keys: List[OffloadKey], hashes: List[int]) -> None:
        super()._stored(keys, hashes)
        until = time.monotonic() + self._cache_s
        for key in keys:
            self._probes[key] = _Probe(True, until)

    def shutdown(self) -> None:
        if not self._shut:
            self._probe_in.put(None)
            self._prober.join()
        super().shutdown()
