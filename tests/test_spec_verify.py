"""Speculative decoding's parts without a model: the settings, the n-gram proposer, and
verification (greedy acceptance; rejection sampling, whose output distribution must be the
target's exactly: a chi-square test over many seeds on a small vocabulary).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv.engine import SamplingParams  # noqa: E402
from pagedkv.engine.config import EngineConfig  # noqa: E402
from pagedkv.engine.sampler import SamplerRow, filtered_probs, sample_batch  # noqa: E402
from pagedkv.engine.spec_decode import (  # noqa: E402
    PROPOSERS, SpeculativeConfig, build_proposer, parse_speculative_config)
from pagedkv.engine.spec_decode.ngram import ngram_draft  # noqa: E402
from pagedkv.engine.spec_decode.verify import VerifyRow, verify_batch  # noqa: E402
from pagedkv.errors import ConfigArgumentError, InvalidConfigError  # noqa: E402

# ------------------------------------------------------------------------------------- settings


def test_config_from_dict_json_and_defaults() -> None:
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    assert c == SpeculativeConfig("ngram", 4, 2, 5)
    assert parse_speculative_config('{"num_speculative_tokens": 2}') == SpeculativeConfig(
        num_speculative_tokens=2)
    # prompt_lookup_min alone raises the max to it.
    assert parse_speculative_config({"num_speculative_tokens": 2, "prompt_lookup_min": 6}
                                    ).prompt_lookup_max == 6
    assert parse_speculative_config(None) is None
    e = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert e.speculative == SpeculativeConfig(num_speculative_tokens=3)
    assert EngineConfig().speculative is None


@pytest.mark.parametrize("value, field", [
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": -2}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
    ({}, "speculative_config.num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "lookahead": 1}, "speculative_config.lookahead"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "speculative_config.disable_by_batch_size"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "ngram", "model": "/some/draft", "num_speculative_tokens": 2},
     "speculative_config.model"),
    ("{not json", "speculative_config"),
    ("[1, 2]", "speculative_config"),
    (7, "speculative_config"),
])
def test_bad_config_is_a_typed_error(value, field) -> None:
    with pytest.raises(ConfigArgumentError) as e:
        EngineConfig(speculative_config=value)
    assert e.value.field == field
    assert isinstance(e.value, InvalidConfigError)


def test_speculation_with_tensor_parallelism_is_refused() -> None:
    with pytest.raises(ConfigArgumentError, match="tensor_parallel_size"):
        EngineConfig(speculative_config={"num_speculative_tokens": 2}, tensor_parallel_size=2)


def test_registry_builds_the_ngram_proposer() -> None:
    assert "ngram" in PROPOSERS
    p = build_proposer(SpeculativeConfig(num_speculative_tokens=3), vocab_size=100)
    assert p.method == "ngram"
    d = p.propose([[1, 2, 3, 9, 1, 2], [5, 6, 7], [4, 4, 4, 4]], [3, 3, 1])
    assert d.tokens == [[3, 9, 1], [], [4]]
    assert d.probs_of(0) is None


# --------------------------------------------------------------------------------------- n-gram


def test_ngram_draft_rules() -> None:
    # Longest suffix first: "1 2 3" occurs earlier, followed by 7 8.
    assert ngram_draft([1, 2, 3, 7, 8, 5, 2, 3, 1, 2, 3], 2, 1, 3) == [7, 8]
    # Only n-grams in [n_min, n_max]: a 1-gram match is not enough with n_min = 2.
    assert ngram_draft([4, 9, 5, 4], 3, 2, 3) == []
    assert ngram_draft([4, 9, 5, 4], 3, 1, 3) == [9, 5, 4]
    # The latest occurrence followed by k tokens wins over an older one.
    assert ngram_draft([1, 5, 1, 6, 6, 1], 2, 1, 1) == [6, 6]
    # Without one followed by k tokens, the earliest (most tokens); the draft may run into the
    # suffix itself.
    assert ngram_draft([7, 7, 7], 3, 1, 2) == [7]
    assert ngram_draft([1], 3, 1, 3) == []
    assert ngram_draft([1, 2, 1], 0, 1, 3) == []


# ---------------------------------------------------------------------------------- verification


def _row(params: SamplingParams, seed: int = 0, generated: int = 0,
         tokens: tuple = (1, 2, 3)) -> SamplerRow:
    return SamplerRow(params, seed, generated, list(tokens), 2)


def test_greedy_accepts_the_agreeing_prefix_and_adds_the_target_token() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 10, generator=g)
    arg = logits.argmax(-1).tolist()
    greedy = SamplingParams(temperature=0.0)
    rows = [
        VerifyRow(_row(greedy), [arg[0], arg[1], (arg[2] + 1) % 10]),  # 2 accepted, then a fix
        VerifyRow(_row(greedy), [(arg[0] + 1) % 10]),  # rejected at once
        VerifyRow(_row(greedy), [arg[0], arg[1], arg[2]]),  # all accepted + bonus
    ]
    packed = torch.cat([logits[:4], logits[:2], logits[:4]])
    res = verify_batch(packed, rows)
    assert res.num_accepted == [2, 0, 3]
    assert res.tokens == [arg[:3], arg[:1], arg[:4]]
    assert res.logprobs == [[None] * 3, [None], [None] * 4]


def test_greedy_penalties_see_the_drafts_as_history() -> None:
    # A repetition penalty at position j must count drafts d_1..d_j, as decoding one by one would.
    logits = torch.zeros(2, 5)
    logits[:, 3] = 2.0
    logits[:, 4] = 1.9
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    res = verify_batch(logits, [VerifyRow(_row(params, tokens=(0, 1)), [3])])
    # Position 0 picks 3 (accepted); at position 1 token 3 is penalised (2.0 / 2 < 1.9): 4.
    assert res.tokens == [[3, 4]]


def test_no_drafts_draws_what_the_plain_sampler_draws() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 20, generator=g)
    params = SamplingParams(temperature=0.8, top_k=10, seed=3)
    rows = [_row(params, seed=100 + i, generated=i) for i in range(6)]
    plain = sample_batch(logits, rows).token_ids
    res = verify_batch(logits, [VerifyRow(r, []) for r in rows])
    assert [t[0] for t in res.tokens] == plain


def _chi2_ok(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """The chi-square statistic over the cells with mass and its p-value (the seeds are fixed,
    so the test is deterministic; a p-value below 1e-4 means the distributions differ)."""
    keep = probs > 0
    n = counts.sum()
    exp = probs[keep] * n
    stat = float((((counts[keep] - exp) ** 2) / exp).sum())
    df = int(keep.sum()) - 1
    assert counts[~keep].sum() == 0  # nothing drawn outside the support
    pvalue = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                           torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, pvalue


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
])
def test_rejection_sampling_keeps_the_target_distribution(params) -> None:
    V, trials = 6, 6000
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, V, generator=g) * 1.5
    p0 = filtered_probs(logits[0], params).numpy().astype(np.float64)
    p1 = filtered_probs(logits[1], params).numpy().astype(np.float64)
    p0, p1 = p0 / p0.sum(), p1 / p1.sum()
    d0 = int(np.argsort(p0)[-2])  # a likely-ish draft: both branches (accept, reject) happen
    d1 = int(np.argmax(p1))
    rows = [VerifyRow(_row(params, seed=s), [d0, d1]) for s in range(trials)]
    res = verify_batch(logits.repeat(trials, 1), rows)
    first = np.bincount([t[0] for t in res.tokens], minlength=V)
    stat, pvalue = _chi2_ok(first, p0)
    assert pvalue > 1e-4, (stat, pvalue, first, p0 * trials)
    # The second token, among the trials that accepted d0, is distributed as p1.
    second = np.bincount([t[1] for t in res.tokens if t[0] == d0], minlength=V)
    stat, pvalue = _chi2_ok(second, p1)
    assert pvalue > 1e-4, (stat, pvalue, second)
    # Both branches ran: some accepted, some rejected.
    acc = np.array(res.num_accepted)
    assert (acc == 0).any() and (acc >= 1).any()


def test_rejection_sampling_with_draft_distributions_is_exact() -> None:
    # A draft model's proposals: d ~ q, accepted with min(1, p/q), residual max(p - q, 0).
    V, trials = 5, 6000
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, V, generator=g)
    q = torch.softmax(torch.randn(V, generator=g), -1)
    params = SamplingParams(temperature=1.0)
    p = torch.softmax(logits[0], -1).numpy().astype(np.float64)
    rng = np.random.default_rng(0)
    qn = q.numpy().astype(np.float64)
    drafts = rng.choice(V, size=trials, p=qn / qn.sum())
    rows = [VerifyRow(_row(params, seed=s), [int(d)], q[None]) for s, d in enumerate(drafts)]
    res = verify_batch(logits.repeat(trials, 1), rows)
    first = np.bincount([t[0] for t in res.tokens], minlength=V)
    stat, pvalue = _chi2_ok(first, p / p.sum())
    assert pvalue > 1e-4, (stat, pvalue, first)


def test_seeded_verification_does_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 12, generator=g)
    params = SamplingParams(temperature=1.0, seed=9)
    alone = verify_batch(logits, [VerifyRow(_row(params, seed=42, generated=4), [1, 2])])
    other = torch.randn(2, 12, generator=g)
    mixed = verify_batch(torch.cat([other, logits]), [
        VerifyRow(_row(SamplingParams(temperature=0.5), seed=1), [0]),
        VerifyRow(_row(params, seed=42, generated=4), [1, 2])])
    assert mixed.tokens[1] == alone.tokens[0]


def test_logprobs_per_emitted_token() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 8, generator=g)
    arg = logits.argmax(-1).tolist()
    params = SamplingParams(temperature=0.0, logprobs=2)
    res = verify_batch(logits, [VerifyRow(_row(params), [arg[0], (arg[1] + 1) % 8])])
    assert res.tokens == [[arg[0], arg[1]]]
    lp = torch.log_softmax(logits, -1)
    for j, entry in enumerate(res.logprobs[0]):
        assert entry is not None
        top_ids, top_lps, chosen, rank = entry
        assert len(top_ids) == 2 and top_ids[0] == arg[j] and rank == 1
        assert chosen == pytest.approx(float(lp[j, arg[j]]), abs=1e-5)
