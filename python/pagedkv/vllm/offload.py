"""pagedkv's host tier as a vLLM ``OffloadingSpec``: the index on the Rust core, the copies in torch.

vLLM 0.33's ``OffloadingConnector`` loads an offloading spec by name from
``kv_connector_extra_config`` (``spec_name``, ``spec_module_path``). This module is such a spec::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "PagedKVOffloadingSpec",
        "spec_module_path": "pagedkv.vllm.offload", "cpu_bytes_to_use": 8000000000}}'

It owns:

- :class:`PagedKVOffloadingManager`, the scheduler side (vLLM's ``OffloadingManager``): which
  offload keys (vLLM's ``OffloadKey``: block hash bytes + 4-byte big-endian group index) live in
  which host chunk. Its whole state is one :class:`pagedkv._core.OffloadIndex` of ``num_chunks``
  chunks (the core's ``offload_index``): the chunks' reference counts and free order, the key
  map (a seeded XXH3 table, keys stored inline), which chunks have a store in flight, and per
  chunk its position in the request that last named it. Each of vLLM's calls is one core call;
  ``lookup`` is the core's own function (``OffloadIndex.lookup_function``), with no Python frame
  between vLLM and the index.
- :class:`PagedKVLoadStoreSpec`, the chunk ids a load or store names (a ``CPULoadStoreSpec``, so
  vLLM code that reads chunk ids reads them).
- :class:`PagedKVOffloadingSpec`, the spec: sizes the host tier from ``cpu_bytes_to_use`` and
  hands out the manager and the worker (:mod:`pagedkv.vllm.offload_worker`).

What the calls do (the core's rules):

- a chunk being written (``prepare_store`` .. ``complete_store``) is keyed and held (count 1):
  ``lookup`` finds it (``HIT_PENDING``) and nothing evicts it;
- a ready chunk that no load reads has count 0 and sits in the free list, at the back (cached
  chunks are evicted after every never-used or failed chunk, oldest release first);
- ``prepare_load`` takes one reference per key (a free chunk leaves the free list, so no store
  evicts it), ``complete_load`` gives them back tail first, so the head of a prefix outlives its
  tail ("tail first": by the keys' token positions in the request that last named them in a
  ``prepare_store`` or ``prepare_load``, as its ``ReqContext`` records them, else by the order it
  named them; vLLM's connector reports completions as unordered sets); ``touch`` moves the
  present ready chunks to the back, the first key last;
- ``prepare_store`` holds the offered keys that are already present for the call (an offered
  chunk is never evicted by its own store), takes chunks for the missing ones from the front of
  the free list (evicting ready chunks: their keys come back as the key objects that were
  stored), keys them, and releases the held ones in reverse (the first key evicted last); it
  returns None, changing nothing, when the free chunks not offered are too few;
- ``complete_store`` marks the chunks ready and releases them tail first (the head of a prefix is
  evicted last); a failed store unkeys its chunks and puts them at the front (reused first).

The eviction order is thus the order in which chunks became free, each completion's tails
before its heads: recency is set when a transfer completes (or on ``touch``), not when the
request that caused it finishes.

The index keeps guesses of each key's chunk for the next call naming the same key objects (the
last ``prepare_*`` call's keys, and the keys ``lookup`` answered before a load); each guess is
checked against the chunk's own key, so they make calls faster and never change an answer.
vLLM's checks on its caller (a load of a key that is not ready, a count going below zero) are
``InvalidArgumentError`` here, raised before anything changes; :meth:`PagedKVOffloadingManager.
check_coherence` checks the index's invariants.

Importing this module imports vLLM and checks its version: pagedkv's spec was built and tested
against vLLM 0.33.x; any other version fails at import with :class:`pagedkv.errors.
MissingDependencyError` naming it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

import numpy as np

from pagedkv.errors import InvalidConfigError, MissingDependencyError

#: The vLLM release line this module's spec was written and tested against.
TESTED_VLLM = "0.33"
TESTED_VLLM_RELEASE = "0.33.0"


def _check_vllm_version(version: str) -> None:
    """Raises MissingDependencyError unless ``version`` is a vLLM 0.33.x release."""
    parts = version.split(".")
    if parts[:2] != TESTED_VLLM.split("."):
        raise MissingDependencyError(
            f"pagedkv.vllm.offload was tested with vLLM {TESTED_VLLM_RELEASE} (vllm>=0.33,<0.34, "
            f"the pagedkv[vllm] extra) and does not run on vLLM {version}: its offloading API "
            f"changes between minor releases; install vllm=={TESTED_VLLM_RELEASE}",
            module="vllm", extra="vllm")


try:
    import vllm as _vllm
except ImportError as _exc:  # pragma: no cover - the module needs vLLM
    raise MissingDependencyError(
        f"pagedkv.vllm.offload needs vLLM {TESTED_VLLM_RELEASE}, which is not installed: "
        "pip install 'pagedkv[vllm]'", module="vllm", extra="vllm") from _exc

_check_vllm_version(str(getattr(_vllm, "__version__", "unknown")))

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: E402
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCaches,
    ConfigInfoMapping,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: E402
from vllm.v1.kv_offload.cpu.common import (  # noqa: E402
    CPULoadStoreSpec,
    CPUOffloadingInfo,
    CPUOffloadingMetrics,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from pagedkv._core import OffloadIndex  # noqa: E402

if TYPE_CHECKING:
    from pagedkv.vllm.offload_worker import PagedKVOffloadingWorker

__all__ = [
    "PagedKVLoadStoreSpec",
    "PagedKVOffloadingManager",
    "PagedKVOffloadingSpec",
    "TESTED_VLLM_RELEASE",
]

#: Host chunk sizes are rounded up to this many bytes (a chunk starts on a page boundary).
CHUNK_ALIGNMENT = 4096

#: Chunks a tier may have at most (chunk ids are int32, as vLLM's load/store specs hold them).
MAX_CHUNKS = 2**31 - 1

_HIT = LookupResult.HIT
_PENDING = LookupResult.HIT_PENDING
_MISS = LookupResult.MISS


class PagedKVLoadStoreSpec(CPULoadStoreSpec):
    """Host chunk ids of one load or store (``block_ids``/``chunk_ids``, an int32 array), in the
    order of the keys the manager was given."""

    def __init__(self, block_ids: Union[Sequence[int], "np.ndarray[Any, Any]"]) -> None:
        # The index hands out int32 arrays already: kept as they are (no copy).
        if isinstance(block_ids, np.ndarray) and block_ids.dtype == np.int32:
            self.block_ids = block_ids
        else:
            super().__init__(list(block_ids))


_NO_CHUNKS = np.zeros(0, dtype=np.int32)


class PagedKVOffloadingManager(OffloadingManager):
    """vLLM's scheduler-side ``OffloadingManager`` on pagedkv's core (module docs).

    The constructor takes the keywords of vLLM's ``CPUOffloadingManager`` so it can stand in
    where that one is built.

    Args:
        num_chunks: Host chunks (>= 0).
        cache_policy: Only ``"lru"`` (the core's release-order LRU); anything else is refused.
        cache_policy_module_path: Must be None (no external policies).
        enable_events: Keep ``OffloadingEvent`` records for :meth:`take_events`.
        store_threshold: With a value >= 2, a new key is stored only once it has been offered that
            many times (the offers of the last ``max_tracker_size`` keys are counted).
        max_tracker_size: Keys whose offers are counted, at most.
        info: The tier's facts for vLLM's info metric.

    Raises:
        InvalidConfigError: A size out of range, or an eviction policy other than LRU.
    """

    def __init__(self, num_chunks: int, cache_policy: str = "lru",
                 cache_policy_module_path: Optional[str] = None, enable_events: bool = False,
                 store_threshold: int = 1, max_tracker_size: int = 64_000,
                 info: Optional[CPUOffloadingInfo] = None) -> None:
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) \
                or not 0 <= num_chunks <= MAX_CHUNKS:
            raise InvalidConfigError(
                f"num_chunks must be an integer in [0, {MAX_CHUNKS}], got {num_chunks!r}",
                field="num_chunks", value=num_chunks, reason=f"must be in [0, {MAX_CHUNKS}]")
        if cache_policy != "lru" or cache_policy_module_path is not None:
            raise InvalidConfigError(
                f"eviction_policy {cache_policy!r} (module {cache_policy_module_path!r}) is not "
                "available with PagedKVOffloadingSpec: its eviction order is the core's LRU "
                "(eviction_policy 'lru')", field="eviction_policy", value=cache_policy,
                reason="must be 'lru'")
        if isinstance(max_tracker_size, bool) or not isinstance(max_tracker_size, int) \
                or max_tracker_size < 1:
            raise InvalidConfigError(
                f"max_tracker_size must be an integer >= 1, got {max_tracker_size!r}",
                field="max_tracker_size", value=max_tracker_size, reason="must be >= 1")
        self.medium = Medium.CPU
        self.num_chunks = num_chunks
        self._config_info: ConfigInfoMapping = info.as_config_info() if info is not None else {}
        self.events: Optional[List[OffloadingEvent]] = [] if enable_events else None
        self.store_threshold = int(store_threshold)
        self.max_tracker_size = max_tracker_size
        #: Offers per key not yet stored (store_threshold >= 2), oldest offer first.
        self.offers: Optional[Dict[OffloadKey, int]] = {} if self.store_threshold >= 2 else None
        self.stores_skipped = 0
        self.allocation_sizes: List[int] = []
        self._reset_state()

    def _reset_state(self) -> None:
        #: The whole state: chunks, keys, stores in flight, stamps (module docs).
        self.pool = OffloadIndex(self.num_chunks, (_MISS, _HIT, _PENDING),
                                 ReqContext.get_offload_key_position)
        # vLLM calls lookup once per key: the core's own function, no Python frame in between.
        self.lookup = self.pool.lookup_function()  # type: ignore[method-assign]

    # ------------------------------------------------------------------ figures

    @property
    def num_free_chunks(self) -> int:
        """Chunks a store may take now (never used, failed, or ready and unread)."""
        return self.pool.num_free

    @property
    def num_pending(self) -> int:
        """Chunks with a store in flight."""
        return self.pool.num_pending

    def check_coherence(self) -> None:
        """Checks the core index's invariants (module docs).

        Raises:
            InvariantViolationError: They do not hold (names the chunk).
        """
        self.pool.check_invariants()

    # ------------------------------------------------------------------ requests

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # Shadowed per instance by the core's own method (``_reset_state``).
        result: LookupResult = self.pool.lookup(key, req_context)
        return result

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey],
                     req_context: ReqContext) -> LoadStoreSpec:
        """Holds the chunks of ``keys`` (each offloaded and ready) until :meth:`complete_load`.

        Raises:
            InvalidArgumentError: A key is missing or still being stored (nothing held).
        """
        return PagedKVLoadStoreSpec(self.pool.prepare_load(keys, req_context))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Releases the references :meth:`prepare_load` took, tail first.

        Raises:
            InvalidArgumentError: A key is missing, or its chunk is not held by a load (nothing
                changed).
        """
        self.pool.complete_load(keys)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Moves the present, ready chunks of ``keys`` to the back of the eviction order, the
        head of ``keys`` last (evicted last). Unknown keys are ignored."""
        self.pool.touch(keys)

    # ------------------------------------------------------------------ stores

    def _admit(self, new: List[OffloadKey]) -> List[OffloadKey]:
        """Counts an offer of each new key; the ones offered ``store_threshold`` times."""
        offers = self.offers
        assert offers is not None
        out = []
        for key in new:
            n = offers.pop(key, 0) + 1
            offers[key] = n  # to the newest end
            if n >= self.store_threshold:
                out.append(key)
        while len(offers) > self.max_tracker_size:
            del offers[next(iter(offers))]
        self.stores_skipped += len(new) - len(out)
        return out

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> Optional[PrepareStoreOutput]:
        """Chunks for the keys of ``keys`` not offloaded yet, evicting the least recently
        released ready chunks as needed (never one of ``keys``). None, with nothing changed, when
        too few chunks are free."""
        pool = self.pool
        admit: Optional[List[bool]] = None
        if self.offers is not None:
            new = pool.missing(keys)
            if new:
                admitted = set(self._admit(new))
                admit = [key in admitted for key in keys]
        store, chunks, evicted = pool.prepare_store(keys, req_context, admit)
        if not store:
            return PrepareStoreOutput(keys_to_store=[], store_spec=PagedKVLoadStoreSpec(
                _NO_CHUNKS), evicted_keys=[])
        self.allocation_sizes.append(len(store))
        if chunks is None:
            return None
        if evicted and self.events is not None:
            self.events.append(OffloadingEvent(keys=evicted, medium=self.medium, removed=True))
        return PrepareStoreOutput(keys_to_store=store, store_spec=PagedKVLoadStoreSpec(chunks),
                                  evicted_keys=evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        """Marks the chunks of ``keys`` still being stored as ready (loadable, evictable), or, on
        failure, drops them (their chunks are reused first). Keys not being stored are ignored."""
        done = self.pool.complete_store(keys, success)
        if done and self.events is not None:
            self.events.append(OffloadingEvent(keys=done, medium=self.medium,
                                               removed=not success, metadata_only=not success))

    # ------------------------------------------------------------------ the rest

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return
        events, self.events = self.events, []
        look = self.pool.lookup
        for ev in events:
            if ev.metadata_only:
                # A failed store's keys, unless a later store took the key again.
                keys = [k for k in ev.keys if look(k) is _MISS]
                if not keys:
                    continue
                ev = OffloadingEvent(keys=keys, medium=ev.medium, removed=True,
                                     metadata_only=True)
            yield ev

    def reset_cache(self) -> None:
        """Forgets every chunk, held ones included (vLLM reports no completion of a job from
        before a reset)."""
        self.pool.reset()

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._config_info]

    def get_stats(self) -> Optional[OffloadingConnectorStats]:
        stats = OffloadingConnectorStats()
        n = self.num_chunks
        used = (n - self.num_free_chunks) / n if n else 0.0
        write = self.num_pending / n if n else 0.0
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, used)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, max(used - write, 0.0))
        for size in self.allocation_sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        self.allocation_sizes.clear()
        if self.store_threshold >= 2:
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, self.stores_skipped)
            self.stores_skipped = 0
        return stats


class PagedKVOffloadingSpec(OffloadingSpec):
    """The spec vLLM's ``OffloadingConnector`` builds from ``spec_name: PagedKVOffloadingSpec``.

    ``kv_connector_extra_config`` keys read: ``cpu_bytes_to_use`` (required: host bytes for the
    tier, over all workers), ``eviction_policy`` (``"lru"`` only), ``store_threshold``,
    ``max_tracker_size``, and vLLM's own (``block_size``, ``offload_prompt_only``, ...).

    The worker (:class:`pagedkv.vllm.offload_worker.PagedKVOffloadingWorker`) runs on CUDA and,
    unlike vLLM's CPU spec, on CPU tensors too.

    Raises:
        InvalidConfigError: ``cpu_bytes_to_use`` missing or not a positive integer; the canonical
            host layout asked for.
    """

    @classmethod
    def build_metric_definitions(
            cls, extra_config: Dict[str, Any]) -> Dict[str, OffloadingMetricMetadata]:
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

        # The same gauges and histogram as vLLM's CPU tier: the manager reports them.
        return CPUOffloadingSpec.build_metric_definitions(extra_config)

    @classmethod
    def config_info_keys(cls, extra_config: Dict[str, Any]) -> tuple[str, ...]:
        return CPUOffloadingInfo.config_info_keys()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        raw = self.extra_config.get("cpu_bytes_to_use")
        try:
            cpu_bytes = int(raw) if raw is not None and not isinstance(raw, bool) else 0
        except (TypeError, ValueError):
            cpu_bytes = 0
        if cpu_bytes <= 0:
            raise InvalidConfigError(
                f"kv_connector_extra_config cpu_bytes_to_use must be a positive byte count for "
                f"PagedKVOffloadingSpec, got {raw!r}", field="cpu_bytes_to_use", value=raw,
                reason="must be > 0")
        if getattr(config, "canonical_layout", False):
            raise InvalidConfigError(
                "PagedKVOffloadingSpec keeps each worker's own block layout; the canonical "
                "(parallelism-free) host layout is not available", field="canonical_layout",
                value=True, reason="must be off")
        world = max(1, config.parallel.world_size)
        #: Bytes of one chunk on one worker (unpadded), and over all workers (aligned).
        self.worker_chunk_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        total = self.worker_chunk_bytes * world
        self.chunk_bytes = -(-total // CHUNK_ALIGNMENT) * CHUNK_ALIGNMENT if total else 0
        self.num_chunks = cpu_bytes // self.chunk_bytes if self.chunk_bytes else 0
        self.info = CPUOffloadingInfo.from_config(config, self.num_chunks, self.chunk_bytes)
        self.eviction_policy = str(self.extra_config.get("eviction_policy", "lru"))
        self._manager: Optional[PagedKVOffloadingManager] = None
        self._worker: Optional["PagedKVOffloadingWorker"] = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = PagedKVOffloadingManager(
                num_chunks=self.num_chunks, cache_policy=self.eviction_policy,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
                info=self.info)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from pagedkv.vllm.offload_worker import PagedKVOffloadingWorker

            self._worker = PagedKVOffloadingWorker(
                kv_caches, blocks_per_chunk=self.blocks_per_chunk, num_chunks=self.num_chunks)
        return self._worker
