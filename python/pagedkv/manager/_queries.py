"""Read-only queries on the block manager's sequences and blocks, and its signals.

Owns :class:`_QueryMixin`: membership and length, a sequence's length, block table and block hashes,
block refcounts, the queued copy-on-write pairs, :meth:`stats` and :meth:`check_invariants`.
Invariant: nothing here changes the manager.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from ._base import _ManagerBase
from ._types import Stats

class _QueryMixin(_ManagerBase):
    """Read-only queries of :class:`~pagedkv.BlockManager`."""

    __slots__ = ()

    def __contains__(self, seq_id: object) -> bool:
        """Whether ``seq_id`` is a live sequence (False for anything that is not a valid id, a bool
        included: ``True in m`` does not ask about sequence 1)."""
        return self._core.contains(seq_id)

    def __len__(self) -> int:
        """Live sequences."""
        return self._core.num_seqs()

    def seq_len(self, seq_id: int) -> int:
        """Tokens in a sequence.

        Raises:
            UnknownSequenceError: ``seq_id`` is not live.
        """
        return self._core.seq_len(seq_id)

    def block_table(self, seq_id: int, group: int = 0) -> List[int]:
        """A sequence's block table in KV cache group ``group``: physical block ids, one per
        ``block_size`` tokens; ``-1`` where the group released a block no later query reads.

        Raises:
            UnknownSequenceError: ``seq_id`` is not live.
            InvalidArgumentError: ``group`` is not a group of this manager.
        """
        if group == 0 and type(group) is int:
            return self._core.block_table(seq_id)
        return self._core.block_table(seq_id, group)

    def block_hashes(self, seq_id: int) -> List[Optional[bytes]]:
        """The prefix-cache hash of each block in a sequence's table.

        Each hash is the chained XXH3-128 value of ``docs/prefix-hash.md`` as 16 little-endian
        bytes; ``None`` for a block not in the prefix cache: a partly filled tail, a block whose
        last token no :meth:`step` has scheduled yet (blocks are registered at step time), or any
        block with prefix caching off.

        Raises:
            UnknownSequenceError: ``seq_id`` is not live.
        """
        return self._core.block_hashes(seq_id)

    def block_refcount(self, block_id: int) -> int:
        """Reference count of a block: the number of block tables holding it.

        Raises:
            InvalidBlockError: ``block_id`` is outside the pool.
            InvalidArgumentError: ``block_id`` is negative or not an int.
        """
        return self._core.block_refcount(block_id)

    def pending_copies(self) -> List[Tuple[int, int]]:
        """Copy-on-write ``(src, dst)`` block pairs queued for the next :meth:`step`."""
        return self._core.pending_copies()

    # ---------------------------------------------------------------------------------- signals

    def stats(self) -> Stats:
        """A snapshot of the manager's counters."""
        d = self._core.stats()
        d["blocks_per_seq"] = tuple(d["blocks_per_seq"])
        return Stats(**d)

    def check_invariants(self) -> None:
        """Cross-checks refcounts, free list, tables and prefix cache; for tests and debugging.

        Raises:
            InvariantViolationError: The state is inconsistent (a bug in the core).
        """
        self._core.check_invariants()
