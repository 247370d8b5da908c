"""Provisional tokens: speculative drafts held past a sequence's committed length.

Owns :class:`_ProvisionalMixin`: :meth:`append_provisional`, :meth:`append_provisional_batch`,
:meth:`commit`, :meth:`commit_batch`, :meth:`rewind` and the queries :meth:`num_provisional` /
:meth:`committed_len`. The semantics are the core's (``docs/architecture.md``, "Provisional
tokens"): a sequence holds at most ``max_provisional`` provisional tokens; they get slots and table
entries like any token but are never hashed, cached, tiered, published or shared with a fork until
committed, and committing ``n`` of them gives exactly the state appending their ids would have.
Invariant: every call is all or nothing; a rejected call leaves the manager unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._base import _count, _ids, _ManagerBase, _ndarray

if TYPE_CHECKING:
    from ._base import SeqIds, TokenIds


class _ProvisionalMixin(_ManagerBase):
    """Provisional-token calls of :class:`~pagedkv.BlockManager`."""

    __slots__ = ()

    def append_provisional(self, seq_id: int, num_tokens: int) -> None:
        """Gives a running sequence ``num_tokens`` provisional tokens past its committed length.

        They take slots exactly as appended tokens would (a block at a boundary, copy-on-write of a
        shared tail, the watermark reserve usable) but carry no ids yet: :meth:`commit` gives the
        accepted ones. A step schedules them like any token.

        Raises:
            UnknownSequenceError: ``seq_id`` is not live.
            InvalidSequenceStateError: The sequence is swapped out or preempted for recompute.
            InvalidArgumentError: ``num_tokens`` is 0, or the sequence would hold more than
                ``max_provisional`` provisional tokens.
            OutOfBlocksError: The pool is empty, reserve included.
            SequenceTooLongError: The sequence would outgrow its block-table row.
        """
        self._core.append_provisional(seq_id, _count("num_tokens", num_tokens))

    def append_provisional_batch(self, seq_ids: SeqIds, counts: TokenIds) -> None:
        """:meth:`append_provisional` for a whole step: ``counts[k]`` tokens for ``seq_ids[k]``.

        All or nothing: every row is validated (lengths, ids live and distinct, limits, enough
        blocks for all) before anything changes.
        """
        if type(seq_ids) is not _ndarray:
            seq_ids = _ids(seq_ids)
        if type(counts) is not _ndarray:
            counts = _ids(counts)
        self._core.append_provisional_batch(seq_ids, counts)

    def commit(self, seq_id: int, accepted_tokens: TokenIds) -> None:
        """Settles every provisional token of a sequence.

        The first ``len(accepted_tokens)`` become committed with those ids — hashed and cached
        exactly as if appended one by one — and the rest are dropped; blocks left holding no token
        go back to the free list.

        Raises:
            UnknownSequenceError: ``seq_id`` is not live.
            InvalidArgumentError: More ids than the sequence holds provisional tokens, or an id out
                of range.
        """
        self._core.commit(seq_id, _ids(accepted_tokens))

    def commit_batch(self, seq_ids: SeqIds, num_accepted: TokenIds, token_ids: TokenIds) -> None:
        """:meth:`commit` for a whole step with one call.

        Args:
            seq_ids: Live sequences, no repeats.
            num_accepted: How many of each sequence's provisional tokens are accepted.
            token_ids: The accepted ids of all of them, concatenated in order
                (``sum(num_accepted)`` ids).

        Raises:
            InvalidArgumentError: Lengths differ, a sequence repeats, a count exceeds the
                sequence's provisional tokens, or the ids do not add up; nothing changes.
            UnknownSequenceError: A sequence is not live.
        """
        if type(seq_ids) is not _ndarray:
            seq_ids = _ids(seq_ids)
        if type(num_accepted) is not _ndarray:
            num_accepted = _ids(num_accepted)
        if type(token_ids) is not _ndarray:
            token_ids = _ids(token_ids)
        self._core.commit_batch(seq_ids, num_accepted, token_ids)

    def rewind(self, seq_id: int) -> None:
        """Drops every provisional token of a sequence (``commit(seq_id, [])``)."""
        self._core.rewind(seq_id)

    def num_provisional(self, seq_id: int) -> int:
        """Provisional tokens the sequence holds past its committed length."""
        return self._core.num_provisional(seq_id)

    def committed_len(self, seq_id: int) -> int:
        """The sequence's committed length (:meth:`seq_len` counts provisional tokens too)."""
        return self._core.committed_len(seq_id)
