"""One step's bookkeeping, from rank 0's block manager to every tensor-parallel rank, as one packet.

Owns :class:`StepBroadcaster`: a packet buffer allocated once (fixed address, fixed size) holding
everything a rank needs to run a step it did not schedule — a header of scalars (the command, a
step counter, the :class:`pagedkv.StepInfo` fields, the number of sampled rows) and, at fixed
offsets, the step tables (``slot_mapping``, ``block_tables``, ``seq_lens``, ``query_start_loc``,
the CSR page table when the buffers have one, the copy-on-write and swap lists) and the batch
(input ids, positions, sample rows). Rank 0 packs the used prefix of each field from its host
:class:`~pagedkv.buffers.StepBuffers` and broadcasts the whole packet with one collective; every
other rank unpacks it into its own step buffers. Each field of the packet is cut to the step's
extent exactly as :meth:`StepBuffers.views` cuts it, so a receiving rank's buffers then hold, in
the step's extent, the bytes of rank 0's (stale bytes past the extent are not carried).

KV cache groups: with buffers of ``G > 1`` groups (a model whose full layers sit beside sliding
or chunked ones), the packet also carries groups ``1..G-1``' own slot mappings and block tables
(:attr:`StepBuffers.groups_host`, what the runner's ``_group_tables`` cuts to the step; ``-1``
where a group released a block), each cut to the step's extent like group 0's (``num_tokens``
slots, ``num_seqs`` rows), and a receiver writes them into its own groups' buffers (the device
mirrors under NCCL, which is where the runner reads every group's tables). A one-group packet has
no group field: its layout, size and per-step work are those of a packet without groups.

Layout (each field on a 64-byte boundary)::

    header int64[16] | query_start_loc | copies | swap_out | swap_in | sample_rows   <- host part
                     | seq_lens | slot_mapping | block_tables | kv_indptr | kv_indices
                     | kv_last_page_len | input_ids | positions
                     | g1.slot_mapping | g1.block_tables | ... | g{G-1}.block_tables  <- device part

Why one fixed-size packet: a collective needs the same byte count on every rank, and only rank 0
knows the step's extent; a header-then-body exchange would be two collectives per step. The
packet's size is set by the buffers' capacities (for Llama-3-8B dimensions with 256 sequences of
8k tokens: about 0.6 MiB, dominated by the block tables), one broadcast per step. Each group after
the first adds its slot mapping and block tables at their capacities (about 0.5 MiB more at those
sizes): the packet grows with the number of groups, the number of collectives does not.

Transports:

* gloo (CPU): the packet is a CPU tensor; rank 0 packs into it, ``broadcast``, the other ranks
  copy its fields into their host buffers (which on the CPU are also the device mirrors).
* NCCL (GPU): rank 0 packs into a pinned host copy, moves it in one asynchronous copy to the
  device packet and broadcasts that over NCCL. Every rank (rank 0 included) then copies the device
  part into its step buffers' *device mirrors* and the runner's device ids/positions, device to
  device: the addresses CUDA graphs were captured on, so a replay on any rank reads this step's
  tables. The other ranks also copy the small host part (header, query offsets, copy and swap
  lists, sample rows: what the runner's host-side logic reads) back to their pinned packet; their
  host copies of the large tables are not written (nothing on the host reads them).

Invariants: the packet, its pinned copy and every destination keep their addresses for the
object's lifetime; rank 0 does not rewrite its pinned packet before the previous step's copy of it
to the device has completed; a step whose extent exceeds the buffers never reaches here (the
manager writes at most the buffers' capacities). A receiver checks every header word (magic, size,
sequence number, command, each count against its own buffers' capacity) before it writes anything
or advances its sequence number, and raises :class:`~pagedkv.errors.InvariantViolationError` on a
packet that fails (a packet for another number of KV cache groups included).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from ..buffers import StepBuffers
from .tp import TPGroup

__all__ = ["StepBroadcaster", "Received", "CMD_STEP", "CMD_END", "CMD_STOP", "MAGIC"]

#: Commands in the header. STEP: run the step in the packet. END: the driver's ``generate`` call
#: finished (launchers that run one script on every rank return from theirs). STOP: shut down.
CMD_STEP, CMD_END, CMD_STOP = 1, 2, 3
#: First header word; a packet without it is garbage (a rank out of step, or a different layout).
MAGIC = 0x706B7654_50000001

_H_MAGIC, _H_CMD, _H_SEQNO, _H_NSEQS, _H_NTOK, _H_NKVI, _H_NCOPY, _H_MAXLEN, _H_NOUT, _H_NIN, \
    _H_NROWS, _H_NBYTES, _H_MAXQ, _H_NGROUPS = range(14)
_HEADER_WORDS = 16
_ALIGN = 64

_HOST_FIELDS = ("query_start_loc", "copies", "swap_out", "swap_in", "sample_rows")
_DEVICE_FIELDS = ("seq_lens", "slot_mapping", "block_tables", "kv_indptr", "kv_indices",
                  "kv_last_page_len", "input_ids", "positions")
#: Fields that are step tables (in :class:`StepBuffers`); the rest are the batch.
_TABLE_FIELDS = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc", "kv_indptr",
                 "kv_indices", "kv_last_page_len", "copies", "swap_out", "swap_in")


def _group_fields(num_groups: int) -> tuple[tuple[int, str, str], ...]:
    """``(g, slot-mapping field, block-tables field)`` of each group ``1..num_groups-1`` in the
    packet (none with one group)."""
    return tuple((g, f"g{g}.slot_mapping", f"g{g}.block_tables") for g in range(1, num_groups))


class Received(NamedTuple):
    """What a receiving rank got: the command and, for a step, its extent and batch."""

    cmd: int
    seq_no: int
    info: Any  # pagedkv.StepInfo, or None for END/STOP
    input_ids: Optional[np.ndarray]
    positions: Optional[np.ndarray]
    sample_rows: Optional[np.ndarray]


def _extents(info: Any, csr: bool, n_rows: int) -> dict[str, int]:
    """Elements of each field's first axis used by a step (what ``StepBuffers.views`` cuts)."""
    s = int(info.num_seqs)
    c = 1 if csr else 0
    return {
        "slot_mapping": int(info.num_tokens), "block_tables": s, "seq_lens": s,
        "query_start_loc": s + 1, "kv_indptr": c * (s + 1),
        "kv_indices": int(info.num_kv_indices), "kv_last_page_len": c * s,
        "copies": int(info.num_copies), "swap_out": int(getattr(info, "num_swap_out", 0)),
        "swap_in": int(getattr(info, "num_swap_in", 0)), "input_ids": int(info.num_tokens),
        "positions": int(info.num_tokens), "sample_rows": n_rows,
    }


