"""The scheduler's queued objects and limits: :class:`Sequence` (one sample of a request and its
progress through the cache), :class:`SequenceStatus`, :class:`ScheduledBatch` (one step's batch),
the :class:`AdmissionGate` protocol, :class:`SchedulerCapacityError` and the preemption modes.

Invariants: a :class:`Sequence` validates its inputs on construction (bad ones raise
:class:`pagedkv.errors.InvalidArgumentError`) and its ``num_computed_tokens`` never exceeds its
token count; a :class:`ScheduledBatch` holds one new-token count per sequence. Imported through
:mod:`pagedkv.scheduler`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, Sequence as SequenceT, Union

import numpy as np

from ._checks import check_salt
from .errors import InvalidArgumentError, InvalidConfigError, OutOfBlocksError

if TYPE_CHECKING:
    from .buffers import StepBuffers, StepInfo


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
    #: Speculative drafts, one list per sequence (empty: none), or ``[]`` when no sequence of the
    #: step has any. A drafted sequence's ``num_new_tokens`` counts its last known token and its
    #: drafts, which the manager holds as provisional tokens until :meth:`Scheduler.postprocess`.
    drafts: List[List[int]] = field(default_factory=list)
    #: Scheduled ahead (``Scheduler.schedule(ahead=...)``): batch row -> the index, in the previous
    #: step's sampled tokens, of the token this row computes. Such a row's one new token is the
    #: token the previous step is still sampling: the manager holds it as a provisional token
    #: until that step completes, and :meth:`input_ids` has a placeholder ``0`` for it (the
    #: runner reads the token from the previous step's sampled tokens on the device).
    ahead: Dict[int, int] = field(default_factory=dict)
    #: Whether :meth:`Scheduler.advance` already moved the sequences past this step's tokens (at
    #: launch, when the next step is scheduled before this one's tokens are known).
    advanced: bool = False

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(d) for d in self.drafts)

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
        ahead = self.ahead
        if ahead:
            return np.array([0 if k in ahead else s.token_ids[s.num_computed_tokens + j]
                             for k, (s, n) in enumerate(zip(self.seqs, self.num_new_tokens))
                             for j in range(n)], dtype=np.int64)
        if self.num_decodes == len(self.seqs) and not self.drafts:  # one new token each
            return np.array([s.token_ids[s.num_computed_tokens] for s in self.seqs],
                            dtype=np.int64)
        out = np.empty(self.num_tokens, dtype=np.int64)
        p = 0
        drafts = self.drafts
        for k, (s, n) in enumerate(zip(self.seqs, self.num_new_tokens)):
            start = s.num_computed_tokens
            d = drafts[k] if drafts else ()
            known = n - len(d)
            out[p:p + known] = s.token_ids[start:start + known]
            if d:
                out[p + known:p + n] = d
            p += n
        return out

    def positions(self) -> np.ndarray:
        """Positions of the step's new tokens, concatenated in batch order (int64): what the
        manager wrote into the step buffers (:meth:`pagedkv.StepBuffers.positions`)."""
        if self.step is None or self.buffers is None:
            return np.empty(0, dtype=np.int64)
        return self.buffers.positions(self.step)

    def sample_mask(self) -> List[bool]:
        """True where this step computes a sequence's last known token (its logits are sampled),
        and on rows scheduled ahead (their one token is the last once the previous step's
        arrives)."""
        if self.ahead:
            ahead = self.ahead
            return [k in ahead or s.num_computed_tokens + n == len(s.token_ids)
                    for k, (s, n) in enumerate(zip(self.seqs, self.num_new_tokens))]
        if self.drafts:
            return [s.num_computed_tokens + n - len(d) == len(s.token_ids)
                    for s, n, d in zip(self.seqs, self.num_new_tokens, self.drafts)]
        return [s.num_computed_tokens + n == len(s.token_ids)
                for s, n in zip(self.seqs, self.num_new_tokens)]

    def sample_rows(self) -> List[int]:
        """Batch rows whose logits are sampled (see :meth:`sample_mask`)."""
        return [k for k, m in enumerate(self.sample_mask()) if m]
