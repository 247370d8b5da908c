"""Fetching a request's cached prefix from the tiers below the host, fastest tier first.

Owns :class:`TierFetcher`: given a request's blocks (their :class:`~pagedkv.tiers.record.BlockMeta`,
in prefix order) it finds how long a prefix the tiers hold between them and which tier holds each
block (:meth:`TierFetcher.locate`), reads those blocks into the caller's host buffers in parallel
(:meth:`TierFetcher.fetch_into`), copies blocks found only in a slower tier into the faster ones
(a remote hit becomes a disk hit next time), and writes a spilled block to every tier
(:meth:`TierFetcher.spill`).

Invariants: a prefix is only useful unbroken, so :meth:`fetch_into` reports how many *leading*
blocks verified — a block after a miss is never counted even if it was read; like the stores it
wraps, nothing it does below the caller raises (failures are misses); the tiers are given fastest
first and that order is the only policy (no cost model here: the core's decides load or recompute).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, List, Protocol, Sequence

from ..errors import InvalidArgumentError, InvalidConfigError
from .record import BlockMeta, Buffer, StoreClosedError, TierStats

__all__ = ["BlockStore", "FetcherStats", "TierFetcher"]


class BlockStore(Protocol):
    """What a tier offers (:class:`~pagedkv.tiers.DiskStore`, :class:`~pagedkv.tiers.RemoteStore`)."""

    block_bytes: int

    def put_async(self, meta: BlockMeta, data: Buffer) -> "Future[bool]": ...

    def get_into_async(self, meta: BlockMeta, out: Buffer) -> "Future[bool]": ...

    def longest_prefix(self, hashes: Sequence[int]) -> int: ...

    def stats(self) -> TierStats: ...


@dataclass
class FetcherStats:
    """Blocks fetched from each tier (by position), blocks a located tier failed to deliver, and
    blocks copied up into faster tiers."""

    fetched: List[int] = field(default_factory=list)
    failed: int = 0
    promoted: int = 0


class TierFetcher:
    """Prefix lookups and fetches over ``tiers``, ordered fastest first (disk, then remote).

    Args:
        tiers: The stores, fastest first; all of one ``block_bytes``.
        promote: Copy a block fetched from a slower tier into every faster one.
        threads: Threads that run :meth:`fetch_into` requests (each waits on the stores' own pools).
    """

    def __init__(self, tiers: Sequence[BlockStore], *, promote: bool = True, threads: int = 1) -> None:
        if not tiers:
            raise InvalidConfigError("a TierFetcher needs at least one tier", field="tiers", value=0,
                                     reason="empty")
        sizes = {t.block_bytes for t in tiers}
        if len(sizes) != 1:
            raise InvalidConfigError(
                f"every tier must hold blocks of one size, got {sorted(sizes)}", field="tiers",
                value=sorted(sizes), reason="block sizes differ",
            )
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise InvalidConfigError(f"threads must be an integer >= 1, got {threads!r}", field="threads",
                                     value=threads, reason="must be >= 1")
        self.tiers = list(tiers)
        self.block_bytes = sizes.pop()
        self.promote = bool(promote)
        self._lock = threading.Lock()
        self._stats = FetcherStats(fetched=[0] * len(self.tiers))
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pagedkv-fetch")
        self._closed = False

    def locate(self, hashes: Sequence[int]) -> List[int]:
        """The tier to read each leading block from; stops at the first block no tier holds.

        From each position the fastest tier holding the block there is used for as long as its run
        of consecutive blocks lasts, then the tiers are asked again: one ``longest_prefix`` call per
        tier per run, not one per block. The length is that of the longest prefix the tiers hold
        between them.
        """
        hashes = list(hashes)
        where: List[int] = []
        pos = 0
        while pos < len(hashes):
            for i, tier in enumerate(self.tiers):
                run = tier.longest_prefix(hashes[pos:])
                if run:
                    where.extend([i] * run)
                    pos += run
                    break
            else:
                break
        return where

    def fetch_into(self, metas: Sequence[BlockMeta], outs: Sequence[Buffer]) -> "Future[int]":
        """Read the longest cached prefix of ``metas`` into ``outs`` (one ``block_bytes`` buffer per
        block); the future gives how many leading blocks now hold verified bytes.

        The buffers must not be touched until the future is done; past the count their contents are
        unspecified. Arguments are checked here; the future never holds an exception.
        """
        if self._closed:
            raise StoreClosedError(f"{self!r} is closed", store=repr(self))
        metas = list(metas)
        outs = list(outs)
        if len(outs) != len(metas):
            raise InvalidArgumentError(
                f"fetch_into needs one buffer per block: {len(metas)} blocks, {len(outs)} buffers",
                what="outs", value=len(outs), reason=f"must be {len(metas)}",
            )
        for m in metas:
            if not isinstance(m, BlockMeta):
                raise InvalidArgumentError(
                    f"metas must be pagedkv.tiers.BlockMeta, got {type(m).__name__}", what="metas",
                    value=type(m).__name__, reason="not a BlockMeta",
                )
        views = [self._check_out(o) for o in outs]
        return self._pool.submit(self._fetch, metas, views)

    def _check_out(self, out: Buffer) -> memoryview:
        try:
            view = memoryview(out).cast("B")
        except TypeError:
            raise InvalidArgumentError(
                f"outs must be writable contiguous buffers, got {type(out).__name__}", what="outs",
                value=type(out).__name__, reason="not a contiguous buffer",
            ) from None
        if view.readonly or view.nbytes != self.block_bytes:
            raise InvalidArgumentError(
                f"each out must be a writable buffer of {self.block_bytes} bytes, got {view.nbytes}"
                f"{' (read-only)' if view.readonly else ''}", what="outs", value=view.nbytes,
                reason=f"must be {self.block_bytes} writable bytes",
            )
        return view

    def _fetch(self, metas: List[BlockMeta], outs: List[memoryview]) -> int:
        try:
            where = self.locate([m.block_hash for m in metas])
        except Exception:  # noqa: BLE001 - a store's lookup failing is a miss, like its reads
            return 0
        futures = [self.tiers[t].get_into_async(metas[j], outs[j]) for j, t in enumerate(where)]
        done = 0
        broken = False
        promoted = 0
        failed = 0
        fetched = [0] * len(self.tiers)
        for j, fut in enumerate(futures):
            try:
                ok = fut.result()
            except Exception:  # noqa: BLE001 - the stores never raise; a broken one is a miss
                ok = False
            if not ok:
                failed += 1
                broken = True  # a verified block after this one is not part of the prefix
                continue
            fetched[where[j]] += 1
            if not broken:
                done += 1
            if self.promote and where[j] > 0:
                # A copy: the caller may reuse its buffer as soon as the fetch is done.
                data = bytes(outs[j])
                for faster in self.tiers[: where[j]]:
                    faster.put_async(metas[j], data)
                promoted += 1
        with self._lock:
            self._stats.failed += failed
            self._stats.promoted += promoted
            for i, n in enumerate(fetched):
                self._stats.fetched[i] += n
        return done

    def spill(self, meta: BlockMeta, data: Buffer) -> List["Future[bool]"]:
        """Write one block to every tier; ``data`` must stay unchanged until all futures are done."""
        return [t.put_async(meta, data) for t in self.tiers]

    def stats(self) -> FetcherStats:
        """A snapshot of the fetch counters (each tier's own counters: its ``stats()``)."""
        with self._lock:
            return FetcherStats(list(self._stats.fetched), self._stats.failed, self._stats.promoted)

    def close(self) -> None:
        """Finish queued fetches (the tiers are the caller's to close). Idempotent."""
        self._closed = True
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "TierFetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

