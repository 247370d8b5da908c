"""Verification of drafts against the target model's logits: greedy acceptance and rejection
sampling.

Owns :class:`VerifyRow` and :func:`verify_batch`. A sequence with ``k`` drafts ``d_1..d_k`` brings
``k + 1`` logits rows from one target forward — the distributions of its next token given the
drafts before it — and gets back ``m + 1`` tokens: ``m`` accepted drafts and one token from the
target (the correction at the first rejection, or the bonus after ``k`` acceptances).

Invariants:

* each position's logits go through the sampler's own processing (:func:`~..sampler.
  process_logits`: ``min_tokens``, penalties with the drafts before it as history; then
  temperature, min-p, top-k, top-p), so position ``j`` is judged by exactly the distribution the
  sampler would draw from had ``d_1..d_j`` been sampled one by one;
* greedy rows accept the longest prefix of drafts equal to the argmax at each position, then take
  the argmax: the tokens are those of decoding without speculation;
* random rows accept ``d_j`` with probability ``min(1, p(d_j) / q(d_j))`` (``q`` the draft's
  distribution; a point mass for deterministic drafts, so ``p(d_j)``), and at the first rejection
  draw from ``max(p - q, 0)`` normalised: each emitted token is distributed exactly as the
  target's (Leviathan et al., Chen et al.);
* the randomness for position ``j`` comes from a generator seeded by the sample's seed and the
  token's index in the output alone (:func:`~..sampler.token_seed`), never the batch: a seeded
  request is reproducible whatever it runs with, and a row with no drafts draws exactly the token
  the plain sampler would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

from ..sampler import (RowLogprobs, SamplerRow, compute_logprobs, filter_logits, process_logits,
                       token_seed)

__all__ = ["VerifyRow", "VerifyResult", "verify_batch"]


@dataclass
class VerifyRow:
    """One sequence to verify: its sampler row (at the first drafted position), its drafts, and
    the drafts' distributions (``[k, vocab]``, or ``None`` for deterministic drafts)."""

    row: SamplerRow
    drafts: Sequence[int]
    draft_probs: Any = None


@dataclass
class VerifyResult:
    """Per row: the tokens emitted (accepted drafts, then the target's token), how many drafts
    were accepted, and each emitted token's logprobs (``None`` where not asked for)."""

    tokens: List[List[int]]
    num_accepted: List[int]
    logprobs: List[List[Optional[RowLogprobs]]]


def _position_rows(v: VerifyRow) -> List[SamplerRow]:
    r = v.row
    hist = list(r.token_ids) if r.params.has_penalties else None
    out = []
    for j in range(len(v.drafts) + 1):
        ids: Sequence[int] = () if hist is None else hist + list(v.drafts[:j])
        out.append(SamplerRow(r.params, r.seed, r.num_generated + j, ids, r.num_prompt_tokens,
                              r.min_tokens_banned))
    return out


def verify_batch(logits: torch.Tensor, rows: Sequence[VerifyRow]) -> VerifyResult:
    """Verifies every row's drafts (module docs).

    Args:
        logits: ``[sum(len(drafts) + 1), vocab]`` raw float logits, each row's ``k + 1``
            positions consecutive, rows in order.
        rows: What each row drafted.
    """
    pos_rows: List[SamplerRow] = []
    starts: List[int] = []
    for v in rows:
        starts.append(len(pos_rows))
        pos_rows.extend(_position_rows(v))
    if not pos_rows:
        return VerifyResult([], [], [])
    x = process_logits(logits, pos_rows)
    dev = logits.device
    greedy_pick: List[int] = x.argmax(dim=-1).tolist()
    rand_idx = [i for i, r in enumerate(pos_rows) if not r.params.greedy]
    probs: Optional[torch.Tensor] = None
    where = {}
    if rand_idx:
        idx = torch.tensor(rand_idx, dtype=torch.int64, device=dev)
        probs = torch.softmax(filter_logits(x[idx], [pos_rows[i].params for i in rand_idx]),
                              dim=-1)
        where = {i: j for j, i in enumerate(rand_idx)}

    tokens: List[List[int]] = []
    accepted: List[int] = []
    for v, s in zip(rows, starts):
        k = len(v.drafts)
        if v.row.params.greedy:
            m = 0
            while m < k and int(v.drafts[m]) == greedy_pick[s + m]:
                m += 1
            tokens.append([int(t) for t in v.drafts[:m]] + [greedy_pick[s + m]])
            accepted.append(m)
            continue
        assert probs is not None
        out: List[int] = []
        for j in range(k + 1):
            p = probs[where[s + j]]
            gen = torch.Generator(device=dev)
            gen.manual_seed(token_seed(v.row.seed, v.row.num_generated + j))
            if j == k:  # every draft accepted: the bonus token, as the plain sampler draws it
                out.append(int(torch.multinomial(p, 1, generator=gen)))
                break
            d = int(v.drafts[j])
            q = None if v.draft_probs is None else v.draft_probs[j].to(dev, torch.float32)
            pd = p[d]
            ratio = pd if q is None else torch.clamp(pd / q[d].clamp_min(1e-30), max=1.0)
            u = torch.rand((), generator=gen, device=dev)
            if bool(u < ratio):
                out.append(d)
                continue
            if q is None:
                resid = p.clone()
                resid[d] = 0.0
            else:
                resid = torch.clamp(p - q, min=0.0)
            if float(resid.sum()) <= 0.0:
                resid = p
            out.append(int(torch.multinomial(resid, 1, generator=gen)))
            break
        tokens.append(out)
        accepted.append(len(out) - 1)

    lps: List[List[Optional[RowLogprobs]]] = [[None] * len(t) for t in tokens]
    want = [i for i, v in enumerate(rows) if v.row.params.logprobs is not None]
    if want:
        at = [starts[i] + j for i in want for j in range(len(tokens[i]))]
        chosen = torch.tensor([t for i in want for t in tokens[i]], dtype=torch.int64, device=dev)
        kmax = max(int(rows[i].row.params.logprobs or 0) for i in want)
        entries = compute_logprobs(logits[torch.tensor(at, dtype=torch.int64, device=dev)],
                                   chosen, kmax)
        e = 0
        for i in want:
            kk = int(rows[i].row.params.logprobs or 0)
            for j in range(len(tokens[i])):
                top_ids, top_lps, lp, rank = entries[e]
                lps[i][j] = (top_ids[:kk], top_lps[:kk], lp, rank)
                e += 1
    return VerifyResult(tokens, accepted, lps)


