"""The proposer seam: what every way of drafting tokens provides, and the registry of them.

Owns :class:`Proposer` (the interface), :class:`Drafts` (one step's proposals), :data:`PROPOSERS`
(method name -> ``"module:Class"``) and :func:`build_proposer`. A proposer sees the sequences a
step decodes and proposes up to ``k`` tokens after each; it may attach the distribution each draft
was drawn from (a draft model, an EAGLE/MTP head), or none for a deterministic proposal (n-gram
lookup), which verification then treats as a point mass.

Two ways to draft: a proposer that needs nothing but token ids (n-gram lookup) answers
:meth:`Proposer.propose` with the tokens; a proposer that runs a model over the paged cache (a draft
model, :mod:`.draft`) needs the slots of the tokens it drafts, which exist only once the scheduler
has placed the drafts as provisional tokens: it sets :attr:`Proposer.drafts_in_step`, answers
:meth:`Proposer.propose` with how many tokens it will draft (placeholder ids), and draws them in
:meth:`Proposer.draft_step`, which the engine core calls with every scheduled batch before the
target's forward.

Invariants: a proposal never exceeds the ``limit`` given for its sequence; proposing changes no
engine state (a proposer with its own KV keeps it in lockstep with the target's: through
:meth:`Proposer.accepted`, or, for a draft model, by computing its KV at exactly the positions the
target computes, every step).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from .config import SpeculativeConfig

__all__ = ["Proposer", "Drafts", "PROPOSERS", "build_proposer"]


@dataclass
class Drafts:
    """One step's proposals: ``tokens[i]`` for sequence ``i`` (empty: none), and optionally
    ``probs[i]``, a ``[len(tokens[i]), vocab]`` tensor of the distributions they were drawn from
    (``None``: deterministic drafts)."""

    tokens: List[List[int]]
    probs: List[Any] = field(default_factory=list)

    def probs_of(self, i: int) -> Any:
        return self.probs[i] if self.probs else None


class Proposer:
    """Drafts tokens for the sequences of a step (subclass and register in :data:`PROPOSERS`).

    Args:
        config: The speculative settings.
        vocab_size: The target model's vocabulary (a draft with another one is refused).
    """

    #: The method name this proposer serves.
    method = ""
    #: Whether the drafts are drawn inside the step (:meth:`draft_step`) rather than by
    #: :meth:`propose`, which then gives only their number.
    drafts_in_step = False

    def __init__(self, config: SpeculativeConfig, vocab_size: int) -> None:
        self.config = config
        self.vocab_size = vocab_size

    def propose(self, token_ids: Sequence[Sequence[int]], limits: Sequence[int]) -> Drafts:
        """At most ``limits[i]`` draft tokens to follow ``token_ids[i]`` (a sequence's tokens so
        far, prompt first, ending with the token this step computes)."""
        raise NotImplementedError

    def draft_step(self, batch: Any, rows: Sequence[Optional[Any]]) -> Drafts:
        """A :attr:`drafts_in_step` proposer's work for one scheduled batch, called before the
        target's forward: draws the drafts that :meth:`propose` sized (writing them into
        ``batch.drafts`` in place, same lengths) and returns them per batch row with their
        distributions. ``rows[i]`` is row ``i``'s :class:`~..sampler.SamplerRow` where it carries
        drafts, else ``None``. Called for every batch, drafts or not (a draft model computes its
        KV wherever the target does)."""
        raise NotImplementedError

    def accepted(self, seq_ids: Sequence[int], num_accepted: Sequence[int]) -> None:
        """How many drafts of each sequence verification kept (a proposer with state, such as a
        draft model's KV, rewinds the rest). Stateless proposers ignore it."""


#: Method name -> ``"module:Class"`` of its :class:`Proposer` (imported when first built).
PROPOSERS: Dict[str, str] = {
    "ngram": "pagedkv.engine.spec_decode.ngram:NgramProposer",
    "draft_model": "pagedkv.engine.spec_decode.draft:DraftModelProposer",
}


def build_proposer(config: SpeculativeConfig, vocab_size: int, **parts: Any) -> Proposer:
    """The registered proposer of ``config.method``; ``parts`` go to its constructor (a draft
    model's runner: ``draft=``)."""
    module, _, name = PROPOSERS[config.method].partition(":")
    cls = getattr(importlib.import_module(module), name)
    proposer: Proposer = cls(config, vocab_size, **parts)
    return proposer


def clamp_limits(limits: Sequence[int], k: int) -> List[int]:
    """Each limit capped at ``k`` and floored at 0."""
    return [max(0, min(k, int(x))) for x in limits]


