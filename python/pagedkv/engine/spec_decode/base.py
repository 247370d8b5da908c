"""The proposer seam: what every way of drafting tokens provides, and the registry of them.

Owns :class:`Proposer` (the interface), :class:`Drafts` (one step's proposals), :data:`PROPOSERS`
(method name -> ``"module:Class"``) and :func:`build_proposer`. A proposer sees the sequences a
step decodes and proposes up to ``k`` tokens after each; it may attach the distribution each draft
was drawn from (a draft model, an EAGLE/MTP head), or none for a deterministic proposal (n-gram
lookup), which verification then treats as a point mass. Invariants: a proposal never exceeds the
``limit`` given for its sequence; proposing changes no engine state (a proposer with its own KV
keeps it in lockstep through :meth:`Proposer.accepted`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence

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

    def __init__(self, config: SpeculativeConfig, vocab_size: int) -> None:
        self.config = config
        self.vocab_size = vocab_size

    def propose(self, token_ids: Sequence[Sequence[int]], limits: Sequence[int]) -> Drafts:
        """At most ``limits[i]`` draft tokens to follow ``token_ids[i]`` (a sequence's tokens so
        far, prompt first, ending with the token this step computes)."""
        raise NotImplementedError

    def accepted(self, seq_ids: Sequence[int], num_accepted: Sequence[int]) -> None:
        """How many drafts of each sequence verification kept (a proposer with state, such as a
        draft model's KV, rewinds the rest). Stateless proposers ignore it."""


#: Method name -> ``"module:Class"`` of its :class:`Proposer` (imported when first built).
PROPOSERS: Dict[str, str] = {
    "ngram": "pagedkv.engine.spec_decode.ngram:NgramProposer",
}


def build_proposer(config: SpeculativeConfig, vocab_size: int) -> Proposer:
    """The registered proposer of ``config.method``."""
    module, _, name = PROPOSERS[config.method].partition(":")
    cls = getattr(importlib.import_module(module), name)
    proposer: Proposer = cls(config, vocab_size)
    return proposer


def clamp_limits(limits: Sequence[int], k: int) -> List[int]:
    """Each limit capped at ``k`` and floored at 0."""
    return [max(0, min(k, int(x))) for x in limits]


