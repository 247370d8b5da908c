"""Iteration-level continuous batching over a :class:`pagedkv.BlockManager`.

Owns who runs next. The block manager answers "does this fit" (an admission or an append raises
:class:`~pagedkv.errors.OutOfBlocksError` and leaves it unchanged); the scheduler decides the
batch of every step and builds it with :meth:`BlockManager.step`, so the step buffers are filled
when :meth:`Scheduler.schedule` returns. One scheduler serves two executors: the reference engine
(:mod:`pagedkv.engine`, a real model) and the simulator (:mod:`pagedkv.simulate`).

Each step, in this order:

1. **Decodes.** Every running sequence with exactly one token not yet in the cache (its last
   sampled token) feeds it back, in one ``append_batch`` call. If the pool cannot supply the blocks
   those appends need — they may use the watermark reserve that admissions leave them, and it is
   exhausted — the most recently admitted running sequence is preempted and the call retried.
   With :attr:`Scheduler.propose` set, the decodes then get their speculative drafts as
   provisional tokens (one ``append_provisional_batch``; none at all when the pool cannot hold
   them, never a preemption for a draft), within the token budget; :meth:`Scheduler.postprocess`
   commits the accepted drafts and drops the rest.
2. **Running prefills.** Sequences admitted earlier whose prompt is not fully computed get their
   next chunk, oldest first, while the token budget (``max_num_batched_tokens``) and the pool last.
3. **Admissions.** Waiting sequences, first come first served, while the batch has room
   (``max_num_seqs``) and budget: :meth:`BlockManager.admit` looks the *whole* prompt up in the prefix
   cache and holds only the cached run plus the first chunk; later chunks arrive through step 2.
   No admission in a step that had to preempt: the pool is full, and re-admitting the victim at
   once would only thrash.

**Preemption** reclaims the victim :meth:`Scheduler.choose_victim` names — the most recently
admitted running sequence with its forked group (the core's ``choose_victim`` when the manager has
it) — in one of two ways, chosen per victim by :meth:`Scheduler.decide`: ``preemption_mode``
``"swap"`` / ``"recompute"`` forces one, ``"auto"`` asks the manager's cost model (2 x KV bytes
over the host link against the prefill of what the prefix cache no longer holds, per branch).

- *Swap* (needs a manager with a host pool): :meth:`BlockManager.swap_out` moves the group's
  blocks to host blocks; the copy pairs go out with the next step (the runner copies them before
  that step's forward writes anything) and the sequences wait in :attr:`Scheduler.swapped`. They
  come back first — before any new admission, in a step that did not preempt — through
  :meth:`BlockManager.swap_in`, and continue exactly where they stopped. A full host pool falls
  back to recompute.
- *Recompute*: the blocks are freed and the sequences go back to the head of the waiting queue with
  all their token ids (prompt and output so far); re-admission recomputes only what the prefix
  cache no longer holds, and the output continues where it stopped.

A forked group that is all that runs gives up its newest member alone, by recompute. No step holds
both a swap-out and a swap-in (swap-ins are skipped in a step that preempted), so a step's two swap
lists never touch the same host block. Each preemption is logged on the ``pagedkv`` logger with its
mode and both cost estimates.

Invariants, between steps:

- a running sequence's manager length equals its ``num_computed_tokens``; its remaining tokens
  ``token_ids[num_computed_tokens:]`` are what the next steps compute;
- ``running`` is in admission order (a fork sits right after its parent), so its tail is the
  most recently admitted sequence;
- a waiting sequence holds no blocks; a swapped one holds host blocks only;
- the tokens of one step never exceed ``max_num_batched_tokens`` and its sequences
  ``max_num_seqs``, except that the first admission of an otherwise empty step always gets at least
  one chunk, so no request starves.

This module holds :class:`Scheduler`'s state and queues (add, fork, finish) and is the public path;
the rest lives in :mod:`pagedkv._sched_seq` (sequences, batches, the admission gate protocol),
:mod:`pagedkv._sched_preempt` (preemption and reclaim) and :mod:`pagedkv._sched_batch` (the batch
builder), re-exported here.
"""


from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Deque, List, Optional, Sequence as SequenceT

from ._sched_batch import _BatchMixin
from ._sched_preempt import _PreemptMixin, logger
from ._sched_seq import (
    GATE_SCAN,
    PREEMPTION_MODES,
    AdmissionGate,
    ScheduledBatch,
    SchedulerCapacityError,
    Sequence,
    SequenceStatus,
    _check_int,
)
from .errors import InvalidArgumentError, InvalidConfigError

