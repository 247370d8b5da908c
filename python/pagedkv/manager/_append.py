"""Growing, forking and releasing admitted sequences, and resetting the prefix cache.

Owns :class:`_AppendMixin`: :meth:`append` and :meth:`append_batch` (the decode hot path),
:meth:`fork`, :meth:`free`, :meth:`free_batch` and :meth:`reset_prefix_cache`. Invariants: a block is
allocated only when a token crosses a block boundary (appends may use the watermark reserve), batch
calls are all or nothing, and a failed call leaves the manager unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._base import _ids, _ManagerBase, _ndarray, logger

if TYPE_CHECKING:
    from ._base import SeqIds, TokenIds


class _AppendMixin(_ManagerBase):
    """Append, fork and free calls of :class:`~pagedkv.BlockManager`."""

    __slots__ = ()

    def append(self, seq_id: int, token_ids: TokenIds) -> None:
        """Appends tokens to a sequence, allocating a block only when a boundary is crossed.

        May use the watermark reserve. Appending into a block shared with another sequence (after
        :meth:`fork`) copies it first and queues a ``(src, dst)`` copy for the next :meth:`step`.

        Args:
            seq_id: A live sequence.
            token_ids: The new tokens (an int appends one).

        Raises:
            UnknownSequenceError: ``seq_id`` is not live.
            InvalidArgumentError: A token id is negative or above ``2**32 - 1``.
            OutOfBlocksError: The pool is empty, reserve included.
            SequenceTooLongError: The sequence would outgrow its block-table row.
        """
        self._core.append(seq_id, _ids(token_ids))

    def append_batch(self, seq_ids: SeqIds, token_ids: TokenIds) -> None:
        """Appends one token to each of many sequences: the decode step's hot path.

        All or nothing: if any sequence fails, none is changed.

        Args:
            seq_ids: Live sequence ids, no repeats (int64 or uint64 array, or a list).
            token_ids: One token id per sequence, same length as ``seq_ids``.

        Raises:
            UnknownSequenceError: A sequence is not live.
            InvalidArgumentError: Lengths differ, a sequence repeats, or an id is out of range.
            OutOfBlocksError: The pool cannot supply the blocks the batch needs.
            SequenceTooLongError: A sequence would outgrow its block-table row.
        """
        # Inline type tests: this is called once per decode step, and the call to `_ids` would cost
        # as much as the test.
        if type(seq_ids) is not _ndarray:
            seq_ids = _ids(seq_ids)
        if type(token_ids) is not _ndarray:
            token_ids = _ids(token_ids)
        self._append_batch(seq_ids, token_ids)

    def fork(self, parent: int, child: int) -> None:
        """Creates ``child`` sharing all of ``parent``'s blocks (parallel sampling, beam search).

        No block is copied now; the first write into a shared block copies it (copy-on-write).

        Args:
            parent: A live sequence.
            child: A new sequence id.

        Raises:
            UnknownSequenceError: ``parent`` is not live.
            DuplicateSequenceError: ``child`` is already live.
            InvalidArgumentError: An id is negative or too large.
        """
        self._core.fork(parent, child)

    def free(self, seq_id: int) -> None:
        """Releases a sequence; its full blocks stay in the prefix cache until their space is needed.

        Args:
            seq_id: A live sequence.

        Raises:
            UnknownSequenceError: ``seq_id`` is not live.
        """
        self._core.free(seq_id)

    def free_batch(self, seq_ids: SeqIds) -> None:
        """Releases many sequences with one call; all or nothing.

        Validates first (every id live, none twice), then frees each as :meth:`free` does.

        Raises:
            UnknownSequenceError: A sequence is not live.
            InvalidArgumentError: A sequence repeats, or an id is out of range.
        """
        if type(seq_ids) is not _ndarray:
            seq_ids = _ids(seq_ids)
        self._core.free_batch(seq_ids)

    def reset_prefix_cache(self) -> int:
        """Forgets every prefix-cache entry, e.g. after the model's weights change.

        Cached-free blocks return to the free list; blocks still held by sequences lose their hash
        (they stay in their tables and are not offered to the cache again). Later admissions hit
        nothing until new steps register blocks.

        Returns:
            The number of blocks dropped from the cache (cached-free and held ones).
        """
        dropped = self._core.reset_prefix_cache()
        logger.info("prefix cache reset: %d blocks dropped", dropped)
        return dropped
