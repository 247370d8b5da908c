"""Turning the model's logits into next tokens: greedy, or temperature / min-p / top-k / top-p
sampling, after ``min_tokens`` suppression and penalties; and the logprobs of what was picked.

Owns :func:`sample_batch` (and its plain form :func:`sample`), :func:`compute_logprobs` and the
seeding scheme. The logits of a whole step are processed together as ``[rows, vocab]`` tensor ops
on their device (:mod:`.penalties`); only the seeded draw itself is per row. Invariants:

* ``temperature == 0`` picks ``argmax`` (first index on ties, like ``torch.argmax`` and transformers'
  greedy search), consuming no randomness;
* a random draw for a sequence depends only on its sampling seed and on how many tokens the sequence
  has generated so far (:func:`token_seed`), never on the batch it ran in or on how many steps it
  took. So a seeded request is reproducible, the ``n`` samples of a request differ (each has its own
  seed, :func:`sample_seed`), and a request that was preempted and recomputed resumes with exactly the
  tokens it would have produced without the preemption: a fresh ``torch.Generator`` is seeded for
  every draw instead of carrying one generator's state across steps;
* the filters keep at least one token (the most likely), so a draw always has mass to sample from;
* every processing stage is row-wise (:mod:`.penalties`), so a row's token does not depend on the
  other rows of its batch, and depends on the sequence's history only through its token ids;
* logprobs are the raw distribution, ``log_softmax`` of the model's logits before any processing,
  so they describe the model, not the sampling settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, List, Optional, Sequence, Tuple

import torch

from . import penalties as _pen
from .sampling_params import SamplingParams

__all__ = ["sample", "sample_batch", "pick_tokens", "SamplerRow", "SamplerOutput", "RowLogprobs",
           "compute_logprobs", "process_logits", "sample_seed", "token_seed", "filtered_probs"]

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


@dataclass
class SamplerRow:
    """What the sampler needs of one row besides its logits."""

    params: SamplingParams
    #: The sample's sequence seed (:func:`sample_seed`); unused for greedy rows.
    seed: int
    #: Tokens the sequence has generated so far (selects the draw; gates ``min_tokens``).
    num_generated: int
    #: The sequence's token ids so far, prompt first (penalties read them; may be empty when the
    #: row has no penalty).
    token_ids: Sequence[int] = ()
    #: How many of ``token_ids`` are the prompt.
    num_prompt_tokens: int = 0
    #: Token ids that cannot be picked while ``num_generated < params.min_tokens`` (the model's
    #: end-of-sequence ids and ``stop_token_ids``).
    min_tokens_banned: AbstractSet[int] = frozenset()


#: One row's logprobs: ``(top ids, their logprobs, the chosen token's logprob, its 1-based rank)``.
RowLogprobs = Tuple[List[int], List[float], float, int]


@dataclass
class SamplerOutput:
    """The tokens picked, one per row, and, for rows that asked, their logprobs."""

    token_ids: List[int]
    logprobs: List[Optional[RowLogprobs]] = field(default_factory=list)


def process_logits(logits: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
    """``min_tokens`` suppression, then repetition / frequency / presence penalties, over the whole
    batch. Returns ``logits`` itself when no row needs either, else a new tensor."""
    ban_rows: List[int] = []
    ban_ids: List[int] = []
    pen_rows: List[int] = []
    for r, row in enumerate(rows):
        p = row.params
        if row.num_generated < p.min_tokens and row.min_tokens_banned:
            ban_ids.extend(row.min_tokens_banned)
            ban_rows.extend([r] * len(row.min_tokens_banned))
        if p.has_penalties:
            pen_rows.append(r)
    if not ban_rows and not pen_rows:
        return logits
    x = logits.clone()
    _pen.suppress_tokens(x, ban_rows, ban_ids)
    if pen_rows:
        dev = x.device
        vocab = x.shape[-1]
        chosen = [rows[r] for r in pen_rows]
        prompt = _pen.token_counts([c.token_ids[:c.num_prompt_tokens] for c in chosen], vocab, dev)
        output = _pen.token_counts([c.token_ids[c.num_prompt_tokens:] for c in chosen], vocab, dev)

        def col(name: str) -> torch.Tensor:
            return torch.tensor([getattr(c.params, name) for c in chosen], dtype=torch.float32,
                                device=dev)

        idx = torch.tensor(pen_rows, dtype=torch.int64, device=dev)
        x[idx] = _pen.apply_penalties(x[idx], prompt, output, col("presence_penalty"),
                                      col("frequency_penalty"), col("repetition_penalty"))
    return x


def filter_logits(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then ``min_p``, then top-k, then top-p, for a batch of non-greedy rows:
    ``[rows, vocab]`` logits in, ``[rows, vocab]`` logits out (``-inf`` outside each kept set)."""
    dev = x.device
    rows, vocab = x.shape
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    x = x.float() / temps[:, None]
    if any(p.min_p > 0.0 for p in params):
        x = _pen.apply_min_p(x, torch.tensor([p.min_p for p in params], dtype=torch.float32,
                                             device=dev))
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in ks):
        # The k-th largest value of each row (k = vocab: the smallest, which drops nothing).
        kth = torch.sort(x, dim=-1, descending=True).values.gather(
            1, torch.tensor(ks, dtype=torch.int64, device=dev)[:, None] - 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)[:, None]
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        prob = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first is always kept,
        # and a row with top_p = 1 keeps everything (its cumsum may round past 1).
        drop = ((torch.cumsum(prob, dim=-1) - prob) >= top_p) & (top_p < 1.0)
        drop[:, 0] = False
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution one row of (processed) logits is sampled from.

    Args:
        logits: ``[vocab]`` float logits.
        params: Non-greedy sampling parameters.

    Returns:
        ``[vocab]`` float32 probabilities (zero outside the kept set).
    """
    return torch.softmax(filter_logits(logits[None], [params]), dim=-1)[0]


def compute_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> List[RowLogprobs]:
    """Raw logprobs of a batch of rows: the top ``k`` of each row and the ``chosen`` token's.

    Args:
        logits: ``[rows, vocab]`` raw logits.
        chosen: ``[rows]`` int64 token ids, on the logits' device.
        k: Top entries per row (``0``: the chosen token's only).

    Returns:
        Per row ``(top ids, top logprobs, chosen logprob, chosen rank)``; the rank is 1 plus the
        number of tokens strictly more likely.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    got = lp.gather(1, chosen[:, None])
    rank = (lp > got).sum(dim=-1) + 1
    if k > 0:
        top = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    else:
        top_ids = top_lps = [[] for _ in range(lp.shape[0])]
    return [(i, v, g, r) for i, v, g, r in zip(top_ids, top_lps, got[:, 0].tolist(),
                                                rank.tolist())]


def sample_batch(logits: torch.Tensor, rows: Sequence[SamplerRow]) -> SamplerOutput:
    """Picks one token per row of ``logits``, and the logprobs of rows that ask for them.

    Args:
        logits: ``[rows, vocab]`` float raw logits, one row per sequence to sample.
        rows: Each row's parameters, seed and history.

    Returns:
        The token ids, one per row, and per row its :data:`RowLogprobs` (``None`` for rows
        without ``logprobs``).
    """
    n = logits.shape[0]
    if n == 0:
        return SamplerOutput([], [])
    picked = pick_tokens(logits, rows)
    tokens = picked.tolist()
    lps: List[Optional[RowLogprobs]] = [None] * n
    want = [i for i in range(n) if rows[i].params.logprobs is not None]
    if want:
        w = torch.tensor(want, dtype=torch.int64, device=logits.device)
        k = max(int(rows[i].params.logprobs or 0) for i in want)
        for i, entry in zip(want, compute_logprobs(logits[w], picked[w], k)):
            kk = int(rows[i].params.logprobs or 0)
            lps[i] = (entry[0][:kk], entry[1][:kk], entry[2], entry[3])
    return SamplerOutput(tokens, lps)


def pick_tokens(logits: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
    """The tokens :func:`sample_batch` picks, as an int64 tensor on the logits' device, without
    waiting for them: the draws are queued on the device (asynchronous scheduling feeds them to
    the next step's forward before the host has read them). No logprobs."""
    n = logits.shape[0]
    x = process_logits(logits, rows)
    greedy = [i for i in range(n) if rows[i].params.greedy]
    picked = torch.empty(n, dtype=torch.int64, device=logits.device)
    if greedy:
        if len(greedy) == n:
            picked = x.argmax(dim=-1)
        else:
            g = torch.tensor(greedy, dtype=torch.int64, device=logits.device)
            picked[g] = x[g].argmax(dim=-1)
    rand = [i for i in range(n) if not rows[i].params.greedy]
    if rand:
        r_idx = torch.tensor(rand, dtype=torch.int64, device=logits.device)
        probs = torch.softmax(filter_logits(x[r_idx], [rows[i].params for i in rand]), dim=-1)
        draws = []
        for j, i in enumerate(rand):
            gen = torch.Generator(device=probs.device)
            gen.manual_seed(token_seed(rows[i].seed, rows[i].num_generated))
            draws.append(torch.multinomial(probs[j], 1, generator=gen))
        picked[r_idx] = torch.cat(draws)
    return picked


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    num_generated: Sequence[int],
) -> List[int]:
    """Picks one token per row of ``logits`` from the parameters alone (no token history, so no
    penalties or ``min_tokens``; :func:`sample_batch` has them).

    Args:
        logits: ``[rows, vocab]`` float logits, one row per sequence to sample.
        params: Each row's sampling parameters.
        seeds: Each row's sequence seed (:func:`sample_seed`); unused for greedy rows.
        num_generated: Tokens each row's sequence has generated so far (selects the draw).

    Returns:
        The token ids, one per row.
    """
    rows = [SamplerRow(p, s, g) for p, s, g in zip(params, seeds, num_generated)]
    return sample_batch(logits, rows).token_ids