class StepBroadcaster:
    """Rank 0's step output into every rank's step buffers, one fixed packet per step.

    Args:
        buffers: This rank's step buffers (same capacities on every rank).
        group: The tensor-parallel group; its rank 0 sends.
        ids_dev, positions_dev: Under NCCL, the runner's device ids/positions buffers (int64,
            ``buffers.max_tokens`` long, fixed addresses) that the packet's batch is copied into.
    """

    def __init__(self, buffers: StepBuffers, group: TPGroup, *,
                 ids_dev: Optional[torch.Tensor] = None,
                 positions_dev: Optional[torch.Tensor] = None) -> None:
        self.buffers = buffers
        self.group = group
        self.is_sender = group.rank == 0
        self.on_device = group.device.type == "cuda"
        host = buffers.host
        shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
            name: (t.dtype, tuple(t.shape)) for name, t in host.items()
        }
        t_max = buffers.max_tokens
        shapes["input_ids"] = (torch.int64, (t_max,))
        shapes["positions"] = (torch.int64, (t_max,))
        shapes["sample_rows"] = (torch.int64, (buffers.max_seqs,))
        #: Groups ``1..G-1``' fields (empty with one group): ``(g, slot mapping, block tables)``.
        self.num_groups = int(getattr(buffers, "num_groups", 1))
        self._groups = _group_fields(self.num_groups)
        group_names: tuple[str, ...] = ()
        for g, sm, bt in self._groups:
            gt = buffers.groups_host[g - 1]
            shapes[sm] = (gt.slot_mapping.dtype, tuple(gt.slot_mapping.shape))
            shapes[bt] = (gt.block_tables.dtype, tuple(gt.block_tables.shape))
            group_names += (sm, bt)
        self._shapes = shapes
        offsets: dict[str, int] = {}
        off = _HEADER_WORDS * 8
        for name in _HOST_FIELDS + _DEVICE_FIELDS + group_names:
            off = -(-off // _ALIGN) * _ALIGN
            offsets[name] = off
            dtype, shape = shapes[name]
            off += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if name == _HOST_FIELDS[-1]:
                self.host_nbytes = -(-off // _ALIGN) * _ALIGN
        self.nbytes = -(-off // _ALIGN) * _ALIGN
        self.offsets = offsets
        #: The packet every rank's collective reads or writes (fixed address and size).
        self.packet = torch.zeros(self.nbytes, dtype=torch.uint8, device=group.device)
        if self.on_device:
            self.packet_host = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=True)
            self._h2d_done = torch.cuda.Event()
            self._h2d_pending = False
        else:
            self.packet_host = self.packet
        self._host_views = self._carve(self.packet_host)
        self._host_np = {k: v.numpy() for k, v in self._host_views.items()}
        self._header = self.packet_host[: _HEADER_WORDS * 8].view(torch.int64).numpy()
        self._dev_views = self._carve(self.packet) if self.on_device else self._host_views
        self.ids_dev = ids_dev
        self.positions_dev = positions_dev
        if self.on_device and (ids_dev is None or positions_dev is None):
            raise ValueError("the NCCL transport needs the runner's device ids and positions")
        self.seq_no = 0
        # The receiver's copies of the batch (fixed arrays, so a step's views do not alias the
        # packet the next broadcast overwrites).
        self._ids = np.zeros(t_max, dtype=np.int64)
        self._pos = np.zeros(t_max, dtype=np.int64)
        self._rows = np.zeros(buffers.max_seqs, dtype=np.int64)
        # Numpy views of groups 1..G-1' host tables (fixed, like the buffers).
        self._group_host_np = [(g.slot_mapping.numpy(), g.block_tables.numpy())
                               for g in buffers.groups_host]

    def _carve(self, arena: torch.Tensor) -> dict[str, torch.Tensor]:
        views = {}
        for name, off in self.offsets.items():
            dtype, shape = self._shapes[name]
            n = int(np.prod(shape, dtype=np.int64))
            views[name] = arena[off: off + n * dtype.itemsize].view(dtype).view(shape)
        return views

    # ---------------------------------------------------------------------------------- send

    def send_step(self, info: Any, input_ids: np.ndarray, positions: np.ndarray,
                  sample_rows: np.ndarray) -> None:
        """Rank 0: packs the step (its host step buffers, filled by ``manager.step``, and the batch)
        and broadcasts it. Under NCCL, also fills rank 0's own device mirrors from the packet."""
        self._wait_h2d()
        h = self._header
        h[:] = 0
        rows = np.asarray(sample_rows, dtype=np.int64).reshape(-1)
        h[_H_MAGIC], h[_H_CMD], h[_H_SEQNO] = MAGIC, CMD_STEP, self.seq_no
        h[_H_NSEQS], h[_H_NTOK] = info.num_seqs, info.num_tokens
        h[_H_NKVI], h[_H_NCOPY], h[_H_MAXLEN] = info.num_kv_indices, info.num_copies, \
            info.max_seq_len
        h[_H_NOUT] = getattr(info, "num_swap_out", 0)
        h[_H_NIN] = getattr(info, "num_swap_in", 0)
        h[_H_MAXQ] = getattr(info, "max_query_len", 0)
        h[_H_NROWS], h[_H_NBYTES] = rows.size, self.nbytes
        h[_H_NGROUPS] = self.num_groups
        ext = _extents(info, self.buffers.csr, rows.size)
        host = self.buffers.host
        dst = self._host_np
        for name in _TABLE_FIELDS:
            n = ext[name]
            if n:
                dst[name][:n] = getattr(host, name)[:n].numpy()
        if self._groups:
            t, s = ext["slot_mapping"], ext["block_tables"]
            for (_g, sm, bt), (src_sm, src_bt) in zip(self._groups, self._group_host_np):
                dst[sm][:t] = src_sm[:t]
                dst[bt][:s] = src_bt[:s]
        t = ext["input_ids"]
        dst["input_ids"][:t] = input_ids
        dst["positions"][:t] = positions
        dst["sample_rows"][: rows.size] = rows
        self._broadcast()
        if self.on_device:
            self._unpack_device(ext)
        self.seq_no += 1

    def send_command(self, cmd: int) -> None:
        """Rank 0: broadcasts an END or STOP command (no step)."""
        self._wait_h2d()
        h = self._header
        h[:] = 0
        h[_H_MAGIC], h[_H_CMD], h[_H_SEQNO], h[_H_NBYTES] = MAGIC, cmd, self.seq_no, self.nbytes
        h[_H_NGROUPS] = self.num_groups
        self._broadcast()
        self.seq_no += 1

    def _wait_h2d(self) -> None:
        if self.on_device and self._h2d_pending:
            # The previous step's asynchronous copy still reads the pinned packet.
            self._h2d_done.synchronize()
            self._h2d_pending = False

    def _broadcast(self) -> None:
        if self.on_device and self.is_sender:
            self.packet.copy_(self.packet_host, non_blocking=True)
            self._h2d_done.record()
            self._h2d_pending = True
        self.group.broadcast_(self.packet)

    # ---------------------------------------------------------------------------------- recv

    def recv(self) -> Received:
        """Every rank but 0: waits for rank 0's next packet and unpacks it into this rank's step
        buffers (and, under NCCL, device ids/positions); returns the command and the batch."""
        from ..buffers import StepInfo
        from ..errors import InvariantViolationError

        self.group.broadcast_(self.packet)
        if self.on_device:
            # The host part only: header, query offsets, copy/swap lists, sample rows.
            self.packet_host[: self.host_nbytes].copy_(self.packet[: self.host_nbytes])
        h = self._header
        if int(h[_H_MAGIC]) != MAGIC or int(h[_H_NBYTES]) != self.nbytes or (
                int(h[_H_SEQNO]) != self.seq_no):
            raise InvariantViolationError(
                f"tensor-parallel rank {self.group.rank}: step packet {int(h[_H_SEQNO])} "
                f"(magic {int(h[_H_MAGIC]):#x}, {int(h[_H_NBYTES])} bytes) where packet "
                f"{self.seq_no} of {self.nbytes} bytes was expected: ranks are out of step")
        if int(h[_H_NGROUPS]) != self.num_groups:
            n = int(h[_H_NGROUPS])
            raise InvariantViolationError(
                f"tensor-parallel rank {self.group.rank}: step packet {int(h[_H_SEQNO])} carries "
                f"{n} KV cache groups' tables, this rank's buffers hold {self.num_groups}",
                detail="KV cache groups differ", field="num_groups", value=n,
                limit=self.num_groups)
        self._check_counts(h)
        self.seq_no += 1
        cmd = int(h[_H_CMD])
        if cmd != CMD_STEP:
            return Received(cmd, int(h[_H_SEQNO]), None, None, None, None)
        info = StepInfo(int(h[_H_NSEQS]), int(h[_H_NTOK]), int(h[_H_NKVI]), int(h[_H_NCOPY]),
                        int(h[_H_MAXLEN]), int(h[_H_NOUT]), int(h[_H_NIN]), int(h[_H_MAXQ]))
        n_rows = int(h[_H_NROWS])
        ext = _extents(info, self.buffers.csr, n_rows)
        src = self._host_np
        t = info.num_tokens
        self._rows[:n_rows] = src["sample_rows"][:n_rows]
        host = self.buffers.host
        if self.on_device:
            self._unpack_device(ext)
            for name in ("query_start_loc", "copies", "swap_out", "swap_in"):
                n = ext[name]
                if n:
                    getattr(host, name)[:n].numpy()[:] = src[name][:n]
            ids = pos = None
        else:
            for name in _TABLE_FIELDS:
                n = ext[name]
                if n:
                    getattr(host, name)[:n].numpy()[:] = src[name][:n]
            s = ext["block_tables"]
            for (_g, sm, bt), (dst_sm, dst_bt) in zip(self._groups, self._group_host_np):
                dst_sm[:t] = src[sm][:t]
                dst_bt[:s] = src[bt][:s]
            self._ids[:t] = src["input_ids"][:t]
            self._pos[:t] = src["positions"][:t]
            ids, pos = self._ids[:t], self._pos[:t]
        return Received(CMD_STEP, int(h[_H_SEQNO]), info, ids, pos, self._rows[:n_rows])

    def _check_counts(self, h: np.ndarray) -> None:
        """Raises InvariantViolationError unless the header's command is known and every count
        fits this rank's buffers; nothing has been written or advanced yet when it raises.

        The header is trusted no further than the magic word: a count past a field's capacity
        would make the cuts below come out short (slicing clamps) and a negative one would cut
        from the end, so the step would run on tables of the wrong size.
        """
        from ..errors import InvariantViolationError

        cmd = int(h[_H_CMD])
        if cmd not in (CMD_STEP, CMD_END, CMD_STOP):
            raise InvariantViolationError(
                f"tensor-parallel rank {self.group.rank}: step packet {int(h[_H_SEQNO])} carries "
                f"command {cmd}, not one of {CMD_STEP} (step), {CMD_END} (end), {CMD_STOP} (stop)",
                detail="unknown command", field="command", value=cmd,
                limit=(CMD_STEP, CMD_END, CMD_STOP))
        if cmd != CMD_STEP:
            return
        sh = self._shapes
        n_tok = int(h[_H_NTOK])
        limits = (
            ("num_seqs", _H_NSEQS, self.buffers.max_seqs),
            ("num_tokens", _H_NTOK, sh["slot_mapping"][1][0]),
            ("num_kv_indices", _H_NKVI, sh["kv_indices"][1][0]),
            ("num_copies", _H_NCOPY, sh["copies"][1][0]),
            ("num_swap_out", _H_NOUT, sh["swap_out"][1][0]),
            ("num_swap_in", _H_NIN, sh["swap_in"][1][0]),
            ("num_sample_rows", _H_NROWS, sh["sample_rows"][1][0]),
            ("max_seq_len", _H_MAXLEN, 2**31 - 1),
            ("max_query_len", _H_MAXQ, max(n_tok, 0)),
        )
        for name, word, cap in limits:
            n = int(h[word])
            if not 0 <= n <= cap:
                raise InvariantViolationError(
                    f"tensor-parallel rank {self.group.rank}: step packet {int(h[_H_SEQNO])} "
                    f"has {name} = {n}, outside [0, {cap}] (what this rank's buffers hold)",
                    detail=f"{name} out of range", field=name, value=n, limit=cap)

    def _unpack_device(self, ext: dict[str, int]) -> None:
        # Device to device, on the current stream after the broadcast: into the fixed addresses
        # the CUDA graphs read.
        dev, src = self.buffers.device, self._dev_views
        for name in ("seq_lens", "query_start_loc", "slot_mapping", "block_tables", "kv_indptr",
                     "kv_indices", "kv_last_page_len"):
            n = ext[name]
            if n:
                getattr(dev, name)[:n].copy_(src[name][:n], non_blocking=True)
        t, s = ext["slot_mapping"], ext["block_tables"]
        for (g, sm, bt) in self._groups:
            gd = self.buffers.groups_device[g - 1]
            if t:
                gd.slot_mapping[:t].copy_(src[sm][:t], non_blocking=True)
            if s:
                gd.block_tables[:s].copy_(src[bt][:s], non_blocking=True)
        t = ext["input_ids"]
        self.ids_dev[:t].copy_(src["input_ids"][:t], non_blocking=True)
        self.positions_dev[:t].copy_(src["positions"][:t], non_blocking=True)

    def __repr__(self) -> str:
        return (f"StepBroadcaster(rank={self.group.rank}, nbytes={self.nbytes}, "
                f"host_nbytes={self.host_nbytes}, device={str(self.group.device)!r}"
                + (f", num_groups={self.num_groups})" if self.num_groups != 1 else ")"))
