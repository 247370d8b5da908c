"""The scheduler's preemption and reclaim (:class:`_PreemptMixin`, a base of
:class:`pagedkv.scheduler.Scheduler`): choosing the victim group, deciding swap or recompute, the
preemption itself, resuming swapped-out groups, and making room when running sequences cannot grow.

Invariants (with the scheduler's, in :mod:`pagedkv.scheduler`): a preempted group leaves
``running`` whole — swapped (host blocks only, in :attr:`swapped`, admission order) or freed and
back at the head of ``waiting`` with all its token ids; a swap-in restores admission order in
``running``; a full host pool falls back to recompute with the manager unchanged.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Deque, List, Optional, Sequence as SequenceT, Union

from ._sched_seq import ScheduledBatch, SchedulerCapacityError, Sequence, SequenceStatus
from .errors import OutOfBlocksError, OutOfHostBlocksError

if TYPE_CHECKING:
    from .manager import BlockManager

logger = logging.getLogger("pagedkv")


class _PreemptMixin:
    """Preemption and reclaim of :class:`pagedkv.scheduler.Scheduler` (its state is set there)."""

    manager: "BlockManager"
    waiting: Deque[Sequence]
    running: List[Sequence]
    swapped: List[Sequence]
    can_swap: bool
    preemption_mode: str
    num_preemptions: int
    num_preemptions_by_mode: dict[str, int]
    num_swap_ins: int
    last_decision: Optional[tuple[Any, ...]]

    def choose_victim(self) -> List[Sequence]:
        """The sequences to reclaim when the pool runs dry: the most recently admitted running
        one, with the forked group it belongs to (its blocks are shared: freeing one member alone
        frees little).

        The core's :meth:`BlockManager.choose_victim` decides when the manager has it (so a Rust
        scheduler gets the same policy); its answer is used when every id in it is running here.
        """
        pick = getattr(self.manager, "choose_victim", None)
        if pick is not None:
            ids = pick()
            if ids:
                by_id = {s.seq_id: s for s in self.running}
                group = [by_id.get(int(i)) for i in ids]
                if all(g is not None for g in group):
                    return group  # type: ignore[return-value]
        last = self.running[-1]
        return [s for s in self.running if s.admitted_order == last.admitted_order]

    def decide(self, group: SequenceT[Sequence]) -> tuple:
        """``(mode, swap_cost_s, recompute_cost_s)`` for reclaiming ``group``.

        ``preemption_mode`` ``"swap"`` / ``"recompute"`` forces the mode (costs ``None``); ``"auto"``
        asks the manager's cost model (:meth:`BlockManager.decide`: swap = 2 x the group's KV bytes
        over the host link, recompute = what the tokens a re-admission would recompute after
        prefix hits, per branch, add to the steps that carry them beside the running decodes —
        nothing while a step stays under the model's step floor); ``"auto"`` on a manager with no
        ``cost_model`` set swaps. Without a host pool, or for part of a forked group (swap moves
        whole groups), it is always ``"recompute"``.
        """
        order = group[0].admitted_order
        whole = all(s in group for s in self.running if s.admitted_order == order)
        if not self.can_swap or not whole:
            return ("recompute", None, None)
        if self.preemption_mode != "auto" or getattr(self.manager, "cost_model", None) is None:
            # Forced, or "auto" with no rates to decide by: swap (the KV is kept, nothing redone).
            return ("swap" if self.preemption_mode == "auto" else self.preemption_mode, None, None)
        d = self.manager.decide([s.seq_id for s in group])
        return (d.mode, d.swap_cost_s, d.recompute_cost_s)

    def preempt(self, group: Union[Sequence, SequenceT[Sequence]]) -> str:
        """Reclaims ``group`` (a sequence or a forked group) by swap or recompute; returns the mode.

        Swap: the manager moves the group's blocks to host blocks (the copy pairs go out with the
        next step) and the sequences wait in :attr:`swapped` with their KV intact. Recompute (also
        the fallback when the host pool is full): their blocks are freed and they go back to the
        head of the waiting queue with all their token ids; re-admission recomputes what the prefix
        cache no longer holds.
        """
        if isinstance(group, Sequence):
            group = [group]
        group = list(group)
        mode, swap_s, rec_s = self.decide(group)
        self.last_decision = (mode, swap_s, rec_s)
        if mode == "swap":
            try:
                self.manager.swap_out([s.seq_id for s in group])
            except OutOfHostBlocksError:
                mode = "recompute"  # the host pool is full: the state is unchanged, recompute
        gone = set(map(id, group))
        self.running = [s for s in self.running if id(s) not in gone]
        for s in group:
            s.num_preemptions += 1
        self.num_preemptions += len(group)
        self.num_preemptions_by_mode[mode] += len(group)
        if mode == "swap":
            for s in group:
                s.status = SequenceStatus.SWAPPED
            self.swapped.extend(group)
            self.swapped.sort(key=lambda q: q.admitted_order)
        else:
            free_batch = getattr(self.manager, "free_batch", None)
            ids = [s.seq_id for s in group]
            if free_batch is not None:
                free_batch(ids)
            else:
                for i in ids:
                    self.manager.free(i)
            for s in reversed(group):
                s.status = SequenceStatus.WAITING
                s.num_computed_tokens = 0
                self.waiting.appendleft(s)
        if logger.isEnabledFor(logging.INFO):
            costs = ("" if swap_s is None else
                     f" (estimates: swap {1e3 * swap_s:.3f} ms, recompute {1e3 * rec_s:.3f} ms)")
            logger.info("preempted sequence%s %s (%d tokens) by %s%s",
                        "s" if len(group) > 1 else "", ", ".join(str(s.seq_id) for s in group),
                        sum(len(s.token_ids) for s in group), mode, costs)
        return mode

    def _swap_in(self, batch: ScheduledBatch, room: int) -> List[Sequence]:
        """Swaps groups back in, oldest first, while the pool (above the watermark) and ``room``
        (free batch rows) allow; returns the sequences resumed."""
        back: List[Sequence] = []
        while self.swapped:
            order = self.swapped[0].admitted_order
            group = [s for s in self.swapped if s.admitted_order == order]
            if sum(s.n for s in group) > room:
                break
            try:
                self.manager.swap_in([s.seq_id for s in group])
            except OutOfBlocksError:
                break
            room -= sum(s.n for s in group)
            self.swapped = self.swapped[len(group):]
            for s in group:
                s.status = SequenceStatus.RUNNING
            # Back into admission order: the tail of `running` stays the most recent admission.
            i = len(self.running)
            while i > 0 and self.running[i - 1].admitted_order > order:
                i -= 1
            self.running[i:i] = group
            self.num_swap_ins += len(group)
            back.extend(group)
        return back

    # ------------------------------------------------------------------------------ one step

    def _preempt_for_room(self, batch: ScheduledBatch, stuck: Sequence) -> None:
        if len(self.running) == 1:
            raise SchedulerCapacityError(
                f"sequence {stuck.seq_id} cannot grow past {stuck.num_computed_tokens} tokens even "
                f"alone: the pool of {self.manager.num_blocks} blocks (rows of "
                f"{self.manager.max_blocks_per_seq}) is too small for it",
                seq_id=stuck.seq_id, available=self.manager.num_free_blocks)
        victims = self.choose_victim()
        if len(victims) == len(self.running):
            # The group is all that runs: reclaim its newest member alone (by recompute: a swap
            # moves whole groups), so the others can go on.
            victims = [self.running[-1]]
        self.preempt(victims)
        batch.preempted.extend(victims)
