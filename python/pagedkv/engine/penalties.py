"""Batched logits processing: penalties, ``min_tokens`` suppression and ``min_p``, as tensor ops.

Owns the functions the sampler applies to a whole step's logits before the pick. Each works on a
``[rows, vocab]`` float tensor on the logits' device, one tensor op per stage for all rows (never a
Python loop over the vocabulary). Invariants:

* each row's result depends only on that row's logits, parameters and token history, never on the
  other rows, so a request is sampled the same way whatever batch it runs in;
* the token history is whole (prompt and every generated token, rebuilt from the sequence's token
  ids), so a preempted and recomputed sequence sees the same penalties as one that was not;
* a neutral setting (penalties ``0, 0, 1``, ``min_p = 0``) leaves a row bit-for-bit unchanged.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

__all__ = ["token_counts", "apply_penalties", "apply_min_p", "suppress_tokens"]


def token_counts(token_lists: Sequence[Sequence[int]], vocab: int,
                 device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each list: ``[len(token_lists), vocab]`` float32.

    The lists are padded into one index tensor (padding points at an extra column that is then
    dropped) and counted with one ``scatter_add_`` on ``device``.
    """
    rows = len(token_lists)
    width = max((len(t) for t in token_lists), default=0)
    idx = np.full((rows, max(width, 1)), vocab, dtype=np.int64)
    for r, toks in enumerate(token_lists):
        if len(toks):
            idx[r, :len(toks)] = toks
    index = torch.from_numpy(idx).to(device, non_blocking=True)
    counts = torch.zeros((rows, vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, prompt_counts: torch.Tensor, output_counts: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """The three penalties over a batch of rows (a new tensor).

    Args:
        logits: ``[rows, vocab]`` float logits.
        prompt_counts: ``[rows, vocab]`` occurrences of each token in the row's prompt.
        output_counts: ``[rows, vocab]`` occurrences in the row's generated tokens.
        presence: ``[rows]``: subtracted from every token generated at least once.
        frequency: ``[rows]``: subtracted once per generated occurrence.
        repetition: ``[rows]``: for every token of the prompt or the output, a positive logit is
            divided by it and a negative one multiplied (the logit moves towards less likely
            whatever its sign when the penalty is above 1).

    Returns:
        ``[rows, vocab]`` penalised logits.
    """
    generated = output_counts > 0
    seen = generated | (prompt_counts > 0)
    rep = repetition.to(logits.dtype)[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    out = torch.where(seen, penalised, logits)
    out = out - frequency.to(logits.dtype)[:, None] * output_counts
    return out - presence.to(logits.dtype)[:, None] * generated.to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks (``-inf``) each row's tokens whose probability is below ``min_p`` times the row's
    largest; the most likely token always survives. ``min_p``: ``[rows]`` in ``[0, 1]``."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(probs.dtype)[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def suppress_tokens(logits: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int]) -> None:
    """Sets ``logits[rows[i], token_ids[i]] = -inf`` in place, in one indexed write."""
    if not rows:
        return
    r = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    t = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    logits.index_put_((r, t), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
