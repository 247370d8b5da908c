"""The bytes of pagedkv's vLLM offloading tier: a host pool of chunks and the copies to and from
vLLM's KV cache tensors. No vLLM import (the GPU benchmark runs this module without vLLM).

Owns :class:`ChunkCopier`. vLLM hands a worker its KV cache as a list of tensors, each
``[num_blocks, page_bytes]`` (block-major: one GPU block of one tensor is one contiguous row), and
per KV cache group the tensors its layers use. An offload *chunk* is ``blocks_per_chunk``
consecutive blocks of one group. The host pool keeps pagedkv's host-tier layout: one chunk is
one contiguous region holding the chunk's blocks of every tensor, tensor after tensor::

    host: [num_chunks, chunk_bytes] uint8,
    chunk_bytes = sum over tensors t of blocks_per_chunk * page_bytes[t]
    (section of t at offset off[t], sub-block j of t at off[t] + j * page_bytes[t])

so a run of consecutive chunk ids is one contiguous host region, and one DMA transfer.

A transfer names GPU block ids, per group how many (``group_sizes``) and the logical index of
the group's first block in its request (``block_indices``: the first chunk of a group may be
entered ``block_index % blocks_per_chunk`` sub-blocks in), and the chunk ids, group after group.

**Paths** (``path``). What costs time on CUDA is not the bytes but the number of operations: a
4096-token prompt of a 32-layer model is 256 blocks x 32 tensors = 8192 block-rows of 64 KiB,
and one DMA or one indexed copy per row (or per tensor) is launch-bound. The CUDA path moves a
transfer in a handful of large operations:

- ``"pipelined"`` (the path on CUDA): a store gathers its GPU blocks, every tensor of a group
  in one Triton launch (:mod:`pagedkv.vllm.offload_kernels`, 8-byte words, at device
  bandwidth), into a device staging slot laid out as host chunks in ascending chunk order, and
  moves each run of consecutive chunks with one DMA into the pinned pool, all of a slot's DMAs
  queued in one driver call (``cuMemcpyBatchAsync``, :mod:`pagedkv.vllm.offload_dma`; one
  ``copy_`` per run where the driver has no batched copy); a load is the mirror image (the DMAs
  into a slot, one scatter launch per group). The staging
  buffer (``staging_chunks`` per direction) is a ring of slots of at most :data:`PIECE_BYTES`;
  a transfer goes through it piece by piece, the gather (scatter) of one piece on its own stream
  overlapping the DMA of the one before, so a long transfer runs at the link's rate plus one
  piece's gather. What a transfer pays before its first DMA is kept small: the check of the
  transfer and its split into pieces are one call into the core
  (``_core.split_transfer``), which writes the kernel entries straight into a reused pinned
  buffer, they reach the device in one copy, and a load queues its first DMAs before that copy
  (they need no index).
- ``"indexed"`` (the path on CPU tensors): one indexed assignment per tensor, synchronous.

Measured and removed (docs/performance.md): the kernel writing and reading the pinned host pool
itself with no staging and no DMA (stores as fast as pipelined, loads at little over half the
link's rate: the SMs reading pinned memory over the link cannot keep it full), and per-tensor
indexed copies over bytes into one staging buffer before the DMAs (not overlapped: 64-73%).

Not built: per-layer strided copies (one ``copy_`` moving a run of blocks of one tensor). A
transfer's GPU blocks are scattered over the KV cache, so a run of host chunks is no run of GPU
blocks, and such copies would stay one per block and tensor.

``"pipelined"`` also runs on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``;
synchronous, the tests use that); ``path`` exists to choose it there.
``benches/gpu_vllm_offload.sh`` measures the CUDA path beside a plain pinned ``copy_`` of the
same bytes (docs/performance.md).

**Ordering (CUDA).** Stores and loads each have their own DMA stream (the link's two
directions), beside a gather and a scatter stream. A store's gather waits for the work already
queued on the caller's stream, which wrote the GPU blocks; a load's scatter into the GPU blocks
waits for it too, since that work may still read them. A store's host writes wait for the loads
still reading its host chunks, a load's host reads for the stores still writing them (the swap
engine's per-block rule, per chunk; the two directions otherwise overlap). Each transfer ends
with an event that :meth:`ChunkCopier.finished` polls and :meth:`ChunkCopier.wait` blocks on. A
store writes whole host chunks on the pipelined path (the rows of the staging buffer), so a
chunk a store enters part way has its other sub-blocks undefined, as a freshly allocated
chunk's are; the indexed path writes only the sub-blocks named.

Invariants: the host pool's shape and address never change; every transfer is validated whole
(ids in range, counts consistent) before anything is queued, so a rejected one changes nothing;
results are reported once each, in submission order per direction.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from pagedkv import _core
from pagedkv.errors import InvalidConfigError
from pagedkv.vllm.offload_dma import batch_dma

__all__ = ["ChunkCopier", "Finished", "DEFAULT_STAGING_BYTES", "PIECE_BYTES", "PATHS",
           "DEFAULT_CUDA_PATH"]

#: Device staging per direction when ``staging_chunks`` is not given.
DEFAULT_STAGING_BYTES = 256 * 2**20

#: The pipelined path's piece (one staging slot) at most: small enough that the first piece's
#: gather, which nothing overlaps, is short; large enough that a piece is a few long DMAs.
PIECE_BYTES = 32 * 2**20

#: The copy paths (module docs).
PATHS = ("pipelined", "indexed")

#: The path CUDA tensors get when ``path`` is not given.
DEFAULT_CUDA_PATH = "pipelined"

Plan = List[Tuple[int, np.ndarray, np.ndarray, np.ndarray]]


@dataclass
class Finished:
    """One transfer that has completed: its job id, bytes moved and seconds from submit."""

    job_id: int
    nbytes: int
    seconds: float


@dataclass
class _Job:
    job_id: int
    nbytes: int
    t0: float
    event: Any  # torch.cuda.Event or None (done at submit)


@dataclass
class _Pieces:
    """One transfer checked and split for the pipelined path by the core
    (``_core.split_transfer``; :meth:`ChunkCopier._split`).

    ``uniq``: its distinct chunk ids, ascending; with pieces of ``size`` chunks, piece ``p`` is
    ``uniq[p * size:(p + 1) * size]`` and row ``i`` of its staging slot is chunk
    ``uniq[p * size + i]``. ``runs``: ``[runs, 3]``
    (first chunk id, first row in its piece's slot, chunk count), consecutive ids inside one
    piece, one DMA each; piece ``p``'s are ``run_edges[p]:run_edges[p + 1]``. ``cols``: int64
    ``[3, n]`` kernel entries (GPU block, staging row, sub-block), in (piece, group) order;
    ``spans[p]``: piece ``p``'s ``(group, start, end)`` ranges of them.
    """

    uniq: np.ndarray
    runs: np.ndarray
    run_edges: List[int]
    spans: List[List[Tuple[int, int, int]]]
    cols: Optional[np.ndarray]
    n: int
    _addr: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]] = None

    @property
    def npieces(self) -> int:
        return len(self.run_edges) - 1

    def addresses(self, host_ptr: int, chunk_bytes: int) -> Tuple[np.ndarray, np.ndarray,
                                                                     np.ndarray]:
        """Per run, as uint64: its host address, its offset in its staging slot, its bytes."""
        if self._addr is None:
            cb = np.uint64(chunk_bytes)
            self._addr = (np.uint64(host_ptr) + self.runs[:, 0] * cb, self.runs[:, 1] * cb,
                          self.runs[:, 2] * cb)
        return self._addr


class _IndexBuffers:
    """Where one direction's kernel entries go to the device: pinned host buffers, each
    rewritten only once the transfer that used it has completed (its final event; a busy one is
    kept and a new one taken, so none is freed or rewritten while its copy may still be
    queued), and one device buffer, written and read only on the direction's kernel stream
    (stream order protects it). Saves the pinned allocation and the stacking copy a transfer
    would otherwise pay before its first launch. (Letting the kernels read the entries from the
    pinned buffer itself, with no copy, was measured and dropped: the reads over the link made
    the gathers and scatters two to three times slower.)"""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: List[Tuple[torch.Tensor, Any]] = []
        self._cur = -1
        self._dev: Optional[torch.Tensor] = None

    @staticmethod
    def _cap(n: int) -> int:
        return max(1024, 1 << max(0, int(n) - 1).bit_length())

    def host(self, n: int) -> np.ndarray:
        """A free pinned buffer of at least ``3 * n`` int64 values, as a flat array to fill;
        :meth:`upload` copies it to the device, :meth:`release` marks it busy until an event."""
        bufs = self._bufs
        for i, (buf, ev) in enumerate(bufs):
            if buf.numel() >= 3 * n and (ev is None or ev.query()):
                self._cur = i
                return buf.numpy()
        # None free and large enough: drop the free ones too small, keep the busy ones.
        self._bufs = [(b, e) for b, e in bufs if e is not None and not e.query()]
        buf = torch.empty(3 * self._cap(n), dtype=torch.int64, pin_memory=True)
        self._bufs.append((buf, None))
        self._cur = len(self._bufs) - 1
        return buf.numpy()

    def upload(self, n: int) -> Tuple[torch.Tensor, ...]:
        """The first ``3 * n`` values of the buffer :meth:`host` gave, copied to the device on
        the current stream: its three rows there."""
        buf, _ = self._bufs[self._cur]
        if self._dev is None or self._dev.numel() < 3 * n:
            self._dev = torch.empty(3 * self._cap(n), dtype=torch.int64, device=self.device)
        dev = self._dev[:3 * n]
        dev.copy_(buf[:3 * n], non_blocking=True)
        return dev[:n], dev[n:2 * n], dev[2 * n:]

    def release(self, event: Any) -> None:
        """The buffer :meth:`host` gave stays busy until ``event`` (the transfer's last)."""
        buf, _ = self._bufs[self._cur]
        self._bufs[self._cur] = (buf, event)

class _NoStream:
    """Stands in for a CUDA stream where copies are synchronous (CPU tensors)."""

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class ChunkCopier:
    """Copies KV blocks between vLLM-layout tensors and a host pool of chunks (module docs).

    Args:
        tensors: vLLM's KV cache tensors, each ``[num_blocks, page_bytes]`` (any dtype; viewed as
            bytes), all on one device, the same number of blocks each.
        group_tensors: Per KV cache group, the indices into ``tensors`` its layers use.
        blocks_per_chunk: GPU blocks per offload chunk (>= 1).
        num_chunks: Host chunks (>= 0).
        pin_memory: Page-locked host memory; None: when the tensors are on CUDA.
        staging_chunks: CUDA staging per direction, in chunks; None: as many as fit
            :data:`DEFAULT_STAGING_BYTES` (at least 1). The indexed path has none.
        host: An existing ``[num_chunks, chunk_bytes]`` uint8 host tensor to use.
        path: One of :data:`PATHS` (module docs); None: :data:`DEFAULT_CUDA_PATH` on CUDA,
            ``"indexed"`` on CPU. ``"pipelined"`` takes CPU tensors only under Triton's
            interpreter; ``"indexed"`` takes CPU tensors only.

    Raises:
        InvalidConfigError: Inconsistent tensors, groups or sizes, or a path these tensors
            cannot take.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], group_tensors: Sequence[Sequence[int]],
                 *, blocks_per_chunk: int, num_chunks: int, pin_memory: Optional[bool] = None,
                 staging_chunks: Optional[int] = None,
                 host: Optional[torch.Tensor] = None, path: Optional[str] = None) -> None:
        if not tensors:
            raise InvalidConfigError("no KV cache tensors", field="tensors", value=0,
                                     reason="at least one")
        for name, v, lo in (("blocks_per_chunk", blocks_per_chunk, 1),
                            ("num_chunks", num_chunks, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InvalidConfigError(f"{name} must be an integer >= {lo}, got {v!r}",
                                         field=name, value=v, reason=f"must be >= {lo}")
        self.device = tensors[0].device
        self.num_blocks = int(tensors[0].shape[0])
        self.rows: List[torch.Tensor] = []
        for i, t in enumerate(tensors):
            if t.device != self.device or int(t.shape[0]) != self.num_blocks:
                raise InvalidConfigError(
                    f"KV cache tensor {i}: {tuple(t.shape)} on {t.device}; tensor 0 has "
                    f"{self.num_blocks} blocks on {self.device}", field="tensors", value=i,
                    reason="same device and block count")
            if not t.is_contiguous():
                raise InvalidConfigError(f"KV cache tensor {i} is not contiguous",
                                         field="tensors", value=i, reason="contiguous")
            self.rows.append(t.view(torch.uint8).view(self.num_blocks, -1))
        self.page_bytes = [int(r.shape[1]) for r in self.rows]
        self.groups: List[List[int]] = []
        for g, ts in enumerate(group_tensors):
            ts = list(dict.fromkeys(int(t) for t in ts))
            bad = [t for t in ts if not 0 <= t < len(self.rows)]
            if bad:
                raise InvalidConfigError(
                    f"group {g} names tensor {bad[0]}; there are {len(self.rows)}",
                    field="group_tensors", value=bad[0], reason="tensor index out of range")
            self.groups.append(ts)
        self.bpc = blocks_per_chunk
        self.num_chunks = num_chunks
        #: Per group, whether it has tensors, and its bytes per block.
        self._has_tensors = [bool(ts) for ts in self.groups]
        self._group_bytes = [sum(self.page_bytes[t] for t in ts) for ts in self.groups]
        self.offsets: List[int] = []
        off = 0
        for pb in self.page_bytes:
            self.offsets.append(off)
            off += pb * blocks_per_chunk
        self.chunk_bytes = off
        self.is_cuda = self.device.type == "cuda"
        self.path = self._check_path(path)
        if pin_memory is None:
            pin_memory = self.is_cuda
        if host is None:
            host = torch.empty((max(num_chunks, 0), self.chunk_bytes), dtype=torch.uint8,
                               pin_memory=bool(pin_memory))
        elif tuple(host.shape) != (num_chunks, self.chunk_bytes) or host.dtype != torch.uint8:
            raise InvalidConfigError(
                f"host tensor {tuple(host.shape)} {host.dtype}; expected "
                f"({num_chunks}, {self.chunk_bytes}) uint8", field="host",
                value=tuple(host.shape), reason="shape mismatch")
        if self.path == "pipelined" and not host.is_contiguous():
            raise InvalidConfigError("host tensor is not contiguous", field="host",
                                     value=tuple(host.stride()), reason="contiguous")
        self.host = host
        #: Per tensor, the host pool as ``[num_chunks, blocks_per_chunk, page_bytes]`` (a view).
        self.host_sections = [
            host[:, o:o + self.bpc * pb].unflatten(1, (self.bpc, pb))
            for o, pb in zip(self.offsets, self.page_bytes)]
        self._jobs: Dict[str, List[_Job]] = {"store": [], "load": []}
        self._done: List[Finished] = []
        # Per chunk, the last store that wrote it and the last load that read it (a job's
        # number, -1: none), and the events of the jobs not yet reported finished: a load
        # waits for the stores still writing its chunks, a store for the loads still reading
        # its chunks, and nothing else (the two directions otherwise overlap).
        self._last = {d: np.full(max(num_chunks, 1), -1, dtype=np.int64)
                      for d in ("store", "load")}
        self._events: Dict[str, Dict[int, Any]] = {"store": {}, "load": {}}
        self._seq = 0
        names = ("store", "load", "gather", "scatter")
        if self.is_cuda:
            self._streams: Dict[str, Any] = {d: torch.cuda.Stream(self.device) for d in names}
        else:
            self._streams = {d: _NoStream() for d in names}
        self.staging_chunks = 0
        self._index: Optional[Dict[str, _IndexBuffers]] = None
        self.piece_chunks = 0
        #: The driver's batched copy (CUDA): each piece's DMAs in one call where available.
        self._batch = batch_dma()
        if self.path == "pipelined":
            self._init_kernel(staging_chunks)

    @property
    def dma(self) -> str:
        """How the CUDA path issues its DMAs: ``"batched"`` (one driver call per staging slot) or
        ``"copy_"`` (one per run of consecutive chunks); ``"none"`` off CUDA."""
        if not self.is_cuda:
            return "none"
        return "batched" if self._batch.available else "copy_"

    def _check_path(self, path: Optional[str]) -> str:
        if path is None:
            return DEFAULT_CUDA_PATH if self.is_cuda else "indexed"
        if path not in PATHS:
            raise InvalidConfigError(f"path must be one of {PATHS}, got {path!r}", field="path",
                                     value=path, reason="unknown path")
        interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
        ok = self.is_cuda or interpreted if path == "pipelined" else not self.is_cuda
        if not ok:
            raise InvalidConfigError(
                f"path {path!r} does not run on {self.device} tensors"
                + ("" if self.is_cuda or path == "indexed"
                   else " (outside Triton's interpreter, TRITON_INTERPRET=1)"),
                field="path", value=path, reason=f"not available on {self.device.type}")
        return path

    def _default_staging(self, staging_chunks: Optional[int]) -> int:
        if staging_chunks is None:
            staging_chunks = max(1, DEFAULT_STAGING_BYTES // max(1, self.chunk_bytes))
        return max(1, min(int(staging_chunks), max(1, self.num_chunks)))

    def _init_kernel(self, staging_chunks: Optional[int]) -> None:
        from pagedkv.vllm.offload_kernels import WORD_DTYPES, ChunkTable, word_bytes

        w = word_bytes(self.page_bytes, [r.data_ptr() for r in self.rows])
        self.word = w
        wdt = WORD_DTYPES[w]
        words = [r.view(wdt) for r in self.rows]
        self._kv_base = words[0]
        self._chunk_words = self.chunk_bytes // w
        page_w = [pb // w for pb in self.page_bytes]
        sec_w = [o // w for o in self.offsets]
        self._tables = [
            ChunkTable.build(self._kv_base, [words[t] for t in ts], [page_w[t] for t in ts],
                             [sec_w[t] for t in ts], self._chunk_words, w) if ts else None
            for ts in self.groups]
        total = self._default_staging(staging_chunks)
        piece = max(1, min(total // 2 if total >= 2 else 1,
                           PIECE_BYTES // max(1, self.chunk_bytes)))
        slots = max(1, total // piece)
        self.piece_chunks, self.staging_chunks = piece, slots * piece
        self._slots = slots
        stage = {d: torch.empty((slots, piece, self.chunk_bytes), dtype=torch.uint8,
                                device=self.device) for d in ("store", "load")}
        self._slot_bytes = {d: list(s.unbind(0)) for d, s in stage.items()}
        self._slot_words = {d: [s.view(wdt) for s in v] for d, v in self._slot_bytes.items()}
        self._slot_next = {"store": 0, "load": 0}
        #: Per direction, where the kernel entries go to the device (CUDA; None on CPU).
        self._index = ({d: _IndexBuffers(self.device) for d in ("store", "load")}
                       if self.is_cuda else None)
        # The last event that used each slot (a DMA out of it, a scatter out of it).
        self._slot_free: Dict[str, List[Any]] = {"store": [None] * slots,
                                                 "load": [None] * slots}

    # ------------------------------------------------------------------ planning

    def plan(self, block_ids: Any, group_sizes: Sequence[int], block_indices: Sequence[int],
             chunk_ids: Any) -> Plan:
        """Per group with tensors and blocks: ``(group, gpu_blocks, chunks, sub_blocks)``, one
        entry per block, after checking every id and count (the core's check, as for the
        pipelined path).

        Raises:
            InvalidArgumentError: Counts that do not add up, or an id out of range.
        """
        pcs = self._split(block_ids, group_sizes, block_indices, chunk_ids,
                          max(1, len(chunk_ids)), None)
        out = []
        if pcs.cols is not None:
            for g, a, z in (pcs.spans[0] if pcs.spans else []):
                rows = pcs.cols[1, a:z]
                out.append((g, pcs.cols[0, a:z], pcs.uniq[rows].astype(np.int64),
                            pcs.cols[2, a:z]))
        return out

    def _split(self, block_ids: Any, group_sizes: Sequence[int], block_indices: Sequence[int],
               chunk_ids: Any, size: int, index: Optional[_IndexBuffers]) -> _Pieces:
        """The transfer checked whole and split into pieces of at most ``size`` chunks by the
        core (``_core.split_transfer``: one call, no per-piece or per-group pass here), its
        kernel entries written straight into a pinned buffer of ``index`` where there is one.

        Raises:
            InvalidArgumentError: Counts that do not add up, or an id out of range.
        """
        n = len(block_ids)
        buf = index.host(n) if index is not None and n else np.empty(3 * n, dtype=np.int64)
        uniq, runs, run_edges, spans, m = _core.split_transfer(
            block_ids, group_sizes, block_indices, chunk_ids, self._has_tensors, self.bpc,
            self.num_blocks, self.num_chunks, size, buf)
        cols = buf[:3 * m].reshape(3, m) if m else None
        return _Pieces(uniq, runs, run_edges, spans, cols, m)

    # ------------------------------------------------------------------ copies

    def store(self, job_id: int, block_ids: Any, group_sizes: Sequence[int],
              block_indices: Sequence[int], chunk_ids: Any) -> None:
        """Queues the copy of GPU blocks into host chunks (module docs)."""
        self._submit("store", job_id, block_ids, group_sizes, block_indices, chunk_ids)

    def load(self, job_id: int, chunk_ids: Any, block_ids: Any, group_sizes: Sequence[int],
             block_indices: Sequence[int]) -> None:
        """Queues the copy of host chunks into GPU blocks (module docs)."""
        self._submit("load", job_id, block_ids, group_sizes, block_indices, chunk_ids)

    def _submit(self, direction: str, job_id: int, block_ids: Any, group_sizes: Sequence[int],
                block_indices: Sequence[int], chunk_ids: Any) -> None:
        t0 = time.perf_counter()
        ev = None
        if self.path == "indexed":
            plan = self.plan(block_ids, group_sizes, block_indices, chunk_ids)
            (self._store_cpu if direction == "store" else self._load_cpu)(plan)
            nbytes = sum(len(b) * self._group_bytes[g] for g, b, _, _ in plan)
        else:
            ev, nbytes = self._queue(direction, block_ids, group_sizes, block_indices, chunk_ids)
        self._jobs[direction].append(_Job(job_id, nbytes, t0, ev))

    # The stream helpers: on CPU tensors (the interpreter) streams are stand-ins, a copy runs at
    # once and a transfer has no event.

    def _caller(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.is_cuda else _NoStream()

    def _on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self.is_cuda else contextlib.nullcontext()

    def _record(self, stream: Any) -> Any:
        if not self.is_cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def _queue(self, direction: str, block_ids: Any, group_sizes: Sequence[int],
               block_indices: Sequence[int], chunk_ids: Any) -> Tuple[Any, int]:
        """Checks and queues one transfer after the other direction's jobs on its chunks; its
        event and byte count."""
        other = "load" if direction == "store" else "store"
        index = self._index[direction] if self._index is not None else None
        pcs = self._split(block_ids, group_sizes, block_indices, chunk_ids, self.piece_chunks,
                          index)
        nbytes = sum((z - a) * self._group_bytes[g] for sp in pcs.spans for g, a, z in sp)
        if not pcs.npieces:  # nothing to move: done once the caller's queued work is, recorded
            # on the stream that ends this direction's transfers (so it is also after them)
            last = "scatter" if direction == "load" else direction
            st = self._streams[last]
            st.wait_stream(self._caller())
            return self._record(st), nbytes
        chunks = pcs.uniq
        before = self._events[other].get(int(self._last[other][chunks].max()))
        run = self._store_pipelined if direction == "store" else self._load_pipelined
        ev = run(pcs, index, before)
        if index is not None and pcs.n:
            index.release(ev)
        self._seq += 1
        if ev is not None:
            self._events[direction][self._seq] = ev
        self._last[direction][chunks] = self._seq
        return ev, nbytes

    def _store_cpu(self, plan: Plan) -> None:
        for g, blocks, chunks, subs in plan:
            b, c, s = (torch.from_numpy(a) for a in (blocks, chunks, subs))
            for t in self.groups[g]:
                self.host_sections[t][c, s] = self.rows[t][b]

    def _load_cpu(self, plan: Plan) -> None:
        for g, blocks, chunks, subs in plan:
            b, c, s = (torch.from_numpy(a) for a in (blocks, chunks, subs))
            for t in self.groups[g]:
                self.rows[t].index_copy_(0, b, self.host_sections[t][c, s])

    def _dmas(self, stream: Any, pcs: _Pieces, p: int, buf: torch.Tensor,
              to_host: bool) -> None:
        """Queues on ``stream`` the copies of piece ``p`` between the staging rows ``buf`` and
        its host chunks (row ``i`` is the piece's ``i``-th chunk): one copy per run of
        consecutive chunks, all in one driver call where the driver has one
        (:mod:`pagedkv.vllm.offload_dma`), else one ``copy_`` each."""
        lo, hi = pcs.run_edges[p], pcs.run_edges[p + 1]
        if self.is_cuda and self._batch.available:
            host, rows, sizes = pcs.addresses(self.host.data_ptr(), self.chunk_bytes)
            rows = rows[lo:hi] + np.uint64(buf.data_ptr())
            host = host[lo:hi]
            dst, src = (host, rows) if to_host else (rows, host)
            if self._batch.copy(stream.cuda_stream, dst, src, sizes[lo:hi]):
                return
        for c, r, k in pcs.runs[lo:hi].tolist():
            if to_host:
                self.host[c:c + k].copy_(buf[r:r + k], non_blocking=True)
            else:
                buf[r:r + k].copy_(self.host[c:c + k], non_blocking=True)

    def _upload(self, pcs: _Pieces, index: Optional[_IndexBuffers]) -> Tuple[torch.Tensor, ...]:
        """The kernel entries of ``pcs`` on the device (``blocks``, ``rows``, ``subs``), in one
        copy on the current stream from its pinned index buffer (CUDA)."""
        if pcs.cols is None:
            e = torch.empty(0, dtype=torch.int64, device=self.device)
            return e, e, e
        if index is None:
            return tuple(torch.from_numpy(pcs.cols).unbind(0))
        return index.upload(pcs.n)

    def _launch(self, idx: Tuple[torch.Tensor, ...], spans: List[Tuple[int, int, int]],
                chunk_base: torch.Tensor, to_chunks: bool) -> None:
        from pagedkv.vllm.offload_kernels import copy_chunks

        b, r, s = idx
        for g, a, z in spans:
            table = self._tables[g]
            assert table is not None
            copy_chunks(table, self._kv_base, chunk_base, b[a:z], r[a:z], s[a:z],
                        self._chunk_words, to_chunks=to_chunks)

    # -- pipelined: gather into a staging slot, DMA out; DMA into a slot, scatter

    def _store_pipelined(self, pcs: _Pieces, index: Optional[_IndexBuffers], before: Any) -> Any:
        gs, cs = self._streams["gather"], self._streams["store"]
        gs.wait_stream(self._caller())  # the blocks hold what the caller's queued work wrote
        if before is not None:
            cs.wait_event(before)  # loads still reading these host chunks
        with self._on(gs):
            idx = self._upload(pcs, index)
        ev = None
        for p in range(pcs.npieces):
            slot = self._slot_next["store"]
            self._slot_next["store"] = (slot + 1) % self._slots
            free = self._slot_free["store"][slot]
            if free is not None:
                gs.wait_event(free)  # the slot's last piece has left
            with self._on(gs):
                self._launch(idx, pcs.spans[p], self._slot_words["store"][slot], True)
            gathered = self._record(gs)
            if gathered is not None:
                cs.wait_event(gathered)
            with self._on(cs):
                self._dmas(cs, pcs, p, self._slot_bytes["store"][slot], to_host=True)
            ev = self._record(cs)
            self._slot_free["store"][slot] = ev
        return ev

    def _load_pipelined(self, pcs: _Pieces, index: Optional[_IndexBuffers], before: Any) -> Any:
        ls, ss = self._streams["load"], self._streams["scatter"]
        if before is not None:
            ls.wait_event(before)  # stores still writing these host chunks
        ss.wait_stream(self._caller())  # queued work may still read the blocks this overwrites
        idx: Optional[Tuple[torch.Tensor, ...]] = None
        ev = None
        for p in range(pcs.npieces):
            slot = self._slot_next["load"]
            self._slot_next["load"] = (slot + 1) % self._slots
            free = self._slot_free["load"][slot]
            if free is not None:
                ls.wait_event(free)  # the slot's last piece is in the KV cache
            with self._on(ls):
                self._dmas(ls, pcs, p, self._slot_bytes["load"][slot], to_host=False)
            if idx is None:  # after the first DMAs are queued: they need no index
                with self._on(ss):
                    idx = self._upload(pcs, index)
            loaded = self._record(ls)
            if loaded is not None:
                ss.wait_event(loaded)
            with self._on(ss):
                self._launch(idx, pcs.spans[p], self._slot_words["load"][slot], False)
            ev = self._record(ss)
            self._slot_free["load"][slot] = ev
        return ev

    # ------------------------------------------------------------------ completion

    def finished(self) -> List[Finished]:
        """The transfers completed since the last call, each once (per direction in order)."""
        out, self._done = self._done, []
        now = time.perf_counter()
        for jobs in self._jobs.values():
            k = 0
            while k < len(jobs) and (jobs[k].event is None or jobs[k].event.query()):
                j = jobs[k]
                out.append(Finished(j.job_id, j.nbytes, now - j.t0))
                k += 1
            del jobs[:k]
        if self.is_cuda:
            for events in self._events.values():
                for seq in [q for q, ev in events.items() if ev.query()]:
                    del events[seq]
        return out

    def wait(self, job_ids: Any) -> None:
        """Blocks until the named transfers (and those queued before them) have completed."""
        want = set(job_ids)
        for jobs in self._jobs.values():
            last = None
            for j in jobs:
                if j.job_id in want and j.event is not None:
                    last = j.event
            if last is not None:
                last.synchronize()

    def synchronize(self) -> None:
        """Blocks until every queued transfer has completed."""
        if self.is_cuda:
            for st in self._streams.values():
                st.synchronize()
