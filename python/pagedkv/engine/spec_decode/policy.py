"""When speculation pays: :class:`DraftPolicy`, the per-step cap on draft length from the measured
cost model and the measured acceptance.

A step's cost follows the engine's cost model (``EngineCore.cost_rates``, measured at start-up
and cached per model and device, or given as ``prefill_tokens_per_s`` / ``step_floor_s``):
``cost(T) = max(step_floor_s, T / prefill_tokens_per_s)`` for a step of ``T`` tokens. Below the
knee (``T <= floor * rate``) a step is bound by weights and launches, and drafts ride free; past
it every verified position costs ``1 / rate``. A sequence whose drafts are capped at ``c`` emits
``1 + sum_{j < c} prod_{i <= j} p_i`` tokens in expectation, ``p_i`` the measured probability
that the ``i``-th draft is accepted given the ones before it were. Each step the policy picks the
cap ``c`` in ``0..k`` with the most expected tokens per second of step over the proposer's
drafts; ``c = 0`` sends the step without drafts.

With a draft model (``draft_rates``: its own ``(prefill_tokens_per_s, step_floor_s)``, measured
on its runner), each step's draft forwards are priced too: the draft runs one forward over the
step's decodes every step (its KV follows the target's, drafting or not), then one more per draft
position ``j = 1..c`` over the sequences still drafting there, each costing
``max(draft floor, tokens / draft rate)``. The n-gram proposer costs nothing on the device.

Acceptance is learnt online: each position's evaluated and accepted counts decay by
:data:`DECAY` per observed step that evaluated it (recent steps weigh most; a position the cap
kept out keeps its estimate) and start from one accepted and one rejected pseudo-count. Until :data:`WARMUP` drafted sequence-steps were observed the cap is ``k``
(nothing measured yet), and after :data:`PROBE_AFTER` steps in a row without drafts one step
drafts at ``k`` so the estimate follows a workload that changes. The step's prefill tokens are not
known when drafts are chosen (the scheduler places decodes and their drafts first); the policy
counts the decodes and their drafts only.

Invariants: the cap is in ``[0, k]``; an engine without measured rates never constructs a policy
(every step drafts, as before); ``disable_by_batch_size`` still applies first.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ...errors import InvalidArgumentError

__all__ = ["DraftPolicy", "DECAY", "WARMUP", "PROBE_AFTER"]

#: Per observed step, the factor on each position's counts.
DECAY = 0.99
#: Drafted sequence-steps observed before the measured acceptance is trusted.
WARMUP = 32
#: Steps in a row without drafts after which one step drafts at ``k`` again.
PROBE_AFTER = 64


class DraftPolicy:
    """The draft-length cap of each step (module doc).

    Args:
        k: ``num_speculative_tokens``.
        prefill_tokens_per_s: The cost model's rate (tokens a step adds per second past the knee).
        step_floor_s: The cost model's floor (what a step costs however few tokens it carries).
        draft_rates: A draft model's ``(prefill_tokens_per_s, step_floor_s)``: its forwards are
            priced beside the target's (module doc). None: drafts cost no device time (n-gram).
    """

    def __init__(self, k: int, prefill_tokens_per_s: float, step_floor_s: float,
                 draft_rates: Optional[Tuple[float, float]] = None) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidArgumentError(f"k = {k!r}: must be an int >= 1", what="k", value=k,
                                       reason="must be an int >= 1")
        if not prefill_tokens_per_s > 0 or not step_floor_s >= 0:
            rates = (prefill_tokens_per_s, step_floor_s)
            raise InvalidArgumentError(
                f"rates {rates!r}: the prefill rate must be > 0 and the floor >= 0",
                what="rates", value=rates, reason="prefill rate > 0, floor >= 0")
        if draft_rates is not None and not (draft_rates[0] > 0 and draft_rates[1] >= 0):
            raise InvalidArgumentError(
                f"draft_rates {tuple(draft_rates)!r}: the prefill rate must be > 0 and the floor "
                f">= 0", what="draft_rates", value=tuple(draft_rates),
                reason="prefill rate > 0, floor >= 0")
        self.k = k
        self.rate = float(prefill_tokens_per_s)
        self.floor = float(step_floor_s)
        #: The draft model's (rate, floor), or None.
        self.draft_rates = None if draft_rates is None else (float(draft_rates[0]),
                                                             float(draft_rates[1]))
        #: Decayed counts per draft position: evaluated (the drafts before it were accepted) and
        #: accepted.
        self.evaluated = [0.0] * k
        self.accepted = [0.0] * k
        #: Drafted sequence-steps observed (not decayed: the warm-up's clock).
        self.observed = 0
        #: Steps in a row this policy sent without drafts.
        self.off_in_row = 0
        #: Steps sent with shorter drafts than the proposer had (but some).
        self.num_steps_capped = 0

    def acceptance(self) -> List[float]:
        """Each position's conditional acceptance estimate ``p_j``."""
        return [(a + 1.0) / (e + 2.0) for a, e in zip(self.accepted, self.evaluated)]

    def cost(self, tokens: int) -> float:
        """The cost model's time for a step of ``tokens`` tokens."""
        return max(self.floor, tokens / self.rate)

    def draft_cost(self, num_decodes: int, lengths: Sequence[int], c: int) -> float:
        """The draft model's forwards in a step with drafts capped at ``c`` (0 without a draft
        model): one over the decodes, then one per position ``1..c`` over the sequences drafting
        that far."""
        if self.draft_rates is None:
            return 0.0
        rate, floor = self.draft_rates
        t = max(floor, num_decodes / rate)
        for j in range(1, c + 1):
            active = sum(1 for n in lengths if min(c, n) >= j)
            if active:
                t += max(floor, active / rate)
        return t

    def cap(self, num_decodes: int, lengths: Sequence[int]) -> int:
        """The draft length cap for a step with ``num_decodes`` decodes whose proposer drafted
        ``lengths`` tokens each (one per drafting decode): ``0`` for no drafts at all."""
        longest = max(lengths, default=0)
        if longest == 0:
            return 0
        if self.observed < WARMUP or self.off_in_row >= PROBE_AFTER:
            self.off_in_row = 0
            return min(self.k, longest)
        p = self.acceptance()
        # gain[c]: expected tokens one sequence emits beyond its own with drafts capped at c.
        gain = [0.0]
        run = 1.0
        for j in range(min(self.k, longest)):
            run *= p[j]
            gain.append(gain[-1] + run)
        best = 0
        best_rate = num_decodes / (self.cost(num_decodes) + self.draft_cost(num_decodes, lengths, 0))
        for c in range(1, len(gain)):
            extra = sum(gain[min(c, n)] for n in lengths)
            tokens = num_decodes + sum(min(c, n) for n in lengths)
            rate = (num_decodes + extra) / (self.cost(tokens)
                                            + self.draft_cost(num_decodes, lengths, c))
            if rate >= best_rate:
                best, best_rate = c, rate
        if best == 0:
            self.off_in_row += 1
        else:
            self.off_in_row = 0
            if best < longest:
                self.num_steps_capped += 1
        return best

    def observe(self, drafted: Sequence[int], num_accepted: Sequence[int]) -> None:
        """Folds one verified step in: each drafting sequence's draft length and how many of its
        drafts were accepted."""
        if not drafted:
            return
        # Only the positions this step evaluated age: a position the cap kept out of recent steps
        # keeps what was last learnt of it (decaying it towards the prior would make the policy
        # trust deep drafts less the longer it does not send them, and so never send them again).
        depth = max((min(n, m + 1, self.k) for n, m in zip(drafted, num_accepted)), default=0)
        for j in range(depth):
            self.evaluated[j] *= DECAY
            self.accepted[j] *= DECAY
        for n, m in zip(drafted, num_accepted):
            for j in range(min(n, m + 1, self.k)):
                self.evaluated[j] += 1.0
                if j < m:
                    self.accepted[j] += 1.0
        self.observed += len(drafted)
