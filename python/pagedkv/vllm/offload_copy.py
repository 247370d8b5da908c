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

**CPU tensors**: a copy is one indexed assignment per tensor (synchronous).

**CUDA tensors** (the swap engine's scheme, :mod:`pagedkv.tiers.host`): a store gathers its GPU
blocks into a device staging buffer laid out as host chunks in ascending chunk order (one indexed
copy per tensor, at device bandwidth), then moves each run of consecutive chunks with one
``copy_`` into pinned host memory; a load moves each run into staging and scatters from there
(one ``index_copy_`` per tensor). Stores and loads each have their own stream (the link's two
directions), each first waits for the work already queued on the caller's stream (which wrote,
or still reads, the GPU blocks) and for the jobs of the other direction still on its host chunks
(a load after the store that wrote them, a store after the load that reads them: the swap
engine's per-block rule, per chunk), and each transfer ends with an event that
:meth:`ChunkCopier.finished` polls and :meth:`ChunkCopier.wait` blocks on. A transfer larger than
the staging buffer goes through it in pieces, in order on its stream. A store writes whole host
chunks (the rows of the staging buffer), so a chunk a store enters part way has its other
sub-blocks undefined, as a freshly allocated chunk's are.

Invariants: the host pool's shape and address never change; every transfer is validated whole
(ids in range, counts consistent) before anything is queued, so a rejected one changes nothing;
results are reported once each, in submission order per direction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from pagedkv.errors import InvalidArgumentError, InvalidConfigError
from pagedkv.tiers.host import consecutive_runs

__all__ = ["ChunkCopier", "Finished", "DEFAULT_STAGING_BYTES"]

#: Device staging per direction when ``staging_chunks`` is not given.
DEFAULT_STAGING_BYTES = 256 * 2**20


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
    event: Any  # torch.cuda.Event or None (CPU: done at submit)


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
            :data:`DEFAULT_STAGING_BYTES` (at least 1).
        host: An existing ``[num_chunks, chunk_bytes]`` uint8 host tensor to use.

    Raises:
        InvalidConfigError: Inconsistent tensors, groups or sizes.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], group_tensors: Sequence[Sequence[int]],
                 *, blocks_per_chunk: int, num_chunks: int, pin_memory: Optional[bool] = None,
                 staging_chunks: Optional[int] = None,
                 host: Optional[torch.Tensor] = None) -> None:
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
        self.offsets: List[int] = []
        off = 0
        for pb in self.page_bytes:
            self.offsets.append(off)
            off += pb * blocks_per_chunk
        self.chunk_bytes = off
        self.is_cuda = self.device.type == "cuda"
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
        self.host = host
        #: Per tensor, the host pool as ``[num_chunks, blocks_per_chunk, page_bytes]`` (a view).
        self.host_sections = [
            host[:, o:o + self.bpc * pb].unflatten(1, (self.bpc, pb))
            for o, pb in zip(self.offsets, self.page_bytes)]
        self._jobs: Dict[str, List[_Job]] = {"store": [], "load": []}
        self._done: List[Finished] = []
        if self.is_cuda:
            if staging_chunks is None:
                staging_chunks = max(1, DEFAULT_STAGING_BYTES // max(1, self.chunk_bytes))
            staging_chunks = max(1, min(int(staging_chunks), max(1, num_chunks)))
            self.staging_chunks = staging_chunks
            self._stage = {d: torch.empty((staging_chunks, self.chunk_bytes), dtype=torch.uint8,
                                          device=self.device) for d in ("store", "load")}
            self._stage_sections = {
                d: [s[:, o:o + self.bpc * pb].unflatten(1, (self.bpc, pb))
                    for o, pb in zip(self.offsets, self.page_bytes)]
                for d, s in self._stage.items()}
            self._streams = {d: torch.cuda.Stream(self.device) for d in ("store", "load")}
            # Per chunk, the last store that wrote it and the last load that read it (a job's
            # number, -1: none), and the events of the jobs not yet reported finished: a load
            # waits for the stores still writing its chunks, a store for the loads still reading
            # its chunks, and nothing else (the two directions otherwise overlap).
            self._last = {d: np.full(max(num_chunks, 1), -1, dtype=np.int64)
                          for d in ("store", "load")}
            self._events: Dict[str, Dict[int, Any]] = {"store": {}, "load": {}}
            self._seq = 0
        else:
            self.staging_chunks = 0

    # ------------------------------------------------------------------ planning

    def plan(self, block_ids: Any, group_sizes: Sequence[int], block_indices: Sequence[int],
             chunk_ids: Any) -> List[Tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """Per group with blocks: ``(group, gpu_blocks, chunks, sub_blocks)``, one entry per
        block, after checking every id and count.

        Raises:
            InvalidArgumentError: Counts that do not add up, or an id out of range.
        """
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        chunks = np.asarray(chunk_ids, dtype=np.int64).reshape(-1)
        if len(group_sizes) != len(self.groups) or len(block_indices) != len(self.groups):
            raise InvalidArgumentError(
                f"invalid argument: {len(group_sizes)} group sizes and {len(block_indices)} "
                f"block indices for {len(self.groups)} groups", what="group_sizes",
                value=len(group_sizes), reason="one per KV cache group")
        if int(sum(group_sizes)) != blocks.size:
            raise InvalidArgumentError(
                f"invalid argument: group sizes add up to {int(sum(group_sizes))}, "
                f"{blocks.size} blocks given", what="group_sizes", value=int(sum(group_sizes)),
                reason="must add up to the block count")
        if blocks.size and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
            bad = int(blocks[(blocks < 0) | (blocks >= self.num_blocks)][0])
            raise InvalidArgumentError(
                f"invalid argument: GPU block {bad} out of range: the KV cache holds "
                f"{self.num_blocks} blocks", what="block_ids", value=bad,
                reason=f"must be in [0, {self.num_blocks})")
        if chunks.size and (chunks.min() < 0 or chunks.max() >= self.num_chunks):
            bad = int(chunks[(chunks < 0) | (chunks >= self.num_chunks)][0])
            raise InvalidArgumentError(
                f"invalid argument: host chunk {bad} out of range: the host pool holds "
                f"{self.num_chunks} chunks", what="chunk_ids", value=bad,
                reason=f"must be in [0, {self.num_chunks})")
        out = []
        b0 = c0 = 0
        for g, (n, first) in enumerate(zip(group_sizes, block_indices)):
            n = int(n)
            if n == 0:
                continue
            skip = int(first) % self.bpc
            logical = np.arange(skip, skip + n, dtype=np.int64)
            nc = -(-(skip + n) // self.bpc)
            if c0 + nc > chunks.size:
                raise InvalidArgumentError(
                    f"invalid argument: group {g} needs {nc} chunks from chunk {c0}; "
                    f"{chunks.size} given", what="chunk_ids", value=int(chunks.size),
                    reason="too few chunks for the blocks")
            out.append((g, blocks[b0:b0 + n], chunks[c0 + logical // self.bpc],
                        logical % self.bpc))
            b0 += n
            c0 += nc
        if c0 != chunks.size:
            raise InvalidArgumentError(
                f"invalid argument: {chunks.size} chunks given, the blocks fill {c0}",
                what="chunk_ids", value=int(chunks.size), reason="one chunk per block run")
        return out

    def _nbytes(self, plan: List[Tuple[int, np.ndarray, np.ndarray, np.ndarray]]) -> int:
        return sum(len(b) * sum(self.page_bytes[t] for t in self.groups[g])
                   for g, b, _, _ in plan)

    # ------------------------------------------------------------------ copies

    def store(self, job_id: int, block_ids: Any, group_sizes: Sequence[int],
              block_indices: Sequence[int], chunk_ids: Any) -> None:
        """Queues the copy of GPU blocks into host chunks (module docs)."""
        plan = self.plan(block_ids, group_sizes, block_indices, chunk_ids)
        t0 = time.perf_counter()
        ev = None
        if self.is_cuda:
            ev = self._cuda("store", plan)
        else:
            self._store_cpu(plan)
        self._jobs["store"].append(_Job(job_id, self._nbytes(plan), t0, ev))

    def load(self, job_id: int, chunk_ids: Any, block_ids: Any, group_sizes: Sequence[int],
             block_indices: Sequence[int]) -> None:
        """Queues the copy of host chunks into GPU blocks (module docs)."""
        plan = self.plan(block_ids, group_sizes, block_indices, chunk_ids)
        t0 = time.perf_counter()
        ev = None
        if self.is_cuda:
            ev = self._cuda("load", plan)
        else:
            self._load_cpu(plan)
        self._jobs["load"].append(_Job(job_id, self._nbytes(plan), t0, ev))

    def _cuda(self, direction: str, plan: List[Tuple[int, np.ndarray, np.ndarray, np.ndarray]]
              ) -> Any:
        """Queues one CUDA transfer after the other direction's jobs on its chunks; its event."""
        other = "load" if direction == "store" else "store"
        st = self._streams[direction]
        if not plan:  # nothing to move: done once the caller's queued work is
            st.wait_stream(torch.cuda.current_stream(self.device))
            ev = torch.cuda.Event()
            ev.record(st)
            return ev
        chunks = np.unique(np.concatenate([c for _, _, c, _ in plan]))
        if chunks.size:
            before = self._events[other].get(int(self._last[other][chunks].max()))
            if before is not None:
                st.wait_event(before)
        ev = self._store_cuda(plan) if direction == "store" else self._load_cuda(plan)
        self._seq += 1
        self._events[direction][self._seq] = ev
        if chunks.size:
            self._last[direction][chunks] = self._seq
        return ev

    def _store_cpu(self, plan: List[Tuple[int, np.ndarray, np.ndarray, np.ndarray]]) -> None:
        for g, blocks, chunks, subs in plan:
            b, c, s = (torch.from_numpy(a) for a in (blocks, chunks, subs))
            for t in self.groups[g]:
                self.host_sections[t][c, s] = self.rows[t][b]

    def _load_cpu(self, plan: List[Tuple[int, np.ndarray, np.ndarray, np.ndarray]]) -> None:
        for g, blocks, chunks, subs in plan:
            b, c, s = (torch.from_numpy(a) for a in (blocks, chunks, subs))
            for t in self.groups[g]:
                self.rows[t].index_copy_(0, b, self.host_sections[t][c, s])

    def _pieces(self, plan: List[Tuple[int, np.ndarray, np.ndarray, np.ndarray]]
                ) -> List[Tuple[np.ndarray, List[Tuple[int, np.ndarray, np.ndarray, np.ndarray]]]]:
        """Splits a plan into pieces of at most ``staging_chunks`` distinct chunks: each piece is
        its ascending chunk ids and, per group, its entries with ``chunks`` replaced by rows of
        the staging buffer."""
        all_chunks = np.unique(np.concatenate([c for _, _, c, _ in plan]))
        out = []
        for p0 in range(0, all_chunks.size, self.staging_chunks):
            ids = all_chunks[p0:p0 + self.staging_chunks]
            lo, hi = ids[0], ids[-1]
            part = []
            for g, blocks, chunks, subs in plan:
                m = (chunks >= lo) & (chunks <= hi)
                if m.any():
                    part.append((g, blocks[m], np.searchsorted(ids, chunks[m]), subs[m]))
            out.append((ids, part))
        return out

    def _indices(self, *arrays: np.ndarray) -> Tuple[torch.Tensor, ...]:
        """The index arrays on the device, in one pinned host-to-device copy on the current
        stream (pinned through torch's caching host allocator, which keeps the buffer until the
        copy has run)."""
        host = torch.from_numpy(np.stack(arrays)).pin_memory()
        return tuple(host.to(self.device, non_blocking=True).unbind(0))

    def _store_cuda(self, plan: List[Tuple[int, np.ndarray, np.ndarray, np.ndarray]]) -> Any:
        st = self._streams["store"]
        st.wait_stream(torch.cuda.current_stream(self.device))
        stage, sections = self._stage["store"], self._stage_sections["store"]
        with torch.cuda.stream(st):
            for ids, part in self._pieces(plan):
                for g, blocks, rows, subs in part:
                    b, r, s = self._indices(blocks, rows, subs)
                    for t in self.groups[g]:
                        sections[t][r, s] = self.rows[t].index_select(0, b)
                for a, z in consecutive_runs(ids):
                    c = int(ids[a])
                    self.host[c:c + z - a].copy_(stage[a:z], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(st)
        return ev

    def _load_cuda(self, plan: List[Tuple[int, np.ndarray, np.ndarray, np.ndarray]]) -> Any:
        st = self._streams["load"]
        st.wait_stream(torch.cuda.current_stream(self.device))
        stage, sections = self._stage["load"], self._stage_sections["load"]
        with torch.cuda.stream(st):
            for ids, part in self._pieces(plan):
                for a, z in consecutive_runs(ids):
                    c = int(ids[a])
                    stage[a:z].copy_(self.host[c:c + z - a], non_blocking=True)
                for g, blocks, rows, subs in part:
                    b, r, s = self._indices(blocks, rows, subs)
                    for t in self.groups[g]:
                        self.rows[t].index_copy_(0, b, sections[t][r, s])
            ev = torch.cuda.Event()
            ev.record(st)
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
