"""Turning the model's logits into next tokens: greedy, or temperature / top-k / top-p sampling.

Owns :func:`sample` and the seeding scheme. Invariants:

* ``temperature == 0`` picks ``argmax`` (first index on ties, like ``torch.argmax`` and transformers'
  greedy search), consuming no randomness;
* a random draw for a sequence depends only on its sampling seed and on how many tokens the sequence
  has generated so far (:func:`token_seed`), never on the batch it ran in or on how many steps it
  took. So a seeded request is reproducible, the ``n`` samples of a request differ (each has its own
  seed, :func:`sample_seed`), and a request that was preempted and recomputed resumes with exactly the
  tokens it would have produced without the preemption: a fresh ``torch.Generator`` is seeded for
  every draw instead of carrying one generator's state across steps;
* the filters keep at least one token (the most likely), so a draw always has mass to sample from.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .sampling_params import SamplingParams

__all__ = ["sample", "sample_seed", "token_seed", "filtered_probs"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # SplitMix64's finaliser: a cheap bijective mix, so nearby inputs give unrelated seeds.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(request_seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``request_seed``."""
    return _splitmix64((request_seed * 0x100000001B3 + index) & _MASK64)


def token_seed(seed: int, num_generated: int) -> int:
    """The generator seed for a sequence's draw of its token number ``num_generated`` (0-based);
    below ``2**63`` so every torch generator accepts it."""
    return _splitmix64(seed ^ _splitmix64(num_generated)) >> 1


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution one row of logits is sampled from: temperature, then top-k, then top-p.

    Args:
        logits: ``[vocab]`` float logits.
        params: Non-greedy sampling parameters.

    Returns:
        ``[vocab]`` float32 probabilities (zero outside the kept set).
    """
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        p = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first is always kept.
        drop = (torch.cumsum(p, dim=-1) - p) >= params.top_p
        drop[0] = False
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    return torch.softmax(x, dim=-1)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    num_generated: Sequence[int],
) -> List[int]:
    """Picks one token per row of ``logits``.

    Args:
        logits: ``[rows, vocab]`` float logits, one row per sequence to sample.
        params: Each row's sampling parameters.
        seeds: Each row's sequence seed (:func:`sample_seed`); unused for greedy rows.
        num_generated: Tokens each row's sequence has generated so far (selects the draw).

    Returns:
        The token ids, one per row.
    """
    rows = logits.shape[0]
    if rows == 0:
        return []
    out: List[Optional[int]] = [None] * rows
    greedy = [i for i in range(rows) if params[i].greedy]
    if greedy:
        if len(greedy) == rows:
            return logits.argmax(dim=-1).tolist()
        ids = logits[greedy].argmax(dim=-1).tolist()
        for i, t in zip(greedy, ids):
            out[i] = t
    for i in range(rows):
        if out[i] is not None:
            continue
        probs = filtered_probs(logits[i], params[i])
        gen = torch.Generator(device=probs.device)
        gen.manual_seed(token_seed(seeds[i], num_generated[i]))
        out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return out  # type: ignore[return-value]