if TYPE_CHECKING:
    from .manager import BlockManager

__all__ = [
    "SequenceStatus",
    "Sequence",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerCapacityError",
]


class Scheduler(_BatchMixin, _PreemptMixin):
    """Continuous batching with chunked prefill and preemption by swap or recompute (module docs).

    Args:
        manager: The block manager; step buffers must be attached before the first step.
        max_num_seqs: Most sequences in one step (and running at once).
        max_num_batched_tokens: Token budget of one step (decodes count one each).
        enable_chunked_prefill: Split prompts longer than the remaining budget into chunks. When
            off, a prompt runs whole, in a step of its own if it exceeds the budget.
        preemption_mode: ``"auto"`` (the manager's cost model per victim), ``"swap"`` or
            ``"recompute"``; without a host pool every preemption recomputes.
        admission_gate: Asked before a waiting sequence is admitted (:attr:`admission_gate`);
            None: every sequence is ready.
        can_swap: Whether preemption may swap (:attr:`can_swap`). None: when the manager has a
            host pool; False keeps a host pool that is the prefix cache's host tier alone out
            of preemption. True without a host pool is refused.

    Raises:
        InvalidConfigError: A size is not an int >= 1, ``preemption_mode`` is unknown,
            ``can_swap`` is not a bool or None, or True without a host pool.
    """

    def __init__(self, manager: "BlockManager", *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True,
                 preemption_mode: str = "auto", admission_gate: Optional["AdmissionGate"] = None,
                 can_swap: Optional[bool] = None) -> None:
        self.manager = manager
        if preemption_mode not in PREEMPTION_MODES:
            raise InvalidConfigError(
                f"invalid scheduler config: preemption_mode = {preemption_mode!r}: must be one of "
                f"{', '.join(PREEMPTION_MODES)}", field="preemption_mode", value=preemption_mode,
                reason="must be 'auto', 'swap' or 'recompute'")
        #: Swap needs a manager with a host pool; without one every preemption is a recompute.
        has_host = bool(getattr(manager, "num_host_blocks", 0)) and hasattr(manager, "swap_out")
        if can_swap is not None and (not isinstance(can_swap, bool) or (can_swap and not has_host)):
            raise InvalidConfigError(
                f"invalid scheduler config: can_swap = {can_swap!r}: must be a bool or None, and "
                "True needs a manager with a host pool", field="can_swap", value=can_swap,
                reason="must be a bool or None; True needs num_host_blocks > 0")
        self.can_swap = has_host if can_swap is None else can_swap
        self.preemption_mode = preemption_mode
        self.max_num_seqs = _check_int("max_num_seqs", max_num_seqs, 1)
        self.max_num_batched_tokens = _check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        if not isinstance(enable_chunked_prefill, bool):
            raise InvalidConfigError(
                f"invalid scheduler config: enable_chunked_prefill = {enable_chunked_prefill!r}: "
                "must be a bool", field="enable_chunked_prefill", value=enable_chunked_prefill,
                reason="must be a bool")
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: Deque[Sequence] = deque()
        self.running: List[Sequence] = []
        #: Swapped-out sequences, in admission order (a forked group together); resumed oldest
        #: first, before any new admission.
        self.swapped: List[Sequence] = []
        self._admissions = 0
        #: Ids of the sequences queued or running.
        self._ids: set[int] = set()
        #: Sequences preempted over the scheduler's life, and by reclamation mode.
        self.num_preemptions = 0
        self.num_preemptions_by_mode = {"swap": 0, "recompute": 0}
        #: Sequences swapped back in.
        self.num_swap_ins = 0
        #: The latest preemption decision: ``(mode, swap_cost_s, recompute_cost_s)``; costs are
        #: ``None`` where no cost model was asked.
        self.last_decision: Optional[tuple] = None
        #: Prompt tokens recomputed after preemption (re-admission misses).
        self.num_recomputed_tokens = 0
        self.num_steps = 0
        #: Called once, with no arguments, at the start of the next :meth:`schedule`, then
        #: cleared: how a metrics scrape gets a snapshot taken at a step boundary, in the step's
        #: own thread (:mod:`pagedkv.metrics`).
        self.metrics_hook: Optional[Callable[[], None]] = None
        #: Asked before a waiting sequence is admitted (the tiered prefix cache's
        #: :class:`~pagedkv.tiers.TierCache`): ``ready(seq)`` False keeps it waiting
        #: while its cached blocks are fetched from a lower tier, and the sequences behind it may
        #: be admitted meanwhile; ``admitted(seq, admit_result)`` once it is, ``forget(seq)``
        #: when it leaves unadmitted. None: all ready.
        self.admission_gate: Optional[AdmissionGate] = admission_gate
        #: Speculative decoding (set by the engine): called with the step's decodes and the token
        #: budget left after them, returns each decode's draft tokens (an empty list: none), which
        #: the step computes after its known token as the manager's provisional tokens;
        #: :meth:`postprocess` commits the accepted ones. None: no speculation.
        self.propose: Optional[Callable[[List[Sequence], int], Optional[List[List[int]]]]] = None

    # ------------------------------------------------------------------------------ queues

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence (FCFS)."""
        if not isinstance(seq, Sequence):
            raise InvalidArgumentError(
                f"invalid argument: seq = {seq!r}: must be a pagedkv.scheduler.Sequence",
                what="seq", value=repr(seq), reason="must be a Sequence")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens \
                or seq.seq_id in self._ids:
            raise InvalidArgumentError(
                f"invalid argument: sequence {seq.seq_id} is {seq.status.value} or its id is in "
                "use: only a new sequence can be added", what="seq", value=seq.seq_id,
                reason="only a new sequence can be added")
        self._ids.add(seq.seq_id)
        self.waiting.append(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Starts ``child`` as a copy of ``parent``'s computed tokens, sharing its blocks.

        ``child.token_ids`` becomes ``parent.token_ids[:parent.num_computed_tokens]`` (everything the
        cache holds; the parent's own last sampled token, if any, is not copied): append the
        child's own sampled token with :meth:`Sequence.append_token`. The first write into the
        shared tail block copies it (copy-on-write, emitted by the next step).
        """
        if parent.status is not SequenceStatus.RUNNING:
            raise InvalidArgumentError(
                f"invalid argument: parent sequence {parent.seq_id} is {parent.status.value}: "
                "only a running sequence can be forked", what="parent", value=parent.seq_id,
                reason="must be running")
        if child.seq_id in self._ids:
            raise InvalidArgumentError(
                f"invalid argument: child sequence id {child.seq_id} is in use", what="child",
                value=child.seq_id, reason="id in use")
        self.manager.fork(parent.seq_id, child.seq_id)
        self._ids.add(child.seq_id)
        nc = parent.num_computed_tokens
        child.token_ids = parent.token_ids[:nc]
        child.num_prompt_tokens = min(parent.num_prompt_tokens, nc)
        child.num_computed_tokens = nc
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = SequenceStatus.RUNNING
        child.admitted_order = parent.admitted_order
        parent.n = max(1, parent.n - 1)
        # After the parent and its earlier forks: `running` stays in admission order.
        i = self.running.index(parent) + 1
        while i < len(self.running) and self.running[i].admitted_order == parent.admitted_order:
            i += 1
        self.running.insert(i, child)

    def finish(self, seq: Sequence) -> None:
        """Frees a running, swapped (or waiting) sequence's blocks; it leaves the scheduler."""
        if seq.status is SequenceStatus.RUNNING:
            self.manager.free(seq.seq_id)
            self.running.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.manager.free(seq.seq_id)
            self.swapped.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            if self.admission_gate is not None:
                self.admission_gate.forget(seq)
        self._ids.discard(seq.seq_id)
        seq.status = SequenceStatus.FINISHED

    def finish_many(self, seqs: SequenceT[Sequence]) -> None:
        """:meth:`finish` for several sequences with one manager call."""
        run = [s for s in seqs if s.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED)]
        if run:
            ids = [s.seq_id for s in run]
            free_batch = getattr(self.manager, "free_batch", None)
            if free_batch is not None:
                free_batch(ids)
            else:
                for i in ids:
                    self.manager.free(i)
            gone = set(map(id, run))
            self.running = [s for s in self.running if id(s) not in gone]
            if self.swapped:
                self.swapped = [s for s in self.swapped if id(s) not in gone]
        for s in seqs:
            if s.status is SequenceStatus.WAITING:
                self.waiting.remove(s)
                if self.admission_gate is not None:
                    self.admission_gate.forget(s)
            self._ids.discard(s.seq_id)
            s.status = SequenceStatus.FINISHED

    # ---------------------------------------------------------------------------- preemption
