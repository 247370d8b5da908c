"""Reclaiming device blocks from running sequences: swap, recompute and the choice between them.

Owns :class:`_ReclaimMixin`: :meth:`swap_out`, :meth:`swap_in`, :meth:`recompute`, :meth:`resume`,
the victim choice, the cost model's :meth:`decide`, and the queries on sequence states, queued swap
copies and host-block refcounts. Invariants: every call either succeeds or leaves the manager
unchanged, and :meth:`decide` and the queries are read-only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Tuple

from ..errors import InvalidArgumentError
from ._base import _count, _ids, _ManagerBase, _new_tuple
from ._types import AdmitResult, CostModel, Decision

if TYPE_CHECKING:
    from ._base import SeqIds


class _ReclaimMixin(_ManagerBase):
    """Swap and recompute calls of :class:`~pagedkv.BlockManager`."""

    __slots__ = ()

    # ------------------------------------------------------------------------------ reclamation

    def swap_out(self, seq_ids: SeqIds) -> List[Tuple[int, int]]:
        """Moves running sequences to the host pool and frees their device blocks.

        Pass a forked group together (as :meth:`choose_victim` returns it): a block several of
        them share is copied once, to one host block they all hold. A block shared with a sequence
        left running is copied too and stays on the device for it. Device blocks that lose their
        last holder are freed at once and may be handed out again before the next step; hashed
        ones leave the prefix cache first, so a swapped-out block is not findable by prefix
        lookups until it is swapped back in (when it is registered again). The sequences become
        ``"swapped"``: not schedulable (:meth:`step`, :meth:`append`, :meth:`fork` raise
        :class:`~pagedkv.errors.InvalidSequenceStateError`), still known (``seq_id in manager``,
        :meth:`free` works, :meth:`block_table` lists their host blocks).

        With KV cache groups every group's held blocks move (the pairs of all groups share the
        one list: a page is group-agnostic); a sliding or chunked group's released entries stay
        ``-1`` in its host table, and :meth:`swap_in` restores each table entry for entry.

        The copies are also queued and written by the next :meth:`step` into the ``swap_out``
        step buffer; the engine must run them before anything else of that step (a freed device
        block may be reused in the same step). Each copy carries the KV that steps already run
        wrote. Counts one swap preemption per sequence.

        Args:
            seq_ids: Running sequences, distinct, at least one.

        Returns:
            The ``(device_block, host_block)`` copies to make.

        Raises:
            UnknownSequenceError, InvalidSequenceStateError (one is not running),
            InvalidArgumentError (empty, repeated id), OutOfHostBlocksError (the host pool lacks
            the blocks). Nothing changed on error.
        """
        return self._core.swap_out(_ids(seq_ids))

    def swap_in(self, seq_ids: SeqIds) -> List[Tuple[int, int]]:
        """Brings swapped-out sequences back to the device.

        Allocates a device block per distinct host block (a block the group shares on the host is
        shared again on the device); like an admission, it must leave the watermark reserve free.
        The copies are queued and written by the next :meth:`step` into ``swap_in``; each host block
        is released once the step emitting its copy has been built. The sequences run again with
        their admission order and fork group unchanged.

        Returns:
            The ``(host_block, device_block)`` copies to make.

        Raises:
            UnknownSequenceError, InvalidSequenceStateError (one is not swapped out),
            InvalidArgumentError, OutOfBlocksError, WatermarkReachedError. Nothing changed on
            error.
        """
        return self._core.swap_in(_ids(seq_ids))

    def recompute(self, seq_id: int) -> None:
        """Preempts a sequence by recompute: frees its blocks (hashed full blocks stay cached, so
        :meth:`resume` can hit them), keeps its length and token ids. A swapped-out sequence may
        be dropped to this state too (its host blocks are freed). Counts one recompute preemption
        for a running sequence.

        Raises:
            UnknownSequenceError, InvalidSequenceStateError (already preempted by recompute).
        """
        self._core.recompute(seq_id)

    def resume(self, seq_id: int, max_new_tokens: Optional[int] = None) -> AdmitResult:
        """Re-admits a sequence preempted by :meth:`recompute` from its kept tokens, exactly as
        :meth:`admit` of those tokens would (prefix-cache lookup over all of them; with
        ``max_new_tokens`` it holds ``cached + min(max_new_tokens, len - cached)`` and the rest is
        appended later). Keeps its id, admission order and fork group.

        Raises:
            UnknownSequenceError, InvalidSequenceStateError (not preempted by recompute),
            InvalidArgumentError (``max_new_tokens`` 0 or not an int), OutOfBlocksError,
            WatermarkReachedError. Nothing changed on error.
        """
        return _new_tuple(AdmitResult, self._core.resume(seq_id, max_new_tokens))

    def choose_victim(self) -> Optional[List[int]]:
        """The next preemption victim: the running members of the most recently admitted fork
        group (a forked child counts as admitted with its parent; swap and recompute keep the
        order), in creation order. ``None`` when nothing runs."""
        return self._core.choose_victim()

    def decide(self, seq_ids: SeqIds, cost_model: Optional[CostModel] = None, *,
               batch_tokens: Optional[int] = None) -> Decision:
        """The cost model's choice for preempting the running ``seq_ids`` together.

        Swap: 2 × the KV bytes of their distinct device blocks (every KV cache group's) over the
        host link. Recompute: per sequence, the tokens past the leading full blocks that stay
        cached after the preemption (blocks other sequences also hold; with groups, the longest
        boundary at which every group's blocks stay cached), at least one, summed over the sequences (× branches for
        a forked group), costed as what they add to the steps that carry them
        (:class:`CostModel`). Swap is chosen when the host pool has room and it is strictly
        cheaper. Read-only.

        Args:
            seq_ids: Running sequences, distinct.
            cost_model: The rates; defaults to :attr:`cost_model`.
            batch_tokens: Tokens of other work each step carries beside the recompute; ``None``
                counts one decode token per running sequence outside ``seq_ids``.

        Raises:
            InvalidArgumentError: No cost model, a rate that is not finite and > 0 (a floor < 0),
                a token count that is not an int >= 0; as :meth:`swap_out` for the ids.
        """
        cm = self.cost_model if cost_model is None else cost_model
        if cm is None:
            reason = "no cost model given and none set on the manager"
            raise InvalidArgumentError(
                f"invalid argument: cost_model = None: {reason}",
                what="cost_model",
                value=None,
                reason=reason,
            )
        if not isinstance(cm, CostModel):
            cm = CostModel(*cm)  # a plain tuple of the first three rates, or all five
        max_step = _count("max_step_tokens", cm.max_step_tokens)
        batch = None if batch_tokens is None else _count("batch_tokens", batch_tokens)
        return _new_tuple(Decision, self._core.decide(
            _ids(seq_ids), float(cm.host_link_bytes_per_s), float(cm.prefill_tokens_per_s),
            float(cm.kv_bytes_per_token), float(cm.step_floor_s), max_step, batch))

    def seq_state(self, seq_id: int) -> str:
        """``"running"``, ``"swapped"`` or ``"recompute"``."""
        return self._core.seq_state(seq_id)

    def pending_swap_out(self) -> List[Tuple[int, int]]:
        """Swap-out ``(device, host)`` copies queued for the next steps."""
        return self._core.pending_swap_out()

    def pending_swap_in(self) -> List[Tuple[int, int]]:
        """Swap-in ``(host, device)`` copies queued for the next steps."""
        return self._core.pending_swap_in()

    def host_block_refcount(self, block_id: int) -> int:
        """Reference count of a host block (swapped tables holding it plus queued swap-ins).

        Raises:
            InvalidBlockError: ``block_id`` is outside the host pool.
        """
        return self._core.host_block_refcount(block_id)
