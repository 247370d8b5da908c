"""Swap: the host tier of the KV cache and the copies between it and the device pool.

Owns :class:`HostKVPool` (``num_host_blocks`` blocks in pinned host memory, allocated once) and
:class:`SwapEngine`, which applies the block manager's swap lists to a :class:`~pagedkv.kv_pool.KVPool`:
``swap_out(pairs)`` copies device blocks to host blocks, ``swap_in(pairs)`` copies host blocks
back into device blocks. The manager decides which blocks move and frees/allocates them; this module
only moves bytes.

**Layout.** Each block keeps the per-layer layout of the device pool (``[block_size, kv_heads,
head_dim]``, head_dim innermost, for K and for V of every layer), but a host block holds all of its
layers side by side::

    host.kv: [num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

so one host block is one contiguous ``spec.bytes_per_block`` region, and a run of consecutive host
block ids is one contiguous region too. That is what makes the copies large: on CUDA a swap gathers
its device blocks (wherever they lie in the pool) into a device staging buffer in host-block order
with one ``index_select`` (over 8-byte elements, at device bandwidth), then moves each run of
consecutive host blocks with one ``copy_`` (one DMA transfer). A swap-in is the mirror image: one
transfer per host run into staging, then one ``index_copy_`` scatter into the pool. The staging
buffer has two halves: a swap larger than one half goes through them in chunks, the gather
(scatter) of one chunk overlapping the transfer of the other.

**Streams and events (CUDA).** Swap-outs gather on one side stream and transfer on a second;
swap-ins transfer on a third and scatter on a fourth (the two directions use separate copy
engines, so a step's write-backs and loads share the link's two directions). Each swap first
waits (on the GPU, never the host) for the work already queued on the caller's stream, since that
work wrote (or still reads) the blocks it moves. It then records an event at the point where the
device pool is safe for the caller: for a swap-out, after the last gather — the device blocks may
then be reused while the transfer to host memory is still running; for a swap-in, after the last
scatter. :meth:`SwapEngine.wait` makes a stream wait on those events; the model runner calls it
only before the forward of a step whose lists hold swaps, so a step without swaps is never held
back, and nothing here blocks the host.

Between swaps the order is kept per block, not per swap: each chunk's event is logged, and the
engine remembers, for every device block, the last gather that read it and the last scatter that
wrote it, and for every host block the last transfer that wrote it and the last that read it. A
chunk waits only for the events of the blocks it touches: a scatter for the gathers still reading
its device blocks (the blocks a step evicts are often the very ones its loads fill), a gather for
the scatters still writing its device blocks, a host-to-device transfer for the swap-outs still
writing its host blocks, a device-to-host transfer for the swap-ins still reading its host blocks.
So a step's loads run beside its write-backs instead of after all of them.

On the CPU both pools are plain tensors and a swap is a synchronous indexed copy.

Invariants: the host pool's shape, dtype and address never change; copies move raw bytes (exact for
every dtype); :meth:`SwapEngine.swap_out` / :meth:`SwapEngine.swap_in` validate their whole argument
(ids in range, destinations distinct) before anything is queued, so a rejected list changes nothing.

This module imports torch at import time; ``import pagedkv`` does not import this module.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .._checks import allocate, check_flag
from ..config import CacheSpec
from ..errors import InvalidArgumentError, InvalidBlockError, InvalidConfigError
from ..kv_pool import KVPool

__all__ = ["HostKVPool", "SwapEngine", "DEFAULT_STAGING_BYTES"]

#: Device staging per direction when ``staging_blocks`` is not given: large enough that each
#: transfer runs at the link's full rate, small next to a KV pool.
DEFAULT_STAGING_BYTES = 256 * 2**20

PairsLike = Union[torch.Tensor, np.ndarray, Sequence[Sequence[int]], Sequence[int]]


class HostKVPool:
    """``num_blocks`` KV blocks of ``spec`` in host memory (pinned when ``pin_memory``).

    Args:
        spec: The cache spec of the device pool these blocks mirror.
        num_blocks: Host blocks, >= 1.
        pin_memory: Page-locked memory, so transfers are asynchronous DMA; ``None``: pinned when
            CUDA is available.

    Raises:
        InvalidConfigError: ``spec`` is not a CacheSpec or ``num_blocks`` is not an int >= 1.
        AllocationFailedError: The host memory cannot be allocated (or pinned).
    """

    def __init__(self, spec: CacheSpec, num_blocks: int, *, pin_memory: Optional[bool] = None) -> None:
        if not isinstance(spec, CacheSpec):
            raise InvalidConfigError(f"spec must be a CacheSpec, got {type(spec).__name__}")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise InvalidConfigError(
                f"num_host_blocks must be an integer >= 1, got {num_blocks!r}",
                field="num_host_blocks", value=num_blocks, reason="must be >= 1")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        pin_memory = check_flag("pin_memory", pin_memory)
        self.spec = spec
        self.num_blocks = num_blocks
        self.dtype: torch.dtype = getattr(torch, spec.dtype)
        shape = (num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv: torch.Tensor = allocate(
            f"host KV pool ({num_blocks} blocks{', pinned' if pin_memory else ''})",
            num_blocks * spec.bytes_per_block,
            lambda: torch.empty(shape, dtype=self.dtype, pin_memory=pin_memory),
        )
        self.pinned = bool(pin_memory)
        #: ``[num_blocks, bytes_per_block]`` bytes: the view every copy goes through.
        self.raw: torch.Tensor = self.kv.view(torch.uint8).view(num_blocks, spec.bytes_per_block)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block

    def block_view(self, layer: int, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Views ``(K, V)`` of one host block in one layer, each ``[block_size, kv_heads, head_dim]``."""
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise InvalidBlockError(
                f"host block id {block!r} out of range: the host pool holds {self.num_blocks} blocks",
                block=block, num_blocks=self.num_blocks)
        if isinstance(layer, bool) or not isinstance(layer, int) \
                or not 0 <= layer < self.spec.num_layers:
            raise InvalidArgumentError(
                f"invalid argument: layer = {layer!r}: the pool has {self.spec.num_layers} layers",
                what="layer", value=layer, reason=f"must be in [0, {self.spec.num_layers})")
        return self.kv[block, layer, 0], self.kv[block, layer, 1]

    def __repr__(self) -> str:
        return f"HostKVPool(blocks={self.num_blocks}, nbytes={self.nbytes}, pinned={self.pinned})"


