"""Building a step: the block manager's step buffers and :meth:`step`.

Owns :class:`_StepMixin`: attaching and detaching the :class:`~pagedkv.StepBuffers` the core writes
into, the incremental block-table cache, and :meth:`step`. Invariants: the core writes only into a
buffer arena the extension owns, the manager keeps the attached buffers alive until they are
detached or replaced, and one buffer set belongs to one manager at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import numpy as np

from .. import _core
from ..buffers import StepInfo
from ..errors import InvalidArgumentError
from ._base import _ids, _ManagerBase, _ndarray, _new_tuple

if TYPE_CHECKING:
    from ..buffers import StepBuffers
    from ._base import SeqIds


class _StepMixin(_ManagerBase):
    """Step buffers and step building of :class:`~pagedkv.BlockManager`."""

    __slots__ = ()

    # ------------------------------------------------------------------------------------ steps

    def attach_buffers(self, buffers: StepBuffers) -> None:
        """Attaches the step buffers that :meth:`step` fills; replaces any earlier ones.

        The core writes into the buffers' host arena, memory the extension allocated and owns (see
        :class:`~pagedkv.StepBuffers`); nothing here reads an address from Python, so rebinding or
        resizing ``buffers.host`` cannot redirect the core. The manager keeps the arena alive until
        :meth:`detach_buffers`, a later attach, or its own end.

        One buffer set belongs to one manager at a time: two managers writing block-table rows
        into one buffer would each trust incremental rows the other overwrote. Attaching the set a
        manager already holds is allowed and makes the next step write its rows in full. On error
        the earlier attachment (if any) stays in place.

        Raises:
            InvalidArgumentError: ``buffers`` is not a :class:`~pagedkv.StepBuffers`.
            BufferInvalidError: Another manager holds ``buffers`` (detach it there first).
        """
        arena = getattr(buffers, "_arena", None)
        if type(arena) is not _core.StepArena:
            reason = "must be a pagedkv.StepBuffers"
            raise InvalidArgumentError(
                f"invalid argument: buffers = {type(buffers).__name__}: {reason}",
                what="buffers",
                value=type(buffers).__name__,
                reason=reason,
            )
        self._core.attach_buffers(arena)
        self._buffers = buffers

    def detach_buffers(self) -> None:
        """Detaches the step buffers, so another manager may attach them; :meth:`step` then
        raises :class:`~pagedkv.errors.BuffersNotRegisteredError` until buffers are attached."""
        self._core.detach_buffers()
        self._buffers = None

    @property
    def buffers(self) -> Optional[StepBuffers]:
        """The attached step buffers, if any."""
        return self._buffers

    def invalidate_step_cache(self) -> None:
        """Makes the next :meth:`step` write every block-table row of its batch in full.

        :meth:`step` writes block-table rows incrementally: a row that already holds the same
        sequence's unchanged blocks gets only the new ones. The host ``block_tables`` tensor therefore
        belongs to the manager between steps; call this after writing into it yourself.
        """
        self._core.invalidate_step_cache()

    def step(self, seq_ids: SeqIds, num_new_tokens: Union[SeqIds, int]) -> StepInfo:
        """Fills the attached host buffers for one step of the given batch.

        Each ``(seq_ids[i], num_new_tokens[i])`` means "the last ``n`` tokens of the sequence are new
        this step" (they must already have been added with :meth:`admit` / :meth:`append`). Writes
        slot mapping, block-table rows in batch order, sequence lengths, query start offsets, the
        FlashInfer CSR page table, the pending copy-on-write list, and the queued swap-out and
        swap-in lists (draining each as far as its buffer holds; pairs that do not fit stay queued
        for a later step, except those this step needs: a swap-out whose device block was handed out
        again, a swap-in whose block a scheduled sequence holds — if those alone do not fit,
        :class:`~pagedkv.errors.BufferTooSmallError`). Run the lists in the order swap-out, swap-in,
        copy-on-write, before the forward pass. Follow with
        :meth:`StepBuffers.to_device`. Block-table rows are written incrementally (see
        :meth:`invalidate_step_cache`).

        Args:
            seq_ids: The batch, in order.
            num_new_tokens: New tokens per sequence, or one int for all (1 for a decode step).

        Returns:
            The :class:`StepInfo` extent of what was written.

        Raises:
            BuffersNotRegisteredError: No buffers attached.
            UnknownSequenceError: A sequence is not live.
            InvalidSequenceStateError: A sequence is swapped out or preempted by recompute.
            InvalidArgumentError: Lengths differ, a count exceeds its sequence, or a sequence repeats.
            BufferTooSmallError: The batch does not fit the buffers; nothing was written.
        """
        if type(seq_ids) is not _ndarray:
            seq_ids = _ids(seq_ids)
        t = type(num_new_tokens)
        if t is not int and t is not _ndarray:
            if isinstance(num_new_tokens, np.integer):
                num_new_tokens = int(num_new_tokens)
            else:
                num_new_tokens = _ids(num_new_tokens)
        return _new_tuple(StepInfo, self._step(seq_ids, num_new_tokens))
