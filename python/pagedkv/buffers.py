"""Step buffers: the host tensors the manager fills each step, and their device mirrors.

Owns the memory that carries one scheduler step's bookkeeping to the GPU (``B`` is the block size):

- ``slot_mapping`` int64 ``[max_tokens]``: ``table[p // B] * B + p % B`` for each new token ``p``;
- ``block_tables`` int32 ``[max_seqs, max_blocks_per_seq]``: one row per sequence, batch order;
- ``seq_lens`` int32 ``[max_seqs]``: tokens per sequence, new ones included;
- ``query_start_loc`` int32 ``[max_seqs + 1]``: prefix sums of the new tokens per sequence;
- ``kv_indptr`` int32 ``[max_seqs + 1]``, ``kv_indices`` int32 ``[max_seqs * max_blocks_per_seq]``,
  ``kv_last_page_len`` int32 ``[max_seqs]``: the FlashInfer CSR page table (row offsets, block ids,
  tokens in each last block); optional (``csr=False`` leaves the three empty and unwritten);
- ``copies`` int64 ``[max_copies, 2]``: pending copy-on-write ``(src, dst)`` block pairs.

Invariants:

* Everything is allocated once, in :class:`StepBuffers`'s constructor, and never reallocated: every
  tensor's ``data_ptr()`` is fixed for the object's lifetime, which is what CUDA graphs need.
* The host tensors live in one contiguous arena that the extension allocates and owns
  (``_core.StepArena``), pinned with ``cudaHostRegister`` when CUDA is available so host-to-device
  copies can be asynchronous; each field starts on a 64-byte boundary. Python holds only views of it
  (numpy arrays whose base is the arena, and tensors over them): their storage cannot be freed or
  resized (``resize_`` raises), and the arena lives while any view or any manager refers to it.
  That is what makes it safe for the manager to write it with the GIL released.
* One buffer set belongs to one manager at a time (:meth:`pagedkv.BlockManager.attach_buffers`).
* The device mirrors have the same shapes and dtypes, in one arena on ``device``. Without a device
  (no CUDA, or ``device="cpu"``) the device mirrors *are* the host tensors and
  :meth:`StepBuffers.to_device` copies nothing.

Stale data: a step writes only what it uses. Columns of a block-table row past the sequence's block
count, rows past the batch, and elements of every other buffer past the step's extent keep whatever
an earlier step left there. Kernels must read only ``ceil(seq_lens[i] / B)`` entries of row ``i``
and only the first ``num_seqs`` rows; :meth:`StepBuffers.views` returns tensors cut to the step's
extent for code that wants no stale elements in sight. The device mirrors are updated the same way
(:meth:`StepBuffers.to_device` copies only the used prefix of each field), so they too hold stale
data past the step's extent — padding rows of a CUDA graph captured at a larger batch included.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Iterator, NamedTuple, Optional, Union

import torch

from . import _core
from ._checks import allocate, check_flag, parse_device

if TYPE_CHECKING:
    from .manager import StepInfo

__all__ = ["StepBuffers", "StepTensors"]

# Field placement (arena order: the small per-sequence fields first, the large tables last, each on
# its own 64-byte line) is the extension's (`_core.StepArena.fields()`), so the two never disagree.

# Used parts separated by at most this many unused bytes are moved in one copy: a host-to-device
# copy costs several microseconds to issue, the time to move about this many bytes more.
_COALESCE_GAP = 128 * 1024


class StepTensors(NamedTuple):
    """The eight step tensors, all on one device (host, or the device mirror).

    A named tuple rather than a dataclass: one is built per step by :meth:`StepBuffers.views`, and
    a tuple is several times cheaper to build.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    copies: torch.Tensor

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields ``(name, tensor)`` for every field, in declaration order."""
        return zip(self._fields, self)




def _check_dim(name: str, value: int, minimum: int) -> int:
    from .errors import InvalidArgumentError

    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(
            f"invalid argument: {name} = {value!r}: must be an int",
            what=name,
            value=value,
            reason="must be an int",
        )
    if value < minimum:
        reason = f"must be at least {minimum}"
        raise InvalidArgumentError(
            f"invalid argument: {name} = {value}: {reason}", what=name, value=value, reason=reason
        )
    return value


class StepBuffers:
    """Host step buffers and their device mirrors, allocated once at fixed addresses.

    Attach to a manager with :meth:`pagedkv.BlockManager.attach_buffers`; each
    :meth:`pagedkv.BlockManager.step` then fills :attr:`host`, and :meth:`to_device` moves the used
    part to :attr:`device`. One buffer set belongs to one manager at a time. Do not read or write
    :attr:`host` while a step on another thread is filling it.

    Args:
        max_seqs: Most sequences in one step (rows of ``block_tables``).
        max_tokens: Most new tokens in one step (length of ``slot_mapping``).
        max_blocks_per_seq: Width of a block-table row; must be at least the manager's
            ``max_blocks_per_seq`` for every sequence to fit.
        max_copies: Most pending copy-on-write pairs one step can carry; defaults to ``max_seqs``
            (each sequence copies at most its tail block per step).
        device: Where the mirrors live. ``None`` picks ``"cuda"`` when available and otherwise keeps
            no mirror; ``"cpu"`` also keeps none (the mirrors are the host tensors).
        csr: Allocate the FlashInfer CSR page table (``kv_indptr``, ``kv_indices``,
            ``kv_last_page_len``). Without it those three tensors are empty and each step skips
            writing them (about half of what a decode step writes); kernels that read the block
            tables do not need them.

    Raises:
        InvalidArgumentError: A size is not a positive int (``max_copies`` may be 0), ``csr`` is not
            a bool, or ``device`` is not ``cpu`` or an available CUDA device.
        AllocationFailedError: The host arena, its pinning or the device mirror could not be had.
    """

    def __init__(
        self,
        max_seqs: int,
        max_tokens: int,
        max_blocks_per_seq: int,
        *,
        max_copies: Optional[int] = None,
        device: Union[str, torch.device, None] = None,
        csr: bool = True,
    ) -> None:
        self.max_seqs = _check_dim("max_seqs", max_seqs, 1)
        self.max_tokens = _check_dim("max_tokens", max_tokens, 1)
        self.max_blocks_per_seq = _check_dim("max_blocks_per_seq", max_blocks_per_seq, 1)
        self.max_copies = _check_dim(
            "max_copies", max_seqs if max_copies is None else max_copies, 0
        )
        self.csr = check_flag("csr", csr)
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu") if device is None else (
            parse_device(device)
        )
        cuda = torch.cuda.is_available()

        # The host memory is the extension's (`_core.StepArena`): the manager writes it with the
        # GIL released, so Python must not be able to free, move or resize it. Python sees it only
        # through a numpy array whose base is the arena, wrapped by `torch.from_numpy` (a storage
        # torch refuses to resize); every view, and every manager it is attached to, keeps the
        # arena alive.
        self._arena = _core.StepArena(
            self.max_seqs, self.max_tokens, self.max_blocks_per_seq, self.max_copies, self.csr
        )
        self.nbytes = self._arena.nbytes
        self._offsets: dict[str, int] = {
            name: off for name, (off, _) in self._arena.fields().items()
        }
        if cuda:
            # Page-locked, so host-to-device copies can be asynchronous. Unpinned when freed, after
            # the mirror's device has finished any copy still reading it.
            sync_dev = dev if dev.type == "cuda" else None
            self._arena.pin(torch.cuda.cudart(), functools.partial(torch.cuda.synchronize, sync_dev))
        self.pinned = self._arena.pinned
        shapes = self._shapes()
        # Zeroed by the extension: stale data is then at least deterministic before the first step.
        self._host_arena = torch.from_numpy(self._arena.array())
        self.host = self._carve(self._host_arena, shapes)
        if dev.type == "cpu":
            self._device_arena = self._host_arena
            self.device = self.host
            self.has_mirror = False
        else:
            total = self.nbytes
            self._device_arena = allocate(
                f"step buffers (device mirror on {dev})",
                total,
                lambda: torch.zeros(total, dtype=torch.uint8, device=dev),
            )
            self.device = self._carve(self._device_arena, shapes)
            self.has_mirror = True
        self.mirror_device = dev
        # Per field, the last (length, full tensor, view) that `views` cut, for host and device.
        self._cuts: dict[bool, list[Optional[tuple[int, torch.Tensor, torch.Tensor]]]] = {
            False: [None] * 8,
            True: [None] * 8,
        }

    def _shapes(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        s, b = self.max_seqs, self.max_blocks_per_seq
        c = 1 if self.csr else 0
        return {
            "slot_mapping": (torch.int64, (self.max_tokens,)),
            "block_tables": (torch.int32, (s, b)),
            "seq_lens": (torch.int32, (s,)),
            "query_start_loc": (torch.int32, (s + 1,)),
            "kv_indptr": (torch.int32, (c * (s + 1),)),
            "kv_indices": (torch.int32, (c * s * b,)),
            "kv_last_page_len": (torch.int32, (c * s,)),
            "copies": (torch.int64, (self.max_copies, 2)),
        }

    def _carve(
        self, arena: torch.Tensor, shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    ) -> StepTensors:
        views = {}
        for name, (dtype, shape) in shapes.items():
            off = self._offsets[name]
            n = 1
            for d in shape:
                n *= d
            views[name] = arena[off : off + n * dtype.itemsize].view(dtype).view(shape)
        return StepTensors(**views)

    def views(self, info: StepInfo, *, on_device: bool = True) -> StepTensors:
        """The tensors cut to one step's extent (views, no copies; addresses as the full tensors).

        Args:
            info: What :meth:`pagedkv.BlockManager.step` returned for this step.
            on_device: Cut the device mirrors (default) or the host tensors.

        Returns:
            ``slot_mapping[:num_tokens]``, ``block_tables[:num_seqs]`` (full rows: columns past a
            sequence's block count are stale), ``seq_lens[:num_seqs]``,
            ``query_start_loc[:num_seqs + 1]``, ``kv_indptr[:num_seqs + 1]``,
            ``kv_indices[:num_kv_indices]``, ``kv_last_page_len[:num_seqs]``, ``copies[:num_copies]``
            (the CSR three empty without ``csr``).
        """
        if on_device is not True and on_device is not False:
            check_flag("on_device", on_device)
        full = self.device if on_device else self.host
        cache = self._cuts[on_device]
        s = info.num_seqs
        c = 1 if self.csr else 0
        lengths = (
            info.num_tokens,
            s,
            s,
            s + 1,
            c * (s + 1),
            info.num_kv_indices,
            c * s,
            info.num_copies,
        )
        out = []
        # Slicing a tensor costs about a microsecond; consecutive steps mostly cut the same
        # lengths, so each field keeps its last cut.
        for i, n in enumerate(lengths):
            base = full[i]
            hit = cache[i]
            if hit is not None and hit[0] == n and hit[1] is base:
                out.append(hit[2])
            else:
                v = base[:n]
                cache[i] = (n, base, v)
                out.append(v)
        return StepTensors._make(out)

    def copy_spans(self, info: StepInfo) -> list[tuple[int, int]]:
        """Byte ranges of the arena that :meth:`to_device` copies for this step.

        The used part of each field, as ``[start, end)`` offsets, with neighbours separated by at
        most 128 KiB merged into one range.
        """
        o, s = self._offsets, info.num_seqs
        c = 1 if self.csr else 0
        used = (
            ("seq_lens", 4 * s),
            ("query_start_loc", 4 * (s + 1)),
            ("kv_indptr", 4 * c * (s + 1)),
            ("kv_last_page_len", 4 * c * s),
            ("copies", 16 * info.num_copies),
            ("slot_mapping", 8 * info.num_tokens),
            ("block_tables", 4 * s * self.max_blocks_per_seq),
            ("kv_indices", 4 * info.num_kv_indices),
        )
        spans: list[tuple[int, int]] = []
        for name, nbytes in used:
            if not nbytes:
                continue
            start, end = o[name], o[name] + nbytes
            if spans and start - spans[-1][1] <= _COALESCE_GAP:
                spans[-1] = (spans[-1][0], end)
            else:
                spans.append((start, end))
        return spans

    def to_device(self, info: StepInfo, non_blocking: bool = True) -> StepTensors:
        """Copies the step's used part of every host tensor into its device mirror, in place.

        Never reallocates: the device tensors keep their addresses. Elements past the step's extent
        keep their earlier contents or receive equally stale host bytes (see the module doc on
        stale data): the used parts are moved in as few copies as possible (:meth:`copy_spans`),
        so short unused stretches between them travel too. With ``non_blocking`` the copies are
        asynchronous on the current stream (the host side is pinned); do not refill the host
        buffers (call ``step`` again) before that stream has consumed them.

        Args:
            info: What :meth:`pagedkv.BlockManager.step` returned for this step.
            non_blocking: Issue asynchronous copies.

        Returns:
            The device views for this step, as :meth:`views` gives them.
        """
        if non_blocking is not True and non_blocking is not False:
            check_flag("non_blocking", non_blocking)
        if self.has_mirror:
            host, dev = self._host_arena, self._device_arena
            for a, b in self.copy_spans(info):
                dev[a:b].copy_(host[a:b], non_blocking=non_blocking)
        return self.views(info, on_device=True)

    def __repr__(self) -> str:
        return (
            f"StepBuffers(max_seqs={self.max_seqs}, max_tokens={self.max_tokens}, "
            f"max_blocks_per_seq={self.max_blocks_per_seq}, max_copies={self.max_copies}, "
            f"device={str(self.mirror_device)!r}, pinned={self.pinned}, csr={self.csr})"
        )