class SwapEngine:
    """Moves blocks between a :class:`~pagedkv.kv_pool.KVPool` and its :class:`HostKVPool`.

    Args:
        pool: The device pool.
        num_host_blocks: Blocks in the host pool (the manager's ``num_host_blocks``).
        staging_blocks: Device staging per direction, in blocks (CUDA only); ``None``: as many as
            fit :data:`DEFAULT_STAGING_BYTES` (at least 1, at most ``num_host_blocks``).
        host: An existing :class:`HostKVPool` to use instead of allocating one.
        pin_memory: As in :class:`HostKVPool` (ignored with ``host``).

    Raises:
        InvalidConfigError: A size is not an int >= 1, or ``host`` does not match ``pool``'s spec.
        AllocationFailedError: The host pool or the staging buffers cannot be allocated.
    """

    def __init__(self, pool: KVPool, num_host_blocks: Optional[int] = None, *,
                 staging_blocks: Optional[int] = None, host: Optional[HostKVPool] = None,
                 pin_memory: Optional[bool] = None) -> None:
        if not isinstance(pool, KVPool):
            raise InvalidConfigError(f"pool must be a KVPool, got {type(pool).__name__}")
        spec = pool.spec
        if host is None:
            host = HostKVPool(spec, num_host_blocks if num_host_blocks is not None else 0,
                              pin_memory=pin_memory)
        elif host.spec != spec or (num_host_blocks is not None and host.num_blocks != num_host_blocks):
            raise InvalidConfigError("host pool does not match the device pool's spec / size",
                                     field="host", value=repr(host), reason="spec mismatch")
        self.pool = pool
        self.host = host
        self.device = pool.device
        self.is_cuda = self.device.type == "cuda"
        bpb = spec.bytes_per_block
        # One block of one layer's K (or V) is a contiguous `chunk` bytes. Copies index whole
        # blocks, so they read the pool as [layers, 2, blocks, chunk] of the widest integer type
        # dividing `chunk`: an indexed copy moves elements, and 8-byte elements cost an eighth of
        # the index arithmetic of bytes (measured: bytes held swaps to 84% of the link's rate).
        chunk = spec.block_size * spec.num_kv_heads * spec.head_dim * spec.dtype_bytes
        word = next(w for w, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16),
                                    (1, torch.uint8)) if chunk % w == 0)
        wdt = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
        L, N = spec.num_layers, pool.num_blocks
        # Block-major view of the device pool (not contiguous): a gather from it yields blocks in
        # the host layout.
        self._dev_blocks = pool.kv.view(torch.uint8).view(L, 2, N, chunk).view(wdt).permute(2, 0, 1, 3)
        self._host_blocks = host.kv.view(torch.uint8).view(host.num_blocks, L, 2, chunk).view(wdt)
        self._wdt = wdt
        self.num_swapped_out = 0
        self.num_swapped_in = 0
        # Host pool safe (after the last transfer of each direction; CUDA only).
        self._out_done: Optional[torch.cuda.Event] = None
        self._in_done: Optional[torch.cuda.Event] = None
        # Called before every non-empty swap-out (add_swap_out_check).
        self._swap_out_checks: List[Callable[[], None]] = []
        if staging_blocks is None:
            staging_blocks = max(1, min(host.num_blocks, DEFAULT_STAGING_BYTES // bpb))
        if isinstance(staging_blocks, bool) or not isinstance(staging_blocks, int) \
                or staging_blocks < 1:
            raise InvalidConfigError(
                f"staging_blocks must be an integer >= 1, got {staging_blocks!r}",
                field="staging_blocks", value=staging_blocks, reason="must be >= 1")
        self.staging_blocks = staging_blocks
        # Two halves per direction: the gather (scatter) of one chunk overlaps the transfer of
        # the other, so a long swap runs at the link's rate.
        self._half = max(1, staging_blocks // 2)
        if self.is_cuda:
            self._init_streams()

    def _init_streams(self) -> None:
        """The CUDA side: staging halves, side streams, and the per-block event bookkeeping."""
        bpb, wdt = self.pool.spec.bytes_per_block, self._wdt
        N = self.pool.num_blocks
        shape = (2, self._half) + tuple(self._host_blocks.shape[1:])
        nbytes = 2 * self._half * bpb
        self._stage_out = allocate("swap-out staging", nbytes,
                                   lambda: torch.empty(shape, dtype=wdt, device=self.device))
        self._stage_in = allocate("swap-in staging", nbytes,
                                  lambda: torch.empty(shape, dtype=wdt, device=self.device))
        # Swap-out: gathers on one stream, device-to-host transfers on another; swap-in:
        # host-to-device transfers, then scatters. `out_stream` / `in_stream` end each one.
        self._gather_stream = torch.cuda.Stream(self.device)
        self.out_stream = torch.cuda.Stream(self.device)
        self._load_stream = torch.cuda.Stream(self.device)
        self.in_stream = torch.cuda.Stream(self.device)
        # Events the caller has not waited on yet.
        self._pending: list = []
        # Per-block order (module docs): the log entry of the last chunk that gathered /
        # scattered each device block, and that wrote / read each host block (-1: none).
        self._gathers, self._scatters = _EventLog(), _EventLog()
        self._writes, self._reads = _EventLog(), _EventLog()
        self._dev_gathered = np.full(N, -1, dtype=np.int64)
        self._dev_scattered = np.full(N, -1, dtype=np.int64)
        self._host_written = np.full(self.host.num_blocks, -1, dtype=np.int64)
        self._host_read = np.full(self.host.num_blocks, -1, dtype=np.int64)
        # The last event that used each staging half (a transfer out, a scatter in).
        self._out_half_free: list = [None, None]
        self._in_half_free: list = [None, None]

    # --------------------------------------------------------------------------- validation

    def _pairs(self, pairs: PairsLike, src_n: int, dst_n: int, src_name: str,
               dst_name: str) -> Tuple[np.ndarray, np.ndarray]:
        if isinstance(pairs, torch.Tensor):
            a = pairs.detach().to("cpu").numpy()
        else:
            try:
                a = np.asarray(pairs)
            except (TypeError, ValueError) as exc:
                raise InvalidArgumentError(
                    f"invalid argument: pairs: not an integer array of pairs: {exc}",
                    what="pairs", value=-1, reason="not an integer array") from None
        if a.size == 0:
            e = np.empty(0, dtype=np.int64)
            return e, e
        if not np.issubdtype(a.dtype, np.integer):
            raise InvalidArgumentError(
                f"invalid argument: pairs has dtype {a.dtype}; block ids must be integers",
                what="pairs", value=-1, reason="dtype must be an integer type")
        if a.ndim == 1 and a.size % 2 == 0:
            a = a.reshape(-1, 2)
        if a.ndim != 2 or a.shape[1] != 2:
            raise InvalidArgumentError(
                f"invalid argument: pairs has shape {a.shape}; expected [n, 2] or a flat [2n]",
                what="pairs", value=int(a.size), reason="shape must be [n, 2] or [2n]")
        a = a.astype(np.int64)
        src, dst = a[:, 0].copy(), a[:, 1].copy()
        for ids, n, name in ((src, src_n, src_name), (dst, dst_n, dst_name)):
            bad = (ids < 0) | (ids >= n)
            if bad.any():
                block = int(ids[bad][0])
                raise InvalidBlockError(
                    f"{name} block id {block} out of range: the {name} pool holds {n} blocks",
                    block=block, num_blocks=n)
        if np.unique(dst).size != dst.size:
            raise InvalidArgumentError(
                f"invalid argument: pairs: a {dst_name} block appears twice", what="pairs",
                value=int(dst.size), reason="destinations must be distinct")
        return src, dst

    # ------------------------------------------------------------------------------ copies

    def add_swap_out_check(self, check: Callable[[], None]) -> None:
        """Calls ``check()`` before every non-empty :meth:`swap_out` is queued (after its pairs
        are validated): it raises to refuse the swap-out, which then changes nothing. How the
        tiered cache makes sure the host slots a step's swap-outs overwrite were copied out first
        (:meth:`pagedkv.tiers.TierCache.check_drained`)."""
        self._swap_out_checks.append(check)

    def host_written(self) -> None:
        """Blocks the host until every device-to-host transfer queued so far has landed in the
        host pool (a host slot read after it holds what the swap-outs wrote). No-op on the CPU."""
        if self._out_done is not None:
            self._out_done.synchronize()

    def host_read(self) -> None:
        """Blocks the host until every host-to-device transfer queued so far has read its host
        slots (they may then be overwritten). No-op on the CPU."""
        if self._in_done is not None:
            self._in_done.synchronize()


    def swap_out(self, pairs: PairsLike) -> int:
        """Copies device block ``d`` to host block ``h`` for each ``(d, h)``; returns the count.

        ``pairs``: ``[n, 2]`` or flat ``[2n]`` (the step buffers' ``swap_out`` layout), or a
        sequence of pairs. On CUDA the copies are queued on :attr:`out_stream`; call :meth:`wait`
        before anything writes the device blocks.

        Raises:
            InvalidBlockError: An id is outside its pool.
            InvalidArgumentError: Malformed pairs, or a host block appears twice.
            Whatever a check added by :meth:`add_swap_out_check` raises (nothing queued).
        """
        dev, host = self._pairs(pairs, self.pool.num_blocks, self.host.num_blocks, "device", "host")
        n = int(dev.size)
        if n == 0:
            return 0
        for check in self._swap_out_checks:
            check()
        order = np.argsort(host, kind="stable")
        dev, host = dev[order], host[order]
        if not self.is_cuda:
            self._host_blocks[torch.from_numpy(host)] = self._dev_blocks[torch.from_numpy(dev)]
            self.num_swapped_out += n
            return n
        caller = torch.cuda.current_stream(self.device)
        g, c = self._gather_stream, self.out_stream
        self._prune()
        g.wait_stream(caller)  # the blocks hold what the caller's queued forwards wrote
        stage, half = self._stage_out, self._half
        with torch.cuda.stream(g):
            dev_idx = torch.from_numpy(dev).to(self.device, non_blocking=True)
        copied = None
        gathered = None
        for i, c0 in enumerate(range(0, n, half)):
            c1 = min(n, c0 + half)
            part = i % 2
            buf = stage[part]
            if self._out_half_free[part] is not None:
                g.wait_event(self._out_half_free[part])  # the half's last chunk has left
            self._scatters.wait(g, self._dev_scattered[dev[c0:c1]])  # loads into these blocks
            with torch.cuda.stream(g):
                torch.index_select(self._dev_blocks, 0, dev_idx[c0:c1], out=buf[: c1 - c0])
            gathered, gseq = self._gathers.record(g)
            self._dev_gathered[dev[c0:c1]] = gseq
            c.wait_event(gathered)
            self._reads.wait(c, self._host_read[host[c0:c1]])  # loads still reading these slots
            with torch.cuda.stream(c):
                for a, b in consecutive_runs(host[c0:c1]):
                    h = int(host[c0 + a])
                    self._host_blocks[h:h + (b - a)].copy_(buf[a:b], non_blocking=True)
            copied, wseq = self._writes.record(c)
            self._host_written[host[c0:c1]] = wseq
            self._out_half_free[part] = copied
        self._out_done = copied
        self._pending.append(gathered)
        self.num_swapped_out += n
        return n

    def swap_in(self, pairs: PairsLike) -> int:
        """Copies host block ``h`` to device block ``d`` for each ``(h, d)``; returns the count.

        On CUDA the copies are queued on :attr:`in_stream`; call :meth:`wait` before anything
        reads the device blocks.

        Raises:
            InvalidBlockError: An id is outside its pool.
            InvalidArgumentError: Malformed pairs, or a device block appears twice.
        """
        host, dev = self._pairs(pairs, self.host.num_blocks, self.pool.num_blocks, "host", "device")
        n = int(dev.size)
        if n == 0:
            return 0
        order = np.argsort(host, kind="stable")
        dev, host = dev[order], host[order]
        if not self.is_cuda:
            self._dev_blocks[torch.from_numpy(dev)] = self._host_blocks[torch.from_numpy(host)]
            self.num_swapped_in += n
            return n
        caller = torch.cuda.current_stream(self.device)
        ld, sc = self._load_stream, self.in_stream
        self._prune()
        # Loads into blocks a swap-out is still gathering go in the order of those gathers, so
        # each chunk's scatter waits for the gathers of its own blocks, not for the last one
        # (the host runs, and so the transfers' sizes, are kept within each gather's share).
        pending = self._gathers.pending(self._dev_gathered[dev])
        if pending.any():
            order = np.lexsort((host, np.where(pending, self._dev_gathered[dev], -1)))
            dev, host = dev[order], host[order]
        # Queued forwards may still read a device block this overwrites (freed, then reallocated).
        sc.wait_stream(caller)
        stage, half = self._stage_in, self._half
        with torch.cuda.stream(sc):
            dev_idx = torch.from_numpy(dev).to(self.device, non_blocking=True)
        scattered = None
        loaded = None
        for i, c0 in enumerate(range(0, n, half)):
            c1 = min(n, c0 + half)
            part = i % 2
            buf = stage[part]
            if self._in_half_free[part] is not None:
                ld.wait_event(self._in_half_free[part])  # the half's last chunk is in the pool
            self._writes.wait(ld, self._host_written[host[c0:c1]])  # a swap-out's output
            with torch.cuda.stream(ld):
                for a, b in consecutive_runs(host[c0:c1]):
                    h = int(host[c0 + a])
                    buf[a:b].copy_(self._host_blocks[h:h + (b - a)], non_blocking=True)
            loaded, rseq = self._reads.record(ld)
            self._host_read[host[c0:c1]] = rseq
            sc.wait_event(loaded)
            # An evicted block reused here may still be read by a swap-out's gather.
            self._gathers.wait(sc, self._dev_gathered[dev[c0:c1]])
            with torch.cuda.stream(sc):
                self._dev_blocks.index_copy_(0, dev_idx[c0:c1], buf[: c1 - c0])
            scattered, sseq = self._scatters.record(sc)
            self._dev_scattered[dev[c0:c1]] = sseq
            self._in_half_free[part] = scattered
        self._in_done = loaded
        self._pending.append(scattered)
        self.num_swapped_in += n
        return n

    def _prune(self) -> None:
        for log in (self._gathers, self._scatters, self._writes, self._reads):
            log.prune()

    def wait(self, stream: Optional[Any] = None) -> None:
        """Makes ``stream`` (default: the current one) wait, on the GPU, until the device pool is
        consistent with every swap queued so far: swapped-out blocks gathered, swapped-in blocks
        written. The host is not blocked. No-op on the CPU and when nothing is pending."""
        if not self.is_cuda or not self._pending:
            return
        stream = stream or torch.cuda.current_stream(self.device)
        for ev in self._pending:
            stream.wait_event(ev)
        self._pending.clear()

    def synchronize(self) -> None:
        """Blocks the host until every queued swap, host transfers included, has finished."""
        if self.is_cuda:
            for st in (self._gather_stream, self.out_stream, self._load_stream, self.in_stream):
                st.synchronize()

    def __repr__(self) -> str:
        return (f"SwapEngine(device={self.device}, host_blocks={self.host.num_blocks}, "
                f"staging_blocks={self.staging_blocks})")


class _EventLog:
    """Events recorded in order on one stream, each with a number: a wait for entry ``k`` is a
    wait for every entry up to ``k`` (a stream runs its work in order). Entries that have
    completed are dropped (:meth:`prune`), so the log holds only what may still be running."""

    __slots__ = ("_events", "_base")

    def __init__(self) -> None:
        self._events: list = []
        self._base = 0  # number of _events[0]; every entry below it has completed

    def record(self, stream: Any) -> Tuple[Any, int]:
        ev = torch.cuda.Event()
        ev.record(stream)
        self._events.append(ev)
        return ev, self._base + len(self._events) - 1

    def prune(self) -> None:
        done = 0
        for ev in self._events:
            if not ev.query():
                break
            done += 1
        if done:
            del self._events[:done]
            self._base += done

    def pending(self, entries: np.ndarray) -> np.ndarray:
        """Which of ``entries`` may still be running (as of the last :meth:`prune`)."""
        return entries >= self._base

    def wait(self, stream: Any, entries: np.ndarray) -> None:
        """Makes ``stream`` wait for the latest of ``entries`` (numbers from :meth:`record`;
        -1 and completed entries need no wait)."""
        if entries.size == 0:
            return
        k = int(entries.max())
        if k >= self._base:
            stream.wait_event(self._events[k - self._base])


def consecutive_runs(sorted_ids: np.ndarray) -> List[Tuple[int, int]]:
    """``[(a, b), ...]``: index ranges of ascending ``sorted_ids`` holding consecutive ids (one
    copy per range moves a run of adjacent blocks)."""
    if sorted_ids.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(sorted_ids) != 1) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [sorted_ids.size]))
    return list(zip(starts.tolist(), ends.tolist()))
