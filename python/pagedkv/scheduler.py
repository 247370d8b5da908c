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
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Deque, List, Optional, Protocol,
                    Sequence as SequenceT, Union)

import numpy as np

from ._checks import check_salt
from .errors import InvalidArgumentError, InvalidConfigError, OutOfBlocksError, OutOfHostBlocksError

if TYPE_CHECKING:
    from .buffers import StepBuffers, StepInfo
    from .manager import BlockManager

logger = logging.getLogger("pagedkv")

__all__ = [
    "SequenceStatus",
    "Sequence",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerCapacityError",
]


class SchedulerCapacityError(OutOfBlocksError):
    """A sequence cannot make progress even with every other sequence preempted.

    Raised by :meth:`Scheduler.schedule` when the only running sequence cannot get the block its
    next token needs: the pool (or ``max_blocks_per_seq``) is too small for it.
    Attributes: ``needed``, ``available`` (as :class:`OutOfBlocksError`), ``seq_id``.
    """

    def __init__(self, message: str, *, seq_id: int, needed: int = 1, available: int = 0) -> None:
        super().__init__(message, needed=needed, available=available)
        self.seq_id = seq_id


class SequenceStatus(enum.Enum):
    """Where a sequence is: queued (no blocks), running (blocks held), swapped out (its blocks in
    host memory, resumed by a swap-in), or done (freed)."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


#: How :class:`Scheduler` reclaims a victim: by the cost model, or always one way.
PREEMPTION_MODES = ("auto", "swap", "recompute")
#: Waiting sequences an admission gate is asked about per admission, at most.
GATE_SCAN = 64


class AdmissionGate(Protocol):
    """What :attr:`Scheduler.admission_gate` is asked (see there)."""

    def ready(self, seq: "Sequence") -> bool: ...

    def admitted(self, seq: "Sequence", result: Any) -> None: ...

    def forget(self, seq: "Sequence") -> None: ...



def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidConfigError(
            f"invalid scheduler config: {name} = {value!r}: must be an integer >= {minimum}",
            field=name, value=value, reason=f"must be an integer >= {minimum}",
        )
    return int(value)


class Sequence:
    """One sequence: a prompt and the tokens generated after it (one sample of a request).

    ``token_ids[:num_computed_tokens]`` have their KV in the cache; the rest — the prompt's
    uncomputed part, or the last sampled token — are computed by the next steps.
    """

    __slots__ = ("seq_id", "request_id", "token_ids", "num_prompt_tokens", "num_computed_tokens",
                 "cache_salt", "status", "num_cached_tokens", "num_preemptions", "arrival",
                 "admitted_order", "n", "data")

    def __init__(self, seq_id: int, token_ids: SequenceT[int], *, request_id: str = "",
                 cache_salt: Union[bytes, str, None] = None, arrival: float = 0.0,
                 _own: bool = False) -> None:
        """The ids are copied as ints. ``_own=True`` is the engine's alone: ``token_ids`` is a
        new list of plain ints it has checked against the vocabulary and does not use again,
        which the sequence keeps as is (no copy, no conversion of each token: a 32K-token
        prompt's ~1.4 ms). Unchecked ids would be refused only when the sequence is admitted,
        inside a step, so other callers keep the converting path."""
        if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)) or seq_id < 0:
            raise InvalidArgumentError(
                f"invalid argument: seq_id = {seq_id!r}: must be a non-negative integer",
                what="seq_id", value=seq_id, reason="must be a non-negative integer")
        if _own:
            if type(token_ids) is not list:
                raise InvalidArgumentError(
                    f"invalid argument: token_ids: _own=True takes a list, got "
                    f"{type(token_ids).__name__}", what="token_ids", value=-1,
                    reason="_own=True takes a list")
            tokens = token_ids
        elif isinstance(token_ids, np.ndarray):
            tokens = token_ids.tolist()
        else:
            tokens = list(map(int, token_ids))
        if not tokens:
            raise InvalidArgumentError(
                f"invalid argument: token_ids of sequence {seq_id}: a prompt needs at least one token",
                what="token_ids", value=0, reason="a prompt needs at least one token")
        self.seq_id = int(seq_id)
        self.request_id = request_id
        self.token_ids: List[int] = tokens
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        # Refused here rather than at admission, inside a step.
        self.cache_salt = check_salt("cache_salt", cache_salt)
        self.status = SequenceStatus.WAITING
        #: Prompt tokens served from the prefix cache at the latest admission.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.arrival = arrival
        #: Admission order (larger = more recent); a fork inherits its parent's.
        self.admitted_order = -1
        #: Sequences this one becomes once its prompt is computed (parallel samples forked from
        #: it); admission keeps room for all of them under ``max_num_seqs``.
        self.n = 1
        #: Free slot for the executor (sampling state, per-request bookkeeping).
        self.data: object = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> List[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, status={self.status.value}, "
                f"tokens={self.num_tokens} (prompt {self.num_prompt_tokens}), "
                f"computed={self.num_computed_tokens})")


@dataclass
class ScheduledBatch:
    """One step's batch, already built into the manager's step buffers.

    ``seqs[k]`` computes ``num_new_tokens[k]`` tokens, ``token_ids[start:start + n]`` with
    ``start = seqs[k].num_computed_tokens`` (until :meth:`Scheduler.postprocess` advances it).
    Decodes come first, then prefill chunks, in the order of the step buffers' rows.
    """

    seqs: List[Sequence] = field(default_factory=list)
    num_new_tokens: List[int] = field(default_factory=list)
    step: Optional["StepInfo"] = None
    #: Sequences preempted while building this step (already back in the waiting queue).
    preempted: List[Sequence] = field(default_factory=list)
    num_decodes: int = 0
    #: The step buffers the manager built :attr:`step` into (None for an empty batch).
    buffers: Optional["StepBuffers"] = None

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def is_decode_only(self) -> bool:
        return bool(self.seqs) and self.num_decodes == len(self.seqs)

    def input_ids(self) -> np.ndarray:
        """Token ids of the step's new tokens, concatenated in batch order (int64)."""
        if self.num_decodes == len(self.seqs):  # one new token each: no slices
            return np.array([s.token_ids[s.num_computed_tokens] for s in self.seqs],
                            dtype=np.int64)
        out = np.empty(self.num_tokens, dtype=np.int64)
        p = 0
        for s, n in zip(self.seqs, self.num_new_tokens):
            start = s.num_computed_tokens
            out[p:p + n] = s.token_ids[start:start + n]
            p += n
        return out

    def positions(self) -> np.ndarray:
        """Positions of the step's new tokens, concatenated in batch order (int64): what the
        manager wrote into the step buffers (:meth:`pagedkv.StepBuffers.positions`)."""
        if self.step is None or self.buffers is None:
            return np.empty(0, dtype=np.int64)
        return self.buffers.positions(self.step)

    def sample_mask(self) -> List[bool]:
        """True where this step computes a sequence's last known token (its logits are sampled)."""
        return [s.num_computed_tokens + n == len(s.token_ids)
                for s, n in zip(self.seqs, self.num_new_tokens)]

    def sample_rows(self) -> List[int]:
        """Batch rows whose logits are sampled (see :meth:`sample_mask`)."""
        return [k for k, m in enumerate(self.sample_mask()) if m]


class Scheduler:
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

    def schedule(self) -> ScheduledBatch:
        """Picks this step's batch, reserves its blocks and builds it into the step buffers.

        Returns an empty batch (``is_empty``) when nothing can run. Raises
        :class:`SchedulerCapacityError` when a lone running sequence cannot grow.
        """
        hook = self.metrics_hook
        if hook is not None:
            self.metrics_hook = None
            hook()
        batch = ScheduledBatch()
        while True:
            self._schedule_into(batch)
            if batch.seqs or not self.running:
                break
            # Running sequences exist but none could be given a token (their next chunks do not
            # fit the pool): make room by preempting the newest, then try again.
            self._preempt_for_room(batch, self.running[-1])
        if batch.seqs:
            ids = [s.seq_id for s in batch.seqs]
            batch.step = self.manager.step(ids, batch.num_new_tokens)
            batch.buffers = getattr(self.manager, "buffers", None)
            self.num_steps += 1
        return batch

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

    def _schedule_into(self, batch: ScheduledBatch) -> None:
        m = self.manager
        budget = self.max_num_batched_tokens
        seqs: List[Sequence] = []
        news: List[int] = []

        # 1. Decodes, one append_batch for all; preempt the newest until the appends fit.
        while True:
            decodes = [s for s in self.running if len(s.token_ids) - s.num_computed_tokens == 1]
            if len(decodes) > self.max_num_seqs:
                decodes = decodes[:self.max_num_seqs]
            if not decodes:
                break
            try:
                m.append_batch([s.seq_id for s in decodes], [s.token_ids[-1] for s in decodes])
                break
            except OutOfBlocksError:
                self._preempt_for_room(batch, decodes[-1])
        seqs.extend(decodes)
        news.extend([1] * len(decodes))
        budget -= len(decodes)
        batch.num_decodes = len(decodes)

        # 1b. Swapped-out groups come back, oldest first, unless this step had to preempt; those
        # whose next token is a decode join this step's decodes (the swap-in pairs go out with
        # this step, and the runner copies them in before the forward reads them).
        if self.swapped and not batch.preempted:
            back = self._swap_in(batch, self.max_num_seqs - sum(q.n for q in self.running))
            dec = [q for q in back if q.num_uncomputed_tokens == 1][: self.max_num_seqs - len(seqs)]
            if dec:
                try:
                    m.append_batch([q.seq_id for q in dec], [q.token_ids[-1] for q in dec])
                except OutOfBlocksError:
                    dec = []  # they decode next step
                seqs.extend(dec)
                news.extend([1] * len(dec))
                budget -= len(dec)
                batch.num_decodes += len(dec)

        # 2. Chunks of prompts already admitted, oldest first.
        for s in self.running:
            if budget <= 0 or len(seqs) >= self.max_num_seqs:
                break
            left = s.num_uncomputed_tokens
            if left <= 1:
                continue
            if left > budget and not self.enable_chunked_prefill:
                if seqs:
                    break
                k = left
            else:
                k = min(left, budget)
            start = s.num_computed_tokens
            try:
                m.append(s.seq_id, s.token_ids[start:start + k])
            except OutOfBlocksError:
                break
            seqs.append(s)
            news.append(k)
            budget -= k

        # 3. Admissions, FCFS; none in a step that preempted, nor while a swapped-out group waits to
        # come back (it goes first). `occupied` counts the sequences the running ones will become
        # once their pending forks are made.
        occupied = sum(q.n for q in self.running)
        gate = self.admission_gate
        while self.waiting and not batch.preempted and not self.swapped and budget > 0 \
                and len(seqs) < self.max_num_seqs:
            at = 0 if gate is None else self._first_ready(gate)
            if at is None:
                break
            s = self.waiting[at]
            if occupied + s.n > self.max_num_seqs:
                break
            chunk = budget if self.enable_chunked_prefill else None
            try:
                r = m.admit(s.seq_id, s.token_ids, cache_salt=s.cache_salt, max_new_tokens=chunk)
            except OutOfBlocksError:
                break
            k = r.num_tokens - r.cached_tokens
            if not self.enable_chunked_prefill and k > budget and seqs:
                m.free(s.seq_id)  # does not fit this step's budget: next step, on its own
                break
            if at == 0:
                self.waiting.popleft()
            else:
                del self.waiting[at]
            if gate is not None:
                gate.admitted(s, r)
            if s.num_preemptions:
                self.num_recomputed_tokens += len(s.token_ids) - r.cached_tokens
            s.status = SequenceStatus.RUNNING
            s.num_computed_tokens = r.cached_tokens
            s.num_cached_tokens = r.cached_tokens
            self._admissions += 1
            s.admitted_order = self._admissions
            self.running.append(s)
            occupied += s.n
            seqs.append(s)
            news.append(k)
            budget -= k

        batch.seqs = seqs
        batch.num_new_tokens = news

    def _first_ready(self, gate: "AdmissionGate") -> Optional[int]:
        """Index of the first waiting sequence the gate lets in, among the first
        :data:`GATE_SCAN` (so a long queue of fetching requests costs a bounded scan); None."""
        for i, q in enumerate(self.waiting):
            if i >= GATE_SCAN:
                return None
            if gate.ready(q):
                return i
        return None

    def postprocess(self, batch: ScheduledBatch, sampled: SequenceT[Optional[int]]) -> None:
        """Records that ``batch`` ran: advances each sequence past its new tokens and appends the
        token sampled for it (``None`` where the step did not complete its known tokens)."""
        if len(sampled) != len(batch.seqs):
            raise InvalidArgumentError(
                f"invalid argument: sampled has {len(sampled)} entries for a batch of "
                f"{len(batch.seqs)}", what="sampled", value=len(sampled),
                reason=f"must equal the batch size ({len(batch.seqs)})")
        for s, n, t in zip(batch.seqs, batch.num_new_tokens, sampled):
            s.num_computed_tokens += n
            if t is not None:
                s.token_ids.append(int(t))

