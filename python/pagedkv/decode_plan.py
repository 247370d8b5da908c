"""The decode planner's host side: `DecodePlan`, the Python face of `rust/core/src/decode_plan.rs`.

Owns the split-K work list of a ragged decode batch as the host builds it: the pinned,
double-buffered host words the core's planner (`_core.plan_decode`) writes each step, the one
non-blocking copy into the device buffers and the event that guards their reuse, and the numpy
reference `plan_host` the core is tested against. The device buffers and the layout the kernels
read are `pagedkv.kernels.DecodePlanBuffers`, which `DecodePlan` extends: the kernels package
takes only device tensors and never imports the extension; this module needs the extension and
torch.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import _core
from .kernels import _validate as v
from .kernels.decode import MAX_SEQ_CAP, DecodePlanBuffers, decode_config, num_sms

__all__ = ["DecodePlan", "PLAN_PROGRAMS_PER_SM", "PLAN_MIN_CHUNK"]


#: Planner knobs (see `DecodePlan`): programs per SM the plan aims at for a full batch of
#: chunks, and the shortest chunk worth its setup and merge traffic.
PLAN_PROGRAMS_PER_SM = 4
PLAN_MIN_CHUNK = 256
#: Item end that means "to the end of the sequence" (the kernel clamps it to the real length).
_TO_END = (1 << 31) - 1


class DecodePlan(DecodePlanBuffers):
    """Split-K work list for a decode batch, planned on the host from the real lengths.

    `paged_decode` without a plan splits every sequence of a batch the same way, sized for the
    longest possible one, which leaves a ragged batch's longest sequence on a few programs while
    the rest of the GPU idles. A plan cuts each sequence into chunks of one common size, chosen
    from the batch's total tokens so the whole batch is about `programs` (sequence-chunk, kv
    head) programs: long sequences get many chunks, short ones one. Chunks are launched heaviest
    first; a sequence of one chunk writes its output directly, the pieces of the others are
    merged by a second kernel. (FlashInfer's decode planner balances its grid the same way.)

    Use: build once (it owns its device buffers and the fp32 partials, sized for the worst
    case), call `update(host_seq_lens)` each step before the decode calls — every layer's
    `paged_decode(..., plan=plan)` then reuses it — and pass `plan=` instead of a workspace.
    `update` fills a pinned host buffer and enqueues one non-blocking copy on the current stream,
    so it is ordered before the kernels that read it, CUDA-graph replays included. The device
    buffers and their layout are those of `pagedkv.kernels.DecodePlanBuffers`; this class adds
    the host side (the pinned buffers, their events, the call into the core).

    CUDA graphs: a call captured with a plan uses the fixed grid `capacity * kv_heads` (programs
    past the plan's item count exit at once), so a graph captured once serves any later plan of
    the same batch size; call `update` before each replay.

    Correctness never depends on the plan matching the device lengths: each sequence's last
    chunk runs to its real (device) length and a chunk past it is empty, so a stale or wrong
    plan only costs balance. A plan must be built for the call's batch size (`num_seqs`).
    """

    def __init__(
        self,
        max_num_seqs: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        device,
        programs: Optional[int] = None,
        min_chunk: int = PLAN_MIN_CHUNK,
    ):
        v.check_int("max_num_seqs", max_num_seqs, 1, 1 << 24)
        v.check_int("num_q_heads", num_q_heads, 1)
        v.check_int("num_kv_heads", num_kv_heads, 1)
        v.check_int("head_dim", head_dim, 1)
        v.check_int("min_chunk", min_chunk, 1, MAX_SEQ_CAP)
        if num_q_heads % num_kv_heads:
            raise v.KernelShapeError(
                f"num_q_heads: is {num_q_heads}, expected a multiple of num_kv_heads "
                f"({num_kv_heads})"
            )
        dev = torch.device(device)
        if programs is None:
            programs = PLAN_PROGRAMS_PER_SM * num_sms(dev)
        v.check_int("programs", programs, 1, 1 << 24)
        # chunk >= total * kv_heads / programs, so sum(max(1, ceil(len / chunk))) <= n + programs
        # / kv_heads: the capacity never overflows.
        capacity = max_num_seqs + -(-programs // num_kv_heads) + 1
        super().__init__(max_num_seqs, num_q_heads, num_kv_heads, head_dim, capacity, device=dev)
        self.programs = programs
        self.tile = decode_config(head_dim, num_q_heads // num_kv_heads, None)["TILE_N"]
        self.min_chunk = min_chunk
        # Chunks are whole tiles (the kernel's loop step), unless the caller asks for less.
        self.granule = min(self.tile, min_chunk)
        words = self.meta.shape[0]
        pin = self.device.type == "cuda"
        self._host = [torch.zeros(words, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        self._events = [None, None]
        self._turn = 0

    def plan_host(self, lens) -> tuple:
        """(chunk, items [n_items, 4] (seq, start, end, partial row or -1), indptr [n + 1]) for
        the lengths `lens`, in launch order (heaviest first). Pure host arithmetic.

        The readable reference: `update` runs the same arithmetic in the Rust core
        (`_core.plan_decode`, `rust/core/src/decode_plan.rs`), which writes exactly these
        values into the host buffer (tests/test_decode_plan_core.py)."""
        lens = np.clip(np.asarray(lens, dtype=np.int64), 0, MAX_SEQ_CAP)
        n = lens.shape[0]
        total = int(lens.sum())
        chunk = -(-total * self.num_kv_heads // self.programs)
        chunk = max(self.min_chunk, -(-chunk // self.granule) * self.granule)
        longest = int(lens.max()) if n else 0
        if longest > chunk:
            # Round the chunk up so the longest sequence splits into equal pieces (4096 tokens
            # with a 4032-token chunk would be 4032 + 64); a larger chunk only means fewer items.
            p = longest // chunk
            chunk = -(-(-(-longest // p)) // self.granule) * self.granule
        pieces = np.maximum(1, -(-lens // chunk))
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(pieces, out=indptr[1:])
        n_items = int(indptr[-1])
        if n_items == n:
            # Nothing to split: one item per sequence, longest first, written directly.
            order = np.argsort(-lens, kind="stable")
            items = np.empty((n, 4), dtype=np.int64)
            items[:, 0] = order
            items[:, 1] = 0
            items[:, 2] = _TO_END
            items[:, 3] = -1
            return chunk, items, indptr
        seq = np.repeat(np.arange(n), pieces)
        k = np.arange(n_items) - indptr[seq]
        start = k * chunk
        end = start + chunk
        end[indptr[1:] - 1] = _TO_END  # each sequence's last piece runs to its real end
        row = np.arange(n_items)
        row[pieces[seq] == 1] = -1
        work = np.minimum(end, lens[seq]) - start
        order = np.argsort(-work, kind="stable")
        items = np.stack([seq, start, end, row], axis=1)[order]
        return chunk, items, indptr

    def update(self, seq_lens, num_seqs: Optional[int] = None) -> "DecodePlan":
        """Plans the next decode calls from host lengths (`seq_lens`: a sequence of ints, numpy
        array or CPU tensor; the first `num_seqs`, default all, are the batch). Returns self."""
        if isinstance(seq_lens, torch.Tensor):
            if seq_lens.device.type != "cpu":
                raise v.KernelDeviceError(
                    f"seq_lens: is on {seq_lens.device}, expected the host copy (cpu): the plan "
                    f"is built on the host"
                )
            seq_lens = seq_lens.numpy()
        lens = np.asarray(seq_lens)
        if lens.ndim != 1:
            raise v.KernelShapeError(f"seq_lens: has {lens.ndim} dimensions, expected 1")
        n = lens.shape[0] if num_seqs is None else v.check_int("num_seqs", num_seqs, 0)
        if n > lens.shape[0] or n > self.max_num_seqs:
            raise v.KernelShapeError(
                f"num_seqs: is {n}, expected at most {min(lens.shape[0], self.max_num_seqs)} "
                f"(lengths given, plan capacity)"
            )
        if lens.dtype.kind not in "iu":
            lens = lens.astype(np.int64)  # as plan_host reads them (bools, floats truncated)
        # Double-buffered host side: the buffer written now was last copied two updates ago;
        # wait for that copy (normally long done) before overwriting it.
        t = self._turn
        ev = self._events[t]
        if ev is not None:
            ev.synchronize()
        # The core writes what plan_host's arrays would (count, indptr, items), checking every
        # bound before its first store: 0.7-4.5 us for 1-256 sequences where numpy took 32-47
        # (benches/bench_decode_plan.py).
        m, chunk = _core.plan_decode(
            lens[:n], self._host_np[t], self.num_kv_heads, self.programs, self.min_chunk,
            self.granule, self.items_off, self.capacity,
        )
        used = self.items_off + 4 * m
        if self.device.type == "cuda":
            self.meta[:used].copy_(self._host[t][:used], non_blocking=True)
            ev = self._events[t] or torch.cuda.Event()
            ev.record()
            self._events[t] = ev
        else:
            self.meta[:used].copy_(self._host[t][:used])
        self._turn = 1 - t
        self.num_seqs, self.num_items, self.chunk = n, m, chunk
        return self
