"""When speculation pays (``pagedkv.engine.spec_decode.policy.DraftPolicy``): the per-step draft cap
from the cost model and the measured acceptance, alone and through the engine.

Alone: below the cost model's knee every draft rides free (cap ``k``); past it the cap follows the
acceptance (none for drafts that are always rejected, all for drafts always accepted, a shorter one
where only the first positions pay); the warm-up, the probe after a run of undrafted steps, the
counting of evaluated positions and typed errors. Through the engine (rates pinned in the config,
so the test does not depend on this machine's speed): a compute-bound engine whose drafts are
rejected stops drafting (``spec_num_steps_skipped``, ``/metrics``) with outputs identical to no
speculation; a launch-bound one never skips.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.engine.spec_decode import policy as pol
from pagedkv.engine.spec_decode.policy import DraftPolicy
from pagedkv.errors import InvalidArgumentError


def _trained(k: int, rate: float, floor: float, accept_upto: int, steps: int = 64,
             batch: int = 8) -> DraftPolicy:
    """A policy past its warm-up that saw ``steps`` steps of ``batch`` sequences drafting ``k``
    tokens each, of which the first ``accept_upto`` were always accepted."""
    p = DraftPolicy(k, rate, floor)
    for _ in range(steps):
        p.observe([k] * batch, [min(accept_upto, k)] * batch)
    assert p.observed >= pol.WARMUP
    return p


def test_below_the_knee_drafts_ride_free() -> None:
    # 1000 tokens a step are free (floor 1 s at 1000 tok/s): even never-accepted drafts cost
    # nothing, so the cap stays k.
    p = _trained(4, rate=1000.0, floor=1.0, accept_upto=0)
    assert p.cap(8, [4] * 8) == 4
    assert p.off_in_row == 0


def test_past_the_knee_a_draft_never_pays() -> None:
    # No floor: every token costs 1/rate, so a verified position costs what it brings at best.
    for upto in (0, 4):
        p = _trained(4, rate=100.0, floor=0.0, accept_upto=upto)
        assert p.cap(8, [4] * 8) == 0
        assert p.off_in_row == 1


def test_at_the_knee_the_cap_follows_the_acceptance() -> None:
    # 20 tokens a step are free (floor 0.2 s at 100 tok/s); a batch of 8 decodes leaves room for
    # one draft each, and each draft past it costs 10 ms for the 8 sequences.
    never = _trained(4, rate=100.0, floor=0.2, accept_upto=0)
    assert never.cap(8, [4] * 8) == 1  # the free one only
    first = _trained(4, rate=100.0, floor=0.2, accept_upto=1)
    p = first.acceptance()
    assert p[0] > 0.99 and p[1] < 0.01
    assert first.cap(8, [4] * 8) == 1
    assert first.num_steps_capped == 1
    # Always accepted: a second draft (24 tokens: 0.24 s for 2.99 tokens a sequence) beats one
    # (0.2 s for 2.0), a third (0.32 s for 3.97) does not beat two.
    always = _trained(4, rate=100.0, floor=0.2, accept_upto=4)
    assert always.cap(8, [4] * 8) == 2
    # Never past what the proposer drafted; nothing drafted, no drafts.
    assert always.cap(8, [1, 1]) == 1
    assert always.cap(8, []) == 0


def _trained_with_draft(draft_rates, accept_upto: int) -> DraftPolicy:
    p = DraftPolicy(4, 1000.0, 1.0, draft_rates=draft_rates)
    for _ in range(64):
        p.observe([4] * 8, [min(accept_upto, 4)] * 8)
    return p


def test_a_draft_models_forwards_are_priced() -> None:
    # The target's step is free below 1000 tokens (floor 1 s): drafts ride free on the target.
    # A draft model whose forward costs 0.5 s each (its floor) adds 0.5 s per draft position:
    # with every draft accepted, position j brings 8 tokens for 0.5 s, so all 4 pay
    # (8 + 32 tokens in 1 + 0.5 * 5 s beats 8 in 1.5 s).
    p = _trained_with_draft((1000.0, 0.5), accept_upto=4)
    assert p.draft_cost(8, [4] * 8, 0) == pytest.approx(0.5)
    assert p.draft_cost(8, [4] * 8, 4) == pytest.approx(2.5)
    assert p.draft_cost(8, [1, 4], 2) == pytest.approx(0.5 + 0.5 + 0.5)
    assert p.cap(8, [4] * 8) == 4
    # Nothing accepted: each draft position costs 0.5 s and brings nothing, so none is sent,
    # where a free proposer (n-gram) would still draft in full below the knee.
    never = _trained_with_draft((1000.0, 0.5), accept_upto=0)
    assert never.cap(8, [4] * 8) == 0
    assert _trained(4, rate=1000.0, floor=1.0, accept_upto=0).cap(8, [4] * 8) == 4
    # Only the first draft is accepted: one position pays, the rest do not.
    first = _trained_with_draft((1000.0, 0.5), accept_upto=1)
    assert first.cap(8, [4] * 8) == 1
    # A free draft model (no floor, fast) prices like the n-gram proposer.
    assert _trained_with_draft((1e12, 0.0), accept_upto=0).cap(8, [4] * 8) == 4
    with pytest.raises(InvalidArgumentError):
        DraftPolicy(4, 1000.0, 1.0, draft_rates=(0.0, 0.1))


def test_warmup_drafts_in_full_and_probe_after_a_run_off() -> None:
    p = DraftPolicy(3, 100.0, 0.0)
    p.observe([3] * (pol.WARMUP - 1), [0] * (pol.WARMUP - 1))
    assert p.cap(4, [3] * 4) == 3  # not enough seen yet
    p.observe([3], [0])
    assert p.cap(4, [3] * 4) == 0
    for _ in range(pol.PROBE_AFTER - 1):
        assert p.cap(4, [3] * 4) == 0
    assert p.off_in_row == pol.PROBE_AFTER
    assert p.cap(4, [3] * 4) == 3  # the probe
    assert p.off_in_row == 0
    assert p.cap(4, [3] * 4) == 0


def test_observe_counts_positions_up_to_the_first_rejection() -> None:
    p = DraftPolicy(4, 100.0, 0.0)
    # Draft of 4, 2 accepted: positions 0, 1 accepted, 2 evaluated and rejected, 3 not evaluated.
    p.observe([4], [2])
    assert p.evaluated == [1.0, 1.0, 1.0, 0.0] and p.accepted == [1.0, 1.0, 0.0, 0.0]
    # A draft of 2, both accepted: position 2 was never offered, so it keeps its counts.
    p.observe([2], [2])
    d = pol.DECAY
    assert p.evaluated == pytest.approx([d + 1, d + 1, 1.0, 0.0])
    assert p.accepted == pytest.approx([d + 1, d + 1, 0.0, 0.0])
    p.observe([], [])  # a step without drafts changes nothing
    assert p.observed == 2


def test_positions_the_cap_keeps_out_keep_their_estimate() -> None:
    # Deep drafts were always accepted; then a long run of steps sends only 2 a sequence (a cap,
    # or a proposer that found short drafts). Positions 3 and 4 were not evaluated in that run:
    # their estimate must not sink to the prior's 0.5, or the policy would stop sending them.
    p = _trained(4, rate=100.0, floor=0.2, accept_upto=4)
    before = p.acceptance()
    for _ in range(1000):
        p.observe([2] * 8, [2] * 8)
    after = p.acceptance()
    assert after[2:] == pytest.approx(before[2:])
    assert min(after) > 0.95
    assert p.cap(8, [4] * 8) == _trained(4, rate=100.0, floor=0.2, accept_upto=4).cap(8, [4] * 8)


@pytest.mark.parametrize("args", [(0, 1.0, 0.0), (True, 1.0, 0.0), (2, 0.0, 0.0),
                                  (2, float("nan"), 0.0), (2, 1.0, -1.0)])
def test_bad_arguments_are_typed_errors(args: tuple) -> None:
    with pytest.raises(InvalidArgumentError):
        DraftPolicy(*args)


# ------------------------------------------------------------------------------ through the engine


def _engine_run(model_dir: str, spec: object, **kw: object):
    from pagedkv import LLM, SamplingParams

    llm = LLM(model_dir, device="cpu", progress=False, block_size=4, num_blocks=256,
              max_num_seqs=8, max_num_batched_tokens=64, speculative_config=spec, **kw)
    g = np.random.default_rng(11)
    # A repeated passage: the n-gram proposer finds drafts at most steps.
    prompts = [g.integers(3, 128, 6).tolist() * 4 for _ in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
                        use_tqdm=False)
    llm.llm_engine.manager.check_invariants()
    return llm, [o.outputs[0].token_ids for o in outs]


def test_engine_stops_drafting_when_rejected_drafts_cost_compute(tmp_path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_llama import save_tiny_llama

    model_dir = save_tiny_llama(str(tmp_path / "m"), max_len=256)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    _, plain = _engine_run(model_dir, None)
    # Compute-bound: every token a step carries costs 1 ms, a step nothing else.
    bound, outs = _engine_run(model_dir, spec, prefill_tokens_per_s=1000.0, step_floor_s=0.0)
    assert outs == plain
    st = bound.stats()
    policy = bound.llm_engine.core.spec_policy
    assert policy is not None and policy.rate == 1000.0 and policy.floor == 0.0
    assert st.spec_num_drafts >= pol.WARMUP  # it drafted through its warm-up ...
    # ... then stopped: past the knee no draft pays.
    assert st.spec_num_steps_skipped > 0
    assert st.spec_num_drafts < 4 * 47  # not every decode drafted
    pytest.importorskip("prometheus_client")
    metrics = bound.llm_engine.spec_decode_collector()
    assert metrics is not None
    samples = {m.name: m.samples[0].value for m in metrics.collect() if m.samples}
    assert samples["pagedkv_spec_decode_num_steps_skipped"] == st.spec_num_steps_skipped
    # Launch-bound: a step costs 1 s however few tokens, so drafts ride free and none is dropped.
    free, outs = _engine_run(model_dir, spec, prefill_tokens_per_s=1e9, step_floor_s=1.0)
    assert outs == plain
    assert free.stats().spec_num_steps_skipped == 0
    assert free.stats().spec_num_drafts > st.spec_num_drafts
