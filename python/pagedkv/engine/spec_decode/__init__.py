"""Speculative decoding: proposers draft tokens, the target verifies them in one forward.

One interface (:class:`~.base.Proposer`), a registry (:data:`~.base.PROPOSERS`, method name ->
class, one module per proposer: :mod:`.ngram`, :mod:`.draft`), the settings (:mod:`.config`) and
verification (:mod:`.verify`: greedy acceptance, rejection sampling). The engine core asks the
proposer for drafts while the scheduler builds a step, holds them as the block manager's
provisional tokens, verifies them against the step's logits and commits the accepted ones
(docs/spec-decode.md).
Importing this package imports neither torch nor the extension; :mod:`.verify` and
:mod:`.draft` need torch.
"""

from __future__ import annotations

from .base import PROPOSERS, Drafts, Proposer, build_proposer
from .config import SpeculativeConfig, parse_speculative_config

__all__ = ["PROPOSERS", "Drafts", "Proposer", "build_proposer", "SpeculativeConfig",
           "parse_speculative_config"]
