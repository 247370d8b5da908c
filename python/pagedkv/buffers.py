"""Step buffers: the host arrays the manager fills each step, and their device mirrors.

Owns the memory that carries one scheduler step's bookkeeping to the GPU, and :class:`StepInfo`, the
extent of what one step wrote into it (``B`` is the block size):

- ``slot_mapping`` int64 ``[max_tokens]``: ``table[p // B] * B + p % B`` for each new token ``p``;
- ``block_tables`` int32 ``[max_seqs, max_blocks_per_seq]``: one row per sequence, batch order;
- ``seq_lens`` int32 ``[max_seqs]``: tokens per sequence, new ones included;
- ``query_start_loc`` int32 ``[max_seqs + 1]``: prefix sums of the new tokens per sequence;
- ``kv_indptr`` int32 ``[max_seqs + 1]``, ``kv_indices`` int32 ``[max_seqs * max_blocks_per_seq]``,
  ``kv_last_page_len`` int32 ``[max_seqs]``: the FlashInfer CSR page table (row offsets, block ids,
  tokens in each last block); optional (``csr=False`` leaves the three empty and unwritten);
- ``copies`` int64 ``[max_copies, 2]``: pending copy-on-write ``(src, dst)`` block pairs;
- ``swap_out`` int64 ``[max_swaps, 2]``: queued ``(device_block, host_block)`` swap-out copies;
- ``swap_in`` int64 ``[max_swaps, 2]``: queued ``(host_block, device_block)`` swap-in copies.

With KV cache groups (``num_groups=G`` for a manager built with ``G`` groups), the fields above are
group 0's and everything the groups share (lengths, query offsets, the CSR table of group 0, the
copy and swap lists; pages are group-agnostic), and each group ``g`` in ``1..G`` has its own
:class:`GroupTensors` in :attr:`StepBuffers.groups_host` / :attr:`StepBuffers.groups_device`
(index ``g - 1``): a ``slot_mapping`` int64 ``[max_tokens]`` and ``block_tables`` int32
``[max_seqs, max_blocks_per_seq]`` holding ``-1`` where the group released a block. They live in the
same arena, after the fields above, allocated once like them.

An engine runs a step's lists in the order swap-out, swap-in, copy-on-write, before its forward.

Two backends, one memory layout (``backend=``):

* ``"torch"`` (the default when torch is installed): the fields are torch tensors, the host ones
  pinned when CUDA is available, with device mirrors; what the engine and the kernels read.
* ``"numpy"`` (the default without torch, or asked for): the fields are numpy arrays over the same
  host arena, with no pinning and no device mirror (``device`` is ``None`` or ``"cpu"``). Enough
  for everything that only builds steps on the host (the simulator, a scheduler written in Python,
  tests); torch is never imported.

Invariants:

* Everything is allocated once, in :class:`StepBuffers`'s constructor, and never reallocated: every
  tensor's ``data_ptr()`` is fixed for the object's lifetime, which is what CUDA graphs need.
* The host tensors live in one contiguous arena that the extension allocates and owns
  (``_core.StepArena``), pinned with ``cudaHostRegister`` when CUDA is available so host-to-device
  copies can be asynchronous; each field starts on a 64-byte boundary. Python holds only views of it
  (numpy arrays whose base is the arena, and with torch, tensors over them): their storage cannot
  be freed or resized (numpy's ``resize`` and torch's ``resize_`` raise), and the arena lives while
  any view or any manager refers to it.
  That is what makes it safe for the manager to write it with the GIL released.
* One buffer set belongs to one manager at a time (:meth:`pagedkv.BlockManager.attach_buffers`).
* The device mirrors have the same shapes and dtypes, in one arena on ``device``. Without a device
  (no CUDA, or ``device="cpu"``) the device mirrors *are* the host tensors and
  :meth:`StepBuffers.to_device` copies nothing.

Stale data: a step writes only what it uses. Columns of a block-table row past the sequence's block
count, rows past the batch, and elements of every other buffer past the step's extent keep whatever
an earlier step left there. Kernels must read only ``ceil(seq_lens[i] / B)`` entries of row ``i``
and only the first ``num_seqs`` rows; :meth:`StepBuffers.views` returns views cut to the step's
extent for code that wants no stale elements in sight. The device mirrors are updated the same way
(:meth:`StepBuffers.to_device` copies only the used prefix of each field), so they too hold stale
data past the step's extent — padding rows of a CUDA graph captured at a larger batch included.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Optional, Union

import numpy as np

from . import _core
from ._checks import allocate, check_flag, parse_device

if TYPE_CHECKING:
    import torch

__all__ = ["StepBuffers", "StepTensors", "GroupTensors", "StepInfo", "FIELDS", "BACKENDS"]

# Field placement (arena order: the small per-sequence fields first, the large tables last, each on
# its own 64-byte line) is the extension's (`_core.StepArena.fields()`), so the two never disagree.

# Used parts separated by at most this many unused bytes are moved in one copy: a host-to-device
# copy costs several microseconds to issue, the time to move about this many bytes more.
_COALESCE_GAP = 128 * 1024


# No StepInfo is this object, so the first `_check_info` always checks.
_UNCHECKED = object()

#: The backends :class:`StepBuffers` offers.
BACKENDS = ("torch", "numpy")

# Element types of the fields (numpy and torch share these names).
_INT64, _INT32 = "int64", "int32"


class StepInfo(NamedTuple):
    """Extent of what one :meth:`pagedkv.BlockManager.step` wrote into the step buffers."""

    #: Sequences in the batch (rows of ``block_tables`` written).
    num_seqs: int
    #: New tokens in the batch (entries of ``slot_mapping`` written).
    num_tokens: int
    #: Entries of ``kv_indices`` written (sum of the batch's block counts; 0 without the CSR table).
    num_kv_indices: int
    #: Copy-on-write ``(src, dst)`` pairs written to ``copies``; the queue is drained.
    num_copies: int
    #: Longest sequence in the batch, in tokens.
    max_seq_len: int
    #: Swap-out ``(device_block, host_block)`` pairs written to ``swap_out`` (run first).
    num_swap_out: int = 0
    #: Swap-in ``(host_block, device_block)`` pairs written to ``swap_in`` (run after the
    #: swap-outs, before the copy-on-write list).
    num_swap_in: int = 0
    #: Most new tokens of one sequence in the batch (the largest step of ``query_start_loc``):
    #: 1 for a decode-only step, 0 for an empty one. The bound a prefill kernel sizes its grid by.
    max_query_len: int = 0


class StepTensors(NamedTuple):
    """The step buffers (:data:`FIELDS`), all on one device (host, or the device mirror).

    Each field is a ``torch.Tensor`` with the ``"torch"`` backend and a ``numpy.ndarray`` with the
    ``"numpy"`` one (hence ``Any``: both index, slice and ``tolist()`` alike).

    A named tuple rather than a dataclass: one is built per step by :meth:`StepBuffers.views`, and
    a tuple is several times cheaper to build.
    """

    slot_mapping: Any
    block_tables: Any
    seq_lens: Any
    query_start_loc: Any
    kv_indptr: Any
    kv_indices: Any
    kv_last_page_len: Any
    copies: Any
    swap_out: Any
    swap_in: Any

    def items(self) -> Iterator[tuple[str, Any]]:
        """Yields ``(name, array)`` for every field, in declaration order."""
        return zip(self._fields, self)


class GroupTensors(NamedTuple):
    """The step buffers of one KV cache group after group 0 (same dtypes and shapes as group 0's
    ``slot_mapping`` and ``block_tables``; ``-1`` marks a released block in a row)."""

    slot_mapping: Any
    block_tables: Any


#: The step buffers' field names, in :class:`StepTensors` order: the one list the Python side reads.
#: The extension's arena (``_core.StepArena.fields()``) yields the same names in the same order, and
#: a test holds the two together.
FIELDS: tuple[str, ...] = StepTensors._fields


def _torch_or_none() -> Any:
    """The torch module, or ``None`` when it is not installed (a broken install still raises)."""
    try:
        import torch
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".", 1)[0] == "torch":
            return None
        raise
    return torch


def _is_cpu(device: Any) -> bool:
    """Whether ``device`` names the host (``"cpu"`` or ``torch.device("cpu")``), without torch."""
    if isinstance(device, str):
        return device == "cpu"
    return type(device).__name__ == "device" and getattr(device, "type", None) == "cpu"


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
        max_copies: Most pending copy-on-write pairs one step can carry; defaults to
            ``max_seqs * num_groups`` (each sequence copies at most its tail block per group per
            step).
        max_swaps: Most pairs of each swap list (``swap_out``, ``swap_in``) one step can carry;
            more stay queued for later steps. Defaults to ``2 * max_blocks_per_seq`` (two whole
            sequences each way per step). With a host tier give at least the pool's block count
            (the engine does): a step must carry the loads of every prompt it admits and the
            write-backs of every block its allocations evict, which two sequences' worth does
            not bound (the step then fails with ``BufferTooSmallError``); each list names a
            device block at most once, so the block count always suffices.
        device: Where the mirrors live. ``None`` picks ``"cuda"`` when available and otherwise keeps
            no mirror; ``"cpu"`` also keeps none (the mirrors are the host tensors). The
            ``"numpy"`` backend takes only ``None`` or ``"cpu"``.
        csr: Allocate the FlashInfer CSR page table (``kv_indptr``, ``kv_indices``,
            ``kv_last_page_len``). Without it those three tensors are empty and each step skips
            writing them (about half of what a decode step writes); kernels that read the block
            tables do not need them.
        backend: ``"torch"`` (tensors, pinned, with device mirrors), ``"numpy"`` (numpy arrays,
            host only, no torch import), or ``None``: ``"torch"`` when torch is installed, else
            ``"numpy"``. See the module doc.
        num_groups: KV cache groups of the manager these buffers are for (default 1); groups
            ``1..num_groups-1`` get their own slot mapping and block tables
            (:attr:`groups_host`, :attr:`groups_device`). A manager refuses buffers built for
            another number of groups.

    Raises:
        InvalidArgumentError: A size is not a positive int (``max_copies`` may be 0; ``num_groups``
            at most 64), ``csr`` is not
            a bool, ``backend`` is not one of :data:`BACKENDS` or None, or ``device`` is not
            ``cpu`` or an available CUDA device (only ``cpu`` with the ``"numpy"`` backend).
        MissingDependencyError: ``backend="torch"``, or a device other than the host, without
            torch installed.
        AllocationFailedError: The host arena, its pinning or the device mirror could not be had.
    """

    def __init__(
        self,
        max_seqs: int,
        max_tokens: int,
        max_blocks_per_seq: int,
        *,
        max_copies: Optional[int] = None,
        max_swaps: Optional[int] = None,
        device: Union[str, torch.device, None] = None,
        csr: bool = True,
        backend: Optional[str] = None,
        num_groups: int = 1,
    ) -> None:
        self.max_seqs = _check_dim("max_seqs", max_seqs, 1)
        self.max_tokens = _check_dim("max_tokens", max_tokens, 1)
        self.max_blocks_per_seq = _check_dim("max_blocks_per_seq", max_blocks_per_seq, 1)
        self.max_swaps = _check_dim(
            "max_swaps", 2 * self.max_blocks_per_seq if max_swaps is None else max_swaps, 0
        )
        self.csr = check_flag("csr", csr)
        #: KV cache groups these buffers are for.
        self.num_groups = _check_dim("num_groups", num_groups, 1)
        self.max_copies = _check_dim(
            "max_copies", self.max_seqs * self.num_groups if max_copies is None else max_copies, 0
        )
        torch = self._pick_backend(backend, device)
        dev: Any
        if torch is None:
            dev, cuda = "cpu", False
        else:
            cuda = torch.cuda.is_available()
            dev = torch.device("cuda" if cuda else "cpu") if device is None else (
                parse_device(device)
            )

        # The host memory is the extension's (`_core.StepArena`): the manager writes it with the
        # GIL released, so Python must not be able to free, move or resize it. Python sees it only
        # through a numpy array whose base is the arena, wrapped by `torch.from_numpy` (a storage
        # torch refuses to resize); every view, and every manager it is attached to, keeps the
        # arena alive.
        self._arena = _core.StepArena(
            self.max_seqs,
            self.max_tokens,
            self.max_blocks_per_seq,
            self.max_copies,
            self.csr,
            self.max_swaps,
            self.num_groups,
        )
        self.nbytes = self._arena.nbytes
        # Per group after group 0: the byte offsets of its slot mapping and block tables.
        self._group_offsets: list[tuple[int, int]] = [
            (sm[0], bt[0]) for sm, bt in self._arena.group_fields()
        ]
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
        host_arena = self._arena.array()
        self._host_arena: Any = host_arena if torch is None else torch.from_numpy(host_arena)
        self.host = self._carve(self._host_arena, shapes)
        # numpy views of the same host memory, for host-side reads whatever the backend.
        self._host_np = self.host if torch is None else self._carve(host_arena, shapes)
        #: Groups ``1..num_groups-1``' host buffers (index ``g - 1``); empty with one group.
        self.groups_host: tuple[GroupTensors, ...] = self._carve_groups(self._host_arena)
        self._device_arena: Any
        if torch is None or dev.type == "cpu":
            self._device_arena = self._host_arena
            self.device = self.host
            #: Groups ``1..num_groups-1``' device mirrors (the host buffers without a mirror).
            self.groups_device: tuple[GroupTensors, ...] = self.groups_host
            self.has_mirror = False
        else:
            total = self.nbytes
            self._device_arena = allocate(
                f"step buffers (device mirror on {dev})",
                total,
                lambda: torch.zeros(total, dtype=torch.uint8, device=dev),
            )
            self.device = self._carve(self._device_arena, shapes)
            self.groups_device = self._carve_groups(self._device_arena)
            self.has_mirror = True
        #: Where the mirrors live: a ``torch.device`` with the ``"torch"`` backend, else ``"cpu"``.
        self.mirror_device = dev
        # Per field, the last (length, full array, view) that `views` cut, for host and device.
        self._cuts: dict[bool, list[Optional[tuple[int, Any, Any]]]] = {
            False: [None] * len(FIELDS),
            True: [None] * len(FIELDS),
        }
        # The last StepInfo `_check_info` accepted (`to_device` checks it in `copy_spans`, then `views`).
        self._checked: Any = _UNCHECKED
        self._kv_cap = self.max_seqs * self.max_blocks_per_seq if self.csr else 0

    def _pick_backend(self, backend: Optional[str], device: Any) -> Any:
        """Sets :attr:`backend`; returns the torch module for ``"torch"``, ``None`` for numpy."""
        from .errors import InvalidArgumentError

        if backend is not None and backend not in BACKENDS:
            reason = f"must be one of {', '.join(map(repr, BACKENDS))} or None"
            raise InvalidArgumentError(
                f"invalid argument: backend = {backend!r}: {reason}",
                what="backend", value=backend, reason=reason,
            )
        torch = None if backend == "numpy" else _torch_or_none()
        if torch is None:
            if backend == "numpy" and not (device is None or _is_cpu(device)):
                reason = "numpy step buffers live on the host: use None or 'cpu'"
                raise InvalidArgumentError(
                    f"invalid argument: device = {device!r}: {reason}",
                    what="device", value=device, reason=reason,
                )
            if backend == "torch" or not (device is None or _is_cpu(device)):
                from ._optional import missing

                what = "backend='torch'" if backend == "torch" else f"device={device!r}"
                raise missing("torch", f"StepBuffers({what})")
        #: ``"torch"`` or ``"numpy"``: what the fields of :attr:`host` and :attr:`device` are.
        self.backend = "numpy" if torch is None else "torch"
        return torch

    def _shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        s, b = self.max_seqs, self.max_blocks_per_seq
        c = 1 if self.csr else 0
        return {
            "slot_mapping": (_INT64, (self.max_tokens,)),
            "block_tables": (_INT32, (s, b)),
            "seq_lens": (_INT32, (s,)),
            "query_start_loc": (_INT32, (s + 1,)),
            "kv_indptr": (_INT32, (c * (s + 1),)),
            "kv_indices": (_INT32, (c * s * b,)),
            "kv_last_page_len": (_INT32, (c * s,)),
            "copies": (_INT64, (self.max_copies, 2)),
            "swap_out": (_INT64, (self.max_swaps, 2)),
            "swap_in": (_INT64, (self.max_swaps, 2)),
        }

    def _carve(self, arena: Any, shapes: dict[str, tuple[str, tuple[int, ...]]]) -> StepTensors:
        """Views of ``arena`` (a uint8 numpy array or tensor) for every field, at its offset."""
        return StepTensors(**_carve_fields(arena, shapes, self._offsets))

    def _carve_groups(self, arena: Any) -> tuple[GroupTensors, ...]:
        """Views of ``arena`` for every group after group 0, at the extension's offsets."""
        shapes = {
            "slot_mapping": (_INT64, (self.max_tokens,)),
            "block_tables": (_INT32, (self.max_seqs, self.max_blocks_per_seq)),
        }
        return tuple(
            GroupTensors(**_carve_fields(arena, shapes, {"slot_mapping": sm, "block_tables": bt}))
            for sm, bt in self._group_offsets
        )

    def _check_info(self, info: StepInfo) -> None:
        """Raises InvalidArgumentError unless every count of ``info`` fits these buffers.

        A cut past a field's end would silently come out short (slicing clamps) and a negative
        one would drop elements from the end, so a bad count is refused instead.
        """
        if info is self._checked:
            return
        try:
            n_s, n_t, n_k, n_c = info.num_seqs, info.num_tokens, info.num_kv_indices, info.num_copies
            n_o, n_i = info.num_swap_out, info.num_swap_in
        except AttributeError:
            n_s = None
        # The common case in one expression (this runs every step); the loop below names the
        # offending count.
        if (type(n_s) is int and type(n_t) is int and type(n_k) is int and type(n_c) is int
                and type(n_o) is int and type(n_i) is int
                and 0 <= n_s <= self.max_seqs and 0 <= n_t <= self.max_tokens
                and 0 <= n_k <= self._kv_cap and 0 <= n_c <= self.max_copies
                and 0 <= n_o <= self.max_swaps and 0 <= n_i <= self.max_swaps):
            self._checked = info
            return
        from .errors import InvalidArgumentError

        s_cap = self.max_seqs
        limits = (
            ("num_seqs", s_cap, "max_seqs"),
            ("num_tokens", self.max_tokens, "max_tokens"),
            ("num_kv_indices", self._kv_cap,
             "max_seqs * max_blocks_per_seq" if self.csr else "0 without csr"),
            ("num_copies", self.max_copies, "max_copies"),
            ("num_swap_out", self.max_swaps, "max_swaps"),
            ("num_swap_in", self.max_swaps, "max_swaps"),
        )
        for field, cap, name in limits:
            try:
                n = getattr(info, field)
            except AttributeError:
                reason = f"must be a StepInfo (it has no {field})"
                raise InvalidArgumentError(
                    f"invalid argument: info = {info!r}: {reason}",
                    what="info", value=info, reason=reason,
                ) from None
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= cap:
                reason = f"must be an int in [0, {cap}] ({name} of these buffers)"
                raise InvalidArgumentError(
                    f"invalid argument: info.{field} = {n!r}: {reason}",
                    what=f"info.{field}", value=n, reason=reason,
                )
        self._checked = info

    def views(self, info: StepInfo, *, on_device: bool = True) -> StepTensors:
        """The buffers cut to one step's extent (views, no copies; addresses as the full ones).

        Args:
            info: What :meth:`pagedkv.BlockManager.step` returned for this step.
            on_device: Cut the device mirrors (default) or the host tensors.

        Returns:
            ``slot_mapping[:num_tokens]``, ``block_tables[:num_seqs]`` (full rows: columns past a
            sequence's block count are stale), ``seq_lens[:num_seqs]``,
            ``query_start_loc[:num_seqs + 1]``, ``kv_indptr[:num_seqs + 1]``,
            ``kv_indices[:num_kv_indices]``, ``kv_last_page_len[:num_seqs]``, ``copies[:num_copies]``,
            ``swap_out[:num_swap_out]``, ``swap_in[:num_swap_in]`` (the CSR three empty without
            ``csr``).

        Raises:
            InvalidArgumentError: ``info`` is not a StepInfo, or a count is negative or larger
                than these buffers hold.
        """
        if on_device is not True and on_device is not False:
            check_flag("on_device", on_device)
        self._check_info(info)
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
            info.num_swap_out,
            info.num_swap_in,
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

    def group_views(self, info: StepInfo, group: int, *, on_device: bool = True) -> GroupTensors:
        """KV cache group ``group``'s slot mapping and block tables cut to one step's extent
        (``slot_mapping[:num_tokens]``, ``block_tables[:num_seqs]``; views, no copies). Group 0's
        are :meth:`views`' ``slot_mapping`` and ``block_tables``.

        Raises:
            InvalidArgumentError: ``group`` is not in ``[0, num_groups)``, or as :meth:`views`.
        """
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < self.num_groups:
            from .errors import InvalidArgumentError

            reason = f"must be an int in [0, {self.num_groups}) (num_groups of these buffers)"
            raise InvalidArgumentError(
                f"invalid argument: group = {group!r}: {reason}",
                what="group", value=group, reason=reason,
            )
        if on_device is not True and on_device is not False:
            check_flag("on_device", on_device)
        self._check_info(info)
        if group == 0:
            full = self.device if on_device else self.host
            return GroupTensors(full.slot_mapping[: info.num_tokens],
                                full.block_tables[: info.num_seqs])
        g = (self.groups_device if on_device else self.groups_host)[group - 1]
        return GroupTensors(g.slot_mapping[: info.num_tokens], g.block_tables[: info.num_seqs])

    def positions(self, info: StepInfo) -> np.ndarray:
        """Position of every new token of the step in its sequence, in batch order (int64
        ``[num_tokens]``), read from what the manager wrote: row ``k``'s new tokens are the last
        ``query_start_loc[k + 1] - query_start_loc[k]`` of its ``seq_lens[k]``. The one source of
        a step's positions (RoPE must see exactly the slots the slot mapping writes)."""
        n, t = info.num_seqs, info.num_tokens
        h = self._host_np
        qsl = h.query_start_loc[: n + 1].astype(np.int64)
        q_lens = np.diff(qsl)
        first = h.seq_lens[:n].astype(np.int64) - q_lens  # position of each row's first new token
        return np.arange(t, dtype=np.int64) + np.repeat(first - qsl[:-1], q_lens)

    def copy_spans(self, info: StepInfo) -> list[tuple[int, int]]:
        """Byte ranges of the arena that :meth:`to_device` copies for this step.

        The used part of each field (the groups' after group 0 included), as ``[start, end)`` offsets, with neighbours separated by at
        most 128 KiB merged into one range.

        Raises:
            InvalidArgumentError: As :meth:`views`.
        """
        self._check_info(info)
        o, s = self._offsets, info.num_seqs
        c = 1 if self.csr else 0
        used = (
            ("seq_lens", 4 * s),
            ("query_start_loc", 4 * (s + 1)),
            ("kv_indptr", 4 * c * (s + 1)),
            ("kv_last_page_len", 4 * c * s),
            ("copies", 16 * info.num_copies),
            ("swap_out", 16 * info.num_swap_out),
            ("swap_in", 16 * info.num_swap_in),
            ("slot_mapping", 8 * info.num_tokens),
            ("block_tables", 4 * s * self.max_blocks_per_seq),
            ("kv_indices", 4 * info.num_kv_indices),
        )
        ranges = [(o[name], nbytes) for name, nbytes in used]
        for sm, bt in self._group_offsets:
            ranges.append((sm, 8 * info.num_tokens))
            ranges.append((bt, 4 * s * self.max_blocks_per_seq))
        spans: list[tuple[int, int]] = []
        for off, nbytes in ranges:
            if not nbytes:
                continue
            start, end = off, off + nbytes
            if spans and start - spans[-1][1] <= _COALESCE_GAP:
                spans[-1] = (spans[-1][0], end)
            else:
                spans.append((start, end))
        return spans

    def to_device(self, info: StepInfo, non_blocking: bool = True) -> StepTensors:
        """Copies the step's used part of every host tensor into its device mirror, in place.

        Never reallocates: the device tensors keep their addresses. Without a mirror (``"cpu"``, or
        the ``"numpy"`` backend) it copies nothing and returns the host views. Elements past the
        step's extent keep their earlier contents or receive equally stale host bytes (see the
        module doc on stale data): the used parts are moved in as few copies as possible
        (:meth:`copy_spans`), so short unused stretches between them travel too. With
        ``non_blocking`` the copies are asynchronous on the current stream (the host side is
        pinned); do not refill the host buffers (call ``step`` again) before that stream has
        consumed them.

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
            f"max_swaps={self.max_swaps}, "
            f"device={str(self.mirror_device)!r}, pinned={self.pinned}, csr={self.csr}, "
            f"backend={self.backend!r}"
            + (f", num_groups={self.num_groups})" if self.num_groups != 1 else ")")
        )


def _carve_fields(
    arena: Any, shapes: dict[str, tuple[str, tuple[int, ...]]], offsets: dict[str, int]
) -> dict[str, Any]:
    """Views of ``arena`` (a uint8 numpy array or tensor) for each field of ``shapes``, at its
    byte offset in ``offsets``."""
    if isinstance(arena, np.ndarray):
        dtypes: Any = np
        # `reshape` of a contiguous array is a view; numpy's `view` takes only a dtype.
        reshape = np.ndarray.reshape
    else:
        import torch

        dtypes = torch
        reshape = torch.Tensor.view
    views = {}
    for name, (dtype_name, shape) in shapes.items():
        dtype = getattr(dtypes, dtype_name)
        itemsize = np.dtype(dtype_name).itemsize
        off = offsets[name]
        n = 1
        for d in shape:
            n *= d
        views[name] = reshape(arena[off : off + n * itemsize].view(dtype), shape)
    return views
