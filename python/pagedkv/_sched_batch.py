"""The scheduler's batch builder (:class:`_BatchMixin`, a base of
:class:`pagedkv.scheduler.Scheduler`): one step's decodes, swap-ins, prompt chunks and admissions
(:meth:`schedule`), built into the step buffers, and :meth:`postprocess` once the step ran.

Invariants (with the scheduler's, in :mod:`pagedkv.scheduler`): a step's tokens never exceed
``max_num_batched_tokens`` nor its sequences ``max_num_seqs`` (except one first chunk in an
otherwise empty step); no admission and no swap-in in a step that preempted; admissions are first
come first served among the sequences the admission gate lets in.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence as SequenceT

from ._sched_preempt import _PreemptMixin
from ._sched_seq import GATE_SCAN, AdmissionGate, ScheduledBatch, Sequence, SequenceStatus
from .errors import InvalidArgumentError, OutOfBlocksError, SequenceTooLongError


class _BatchMixin(_PreemptMixin):
    """Building and recording the steps of :class:`pagedkv.scheduler.Scheduler` (its state is set
    there)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    admission_gate: Optional[AdmissionGate]
    metrics_hook: Optional[Callable[[], None]]
    num_recomputed_tokens: int
    num_steps: int
    _admissions: int
    propose: Optional[Callable[[List[Sequence], int], Optional[List[List[int]]]]]

    def schedule(self) -> ScheduledBatch:
        """Picks this step's batch, reserves its blocks and builds it into the step buffers.

        Returns an empty batch (``is_empty``) when nothing can run. Raises
        :class:`SchedulerCapacityError` when a lone running sequence cannot grow.
        """
        self._metrics_hook()
        batch = ScheduledBatch()
        while True:
            self._schedule_into(batch)
            if batch.seqs or not self.running:
                break
            # Running sequences exist but none could be given a token (their next chunks do not
            # fit the pool): make room by preempting the newest, then try again.
            self._preempt_for_room(batch, self.running[-1])
        return self._build(batch)

    def schedule_ahead(self, ahead: Dict[int, int]) -> Optional[ScheduledBatch]:
        """Schedules a step *before* the previous one's tokens are known (asynchronous
        scheduling); the previous step was :meth:`advance`-d at launch.

        ``ahead`` maps each sequence of the previous step that decodes next (``seq_id`` -> index
        of its token among the previous step's sampled tokens) to one provisional token (one
        ``append_provisional_batch``), which the caller commits once the token is known. Running
        sequences whose next token is already known decode too; prompt chunks and admissions
        follow as in :meth:`schedule`. Such a step never preempts and never
        swaps in: with swapped-out sequences, or when the decodes' tokens do not fit, nothing
        changes and ``None`` is returned (schedule that step once the previous one completed).
        """
        if self.swapped:
            return None
        batch = ScheduledBatch()
        if not self._schedule_ahead(batch, ahead):
            return None
        self._metrics_hook()
        self._schedule_into(batch, ahead_done=True)
        return self._build(batch)

    def _metrics_hook(self) -> None:
        hook = self.metrics_hook
        if hook is not None:
            self.metrics_hook = None
            hook()

    def _build(self, batch: ScheduledBatch) -> ScheduledBatch:
        if batch.seqs:
            ids = [s.seq_id for s in batch.seqs]
            batch.step = self.manager.step(ids, batch.num_new_tokens)
            batch.buffers = getattr(self.manager, "buffers", None)
            self.num_steps += 1
        return batch

    def _schedule_ahead(self, batch: ScheduledBatch, ahead: Dict[int, int]) -> bool:
        """The decodes of a step scheduled ahead (see :meth:`schedule_ahead`): one provisional
        token each for ``ahead``'s sequences, then the running sequences whose next token is
        already known (forked samples, a prompt that forked them), appended as usual. False
        (nothing changed) when the pool cannot hold them all."""
        m = self.manager
        pending = [s for s in self.running if s.seq_id in ahead][:self.max_num_seqs]
        known = [s for s in self.running if s.seq_id not in ahead
                 and len(s.token_ids) - s.num_computed_tokens == 1]
        known = known[:self.max_num_seqs - len(pending)]
        ids = [s.seq_id for s in pending]
        if pending:
            try:
                m.append_provisional_batch(ids, [1] * len(pending))
            except (OutOfBlocksError, SequenceTooLongError):
                return False
        if known:
            try:
                m.append_batch([s.seq_id for s in known], [s.token_ids[-1] for s in known])
            except OutOfBlocksError:
                if pending:
                    m.commit_batch(ids, [0] * len(ids), [])  # drops the provisional tokens
                return False
        batch.seqs = pending + known
        batch.num_new_tokens = [1] * len(batch.seqs)
        batch.num_decodes = len(batch.seqs)
        batch.ahead = {k: ahead[s.seq_id] for k, s in enumerate(pending)}
        return True

    def advance(self, batch: ScheduledBatch) -> None:
        """Moves each sequence of ``batch`` past its new tokens now, at launch, rather than in
        :meth:`postprocess` (which then only appends the sampled tokens): the next step can be
        scheduled before this one's tokens are known. Not for a step with drafts (how far a
        drafted sequence advances depends on verification)."""
        if batch.drafts:
            raise InvalidArgumentError(
                "invalid argument: batch: a step with drafts advances in postprocess",
                what="batch", value=batch.num_draft_tokens, reason="has drafts")
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            s.num_computed_tokens += n
        batch.advanced = True

    def _schedule_into(self, batch: ScheduledBatch, ahead_done: bool = False) -> None:
        m = self.manager
        budget = self.max_num_batched_tokens
        # A step scheduled ahead comes with its decodes; otherwise the batch is still empty.
        seqs: List[Sequence] = list(batch.seqs)
        news: List[int] = list(batch.num_new_tokens)
        budget -= len(seqs)

        # 1. Decodes, one append_batch for all; preempt the newest until the appends fit. (A step
        # scheduled ahead has its decodes already, as provisional tokens.)
        decodes: List[Sequence] = []
        while not ahead_done:
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
        if not ahead_done:
            seqs.extend(decodes)
            news.extend([1] * len(decodes))
            budget -= len(decodes)
            batch.num_decodes = len(decodes)
        # 1a. Speculative drafts for the decodes, held as provisional tokens (none when the pool
        # cannot hold them: the step decodes plainly).
        if decodes and self.propose is not None and budget > 0:
            drafts = self.propose(decodes, budget)
            if drafts and any(drafts):
                rows = [(s.seq_id, len(d)) for s, d in zip(decodes, drafts) if d]
                try:
                    m.append_provisional_batch([r[0] for r in rows], [r[1] for r in rows])
                except (OutOfBlocksError, SequenceTooLongError):
                    drafts = None
                if drafts:
                    batch.drafts = [list(d) for d in drafts]
                    for k, d in enumerate(drafts):
                        news[k] += len(d)
                        budget -= len(d)

        # 1b. Swapped-out groups come back, oldest first, unless this step had to preempt; those
        # whose next token is a decode join this step's decodes (the swap-in pairs go out with
        # this step, and the runner copies them in before the forward reads them).
        if self.swapped and not batch.preempted:  # never in a step ahead (schedule_ahead)
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
        if batch.drafts:
            batch.drafts.extend([] for _ in range(len(seqs) - len(batch.drafts)))

    def _first_ready(self, gate: "AdmissionGate") -> Optional[int]:
        """Index of the first waiting sequence the gate lets in, among the first
        :data:`GATE_SCAN` (so a long queue of fetching requests costs a bounded scan); None."""
        for i, q in enumerate(self.waiting):
            if i >= GATE_SCAN:
                return None
            if gate.ready(q):
                return i
        return None

    def postprocess(self, batch: ScheduledBatch, sampled: SequenceT[Optional[int]],
                    accepted: Optional[SequenceT[SequenceT[int]]] = None) -> None:
        """Records that ``batch`` ran: advances each sequence past its new tokens and appends the
        token sampled for it (``None`` where the step did not complete its known tokens).

        With drafts (:attr:`ScheduledBatch.drafts`), ``accepted[k]`` is the prefix of sequence
        ``k``'s drafts that verification kept: the manager commits those (one ``commit_batch``)
        and drops the rest, the sequence advances past its known token and them, and
        ``sampled[k]`` (the target's token after them) follows.
        """
        if len(sampled) != len(batch.seqs):
            raise InvalidArgumentError(
                f"invalid argument: sampled has {len(sampled)} entries for a batch of "
                f"{len(batch.seqs)}", what="sampled", value=len(sampled),
                reason=f"must equal the batch size ({len(batch.seqs)})")
        drafts = batch.drafts
        if drafts:
            if accepted is None or len(accepted) != len(batch.seqs):
                raise InvalidArgumentError(
                    "invalid argument: accepted: a step with drafts needs one accepted prefix per "
                    "sequence", what="accepted", value=-1 if accepted is None else len(accepted),
                    reason=f"must have {len(batch.seqs)} entries")
            ids: List[int] = []
            counts: List[int] = []
            flat: List[int] = []
            for s, d, a in zip(batch.seqs, drafts, accepted):
                if list(a) != d[:len(a)] or (a and not d):
                    raise InvalidArgumentError(
                        f"invalid argument: accepted tokens of sequence {s.seq_id} are not a "
                        f"prefix of its drafts", what="accepted", value=s.seq_id,
                        reason="must be a prefix of the sequence's drafts")
                if d:
                    ids.append(s.seq_id)
                    counts.append(len(a))
                    flat.extend(a)
            self.manager.commit_batch(ids, counts, flat)
        if batch.advanced:
            # Advanced at launch; a sequence that finished since (its step was already in
            # flight when its end was seen) takes no more tokens.
            for s, t in zip(batch.seqs, sampled):
                if t is not None and s.status is not SequenceStatus.FINISHED:
                    s.token_ids.append(int(t))
            return
        for k, (s, n, t) in enumerate(zip(batch.seqs, batch.num_new_tokens, sampled)):
            if drafts and drafts[k]:
                assert accepted is not None
                acc = accepted[k]
                s.num_computed_tokens += n - len(drafts[k]) + len(acc)
                s.token_ids.extend(int(x) for x in acc)
            else:
                s.num_computed_tokens += n
            if t is not None:
                s.token_ids.append(int(t))
