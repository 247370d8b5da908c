"""N-gram (prompt lookup) proposer: drafts by copying what followed an earlier occurrence of the
sequence's last ``n`` tokens.

Owns :class:`NgramProposer`. For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``,
the sequence's last ``n`` tokens are searched for earlier in the sequence (prompt and output),
longest ``n`` first; the draft is the tokens after its latest occurrence that is followed by
``k`` tokens (else after its earliest, which is followed by the most), at most ``k`` and at most
the sequence's limit. Invariants: deterministic (a function of the token ids alone, so a
seeded request stays reproducible whatever it is batched with), no state, no model; a sequence
without a match gets no draft.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

from .base import Drafts, Proposer, clamp_limits

__all__ = ["NgramProposer", "ngram_draft"]

#: Tokens searched back from the end of a sequence, at most (bounds the work per sequence).
SEARCH_WINDOW = 4096


def ngram_draft(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> List[int]:
    """Up to ``k`` tokens following an earlier occurrence of the longest suffix of ``tokens`` of
    length in ``[n_min, n_max]`` that occurs earlier (module docs); ``[]`` if none does."""
    if k <= 0:
        return []
    arr = np.asarray(tokens[-SEARCH_WINDOW:], dtype=np.int64)
    size = arr.shape[0]
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = arr[size - n:]
        # Windows starting at 0 .. size - n - 1 (the suffix itself excluded).
        win = np.lib.stride_tricks.sliding_window_view(arr[:size - 1], n)
        hits = np.flatnonzero((win == suffix).all(axis=1))
        if hits.size:
            # The latest occurrence followed by k tokens, else the earliest (the most tokens).
            full = hits[hits + n + k <= size]
            start = int(full[-1] if full.size else hits[0]) + n
            draft: List[int] = arr[start:start + k].tolist()
            return draft
    return []


class NgramProposer(Proposer):
    """Prompt-lookup drafts (see the module docs)."""

    method = "ngram"

    def propose(self, token_ids: Sequence[Sequence[int]], limits: Sequence[int]) -> Drafts:
        c = self.config
        ks = clamp_limits(limits, c.num_speculative_tokens)
        return Drafts([ngram_draft(t, k, c.prompt_lookup_min, c.prompt_lookup_max)
                       for t, k in zip(token_ids, ks)])
