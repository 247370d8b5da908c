"""Speculative decoding through the engine (``LLM(..., speculative_config=...)``) on a tiny random
Llama (word-level tokenizer, saved with ``save_pretrained``, loaded by the engine's real loader).

Greedy outputs must be identical to the same engine without speculation — with prefix caching
(equal hits, on the device and in the host and disk tiers), ``n = 2`` forks, stop tokens and strings, logprobs, chunked prefill, preemption and
length limits — while the n-gram proposer's drafts are actually accepted (counted in ``stats()``).
Seeded sampling stays reproducible whatever a request is batched with; between steps no sequence
holds provisional tokens.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pagedkv import LLM, LLMEngine, SamplingParams  # noqa: E402
from pagedkv.errors import ConfigArgumentError  # noqa: E402

from tiny_llama import save_tiny_llama  # noqa: E402

K = 3
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3}
BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_spec")), max_len=256)


def _llm(model_dir, spec=None, **kw) -> LLM:
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("num_blocks", 256)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    return LLM(model_dir, device="cpu", progress=False, speculative_config=spec, **kw)


def _prompts(seed: int, lengths, repeat: int = 3):
    """Prompts that repeat a random passage: the n-gram proposer finds its drafts in them (and the
    tiny model's greedy loops)."""
    g = np.random.default_rng(seed)
    return [g.integers(3, 128, n).tolist() * repeat for n in lengths]


def _ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _both(model_dir, prompts, params, **kw):
    plain = _llm(model_dir, **kw)
    spec = _llm(model_dir, SPEC, **kw)
    a = plain.generate(prompts, params, use_tqdm=False)
    b = spec.generate(prompts, params, use_tqdm=False)
    return plain, spec, a, b


GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def test_greedy_identical_and_drafts_accepted(model_dir):
    prompts = _prompts(0, [5, 9, 12, 3])
    plain, spec, a, b = _both(model_dir, prompts, GREEDY)
    assert _ids(a) == _ids(b)
    assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]
    assert all(len(o.outputs[0].token_ids) == 32 for o in b)
    sp, ss = plain.stats(), spec.stats()
    assert sp.spec_num_drafts == sp.spec_num_draft_tokens == 0
    assert ss.spec_num_drafts > 0 and ss.spec_num_accepted_tokens > 0
    assert ss.spec_num_draft_tokens <= K * ss.spec_num_drafts
    pos = ss.spec_accepted_tokens_by_position
    assert len(pos) == K and sum(pos) == ss.spec_num_accepted_tokens
    assert all(x >= y for x, y in zip(pos, pos[1:]))  # position j+1 only after position j
    assert ss.spec_acceptance_rate == pytest.approx(
        ss.spec_num_accepted_tokens / ss.spec_num_draft_tokens)
    assert ss.spec_mean_acceptance_length == pytest.approx(
        1 + ss.spec_num_accepted_tokens / ss.spec_num_drafts)
    # Accepted drafts are tokens the steps did not have to run for.
    assert ss.num_generated_tokens == sp.num_generated_tokens == 4 * 32
    assert ss.num_steps < sp.num_steps
    assert ss.num_prefill_tokens == sp.num_prefill_tokens
    spec.llm_engine.manager.check_invariants()


def test_prefix_cache_hits_equal(model_dir):
    system = _prompts(1, [6], repeat=4)[0]  # 24 tokens: 6 full blocks
    tails = [t[:5] for t in _prompts(2, [5, 5, 5])]
    prompts = [system + t for t in tails]
    runs = []
    for spec in (None, SPEC):
        llm = _llm(model_dir, spec)
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        # The first request's own output, sent again: its committed blocks were cached.
        again = llm.generate([prompts[0] + first[0].outputs[0].token_ids[:20]], GREEDY,
                             use_tqdm=False)
        runs.append((llm.stats(), first + rest + again))
    (sp, a), (ss, b) = runs
    assert _ids(a) == _ids(b)
    assert [o.num_cached_tokens for o in a] == [o.num_cached_tokens for o in b]
    assert [o.num_cached_tokens for o in b][1:3] == [24, 24]
    assert b[3].num_cached_tokens >= 40
    assert ss.prefix_hit_tokens == sp.prefix_hit_tokens
    assert ss.spec_num_accepted_tokens > 0


def test_n2_forks_greedy_identical(model_dir):
    prompts = _prompts(3, [6, 7])
    params = SamplingParams(n=2, temperature=0.0, max_tokens=24)
    plain, spec, a, b = _both(model_dir, prompts, params)
    assert _ids(a) == _ids(b)
    assert all(o.outputs[0].token_ids == o.outputs[1].token_ids for o in b)
    assert spec.stats().cow_copies >= 2 and spec.stats().spec_num_accepted_tokens > 0


def test_stop_tokens_and_strings_identical(model_dir, monkeypatch):
    from pagedkv.engine.output_processor import OutputProcessor

    # Spy: how many of a step's tokens were still behind the one a sample finished on.
    behind_at_finish: list[int] = []
    real = OutputProcessor._after_token

    def spy(self, req, index, seq, token, now, logprobs, behind=0):
        done = real(self, req, index, seq, token, now, logprobs, behind)
        if done:
            behind_at_finish.append(behind)
        return done

    monkeypatch.setattr(OutputProcessor, "_after_token", spy)
    prompt = _prompts(4, [7])[0]
    ref = _llm(model_dir).generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    loop = _prompts(7, [7])[0]  # the tiny model repeats one token after this prompt
    tok = _llm(model_dir).generate([loop], GREEDY, use_tqdm=False)[0].outputs[0].token_ids[5]
    stop_tok = ref[12]
    stop_str = f"w{ref[15]} w{ref[16]}"
    # A stop string or stop token met inside a run of accepted drafts: the step's later tokens
    # are dropped.
    long_stop = " ".join([f"w{tok}"] * 8)
    g = dict(temperature=0.0, max_tokens=32)
    cases = [
        (prompt, SamplingParams(stop_token_ids=[stop_tok], **g)),
        (prompt, SamplingParams(stop=[stop_str], **g)),
        (prompt, SamplingParams(stop=[stop_str], include_stop_str_in_output=True, **g)),
        (prompt, SamplingParams(temperature=0.0, max_tokens=7)),
        (prompt, SamplingParams(temperature=0.0, max_tokens=1)),
        (loop, SamplingParams(stop=[long_stop], **g)),
        (loop, SamplingParams(stop=[long_stop], include_stop_str_in_output=True, **g)),
        (loop, SamplingParams(stop_token_ids=[tok], min_tokens=9, **g)),
    ]
    for p, params in cases:
        plain, spec, a, b = _both(model_dir, [p], params)
        oa, ob = a[0].outputs[0], b[0].outputs[0]
        assert (ob.token_ids, ob.text, ob.finish_reason, ob.stop_reason) == (
            oa.token_ids, oa.text, oa.finish_reason, oa.stop_reason), params
        assert spec.stats().num_generated_tokens == len(ob.token_ids)
    # Some sample finished on a token with accepted tokens after it in the same step (dropped).
    assert any(b > 0 for b in behind_at_finish), behind_at_finish


def test_logprobs_identical(model_dir):
    prompts = _prompts(5, [6, 4])
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=3)
    _, spec, a, b = _both(model_dir, prompts, params)
    assert _ids(a) == _ids(b)
    for oa, ob in zip(a, b):
        la, lb = oa.outputs[0].logprobs, ob.outputs[0].logprobs
        assert la is not None and lb is not None and len(la) == len(lb) == 20
        for pa, pb in zip(la, lb):
            assert pa.keys() == pb.keys()
            for t in pa:
                assert pb[t].rank == pa[t].rank
                assert pb[t].logprob == pytest.approx(pa[t].logprob, abs=1e-4)
        assert ob.outputs[0].cumulative_logprob == pytest.approx(
            oa.outputs[0].cumulative_logprob, abs=1e-3)
    assert spec.stats().spec_num_accepted_tokens > 0


def test_prompt_logprobs_beside_drafts_identical(model_dir):
    # A prompt's logprobs (extra logits rows) in the same steps as other sequences' drafts.
    prompts = _prompts(11, [6, 5])
    params = [SamplingParams(temperature=0.0, max_tokens=16),
              SamplingParams(temperature=0.0, max_tokens=16, prompt_logprobs=2, logprobs=1)]
    plain, spec = _llm(model_dir), _llm(model_dir, SPEC)
    a = plain.generate(prompts[:1], params[0], use_tqdm=False)
    b = spec.generate(prompts[:1], params[0], use_tqdm=False)
    # The second request arrives while the first decodes (and drafts): one engine step each.
    for llm in (plain, spec):
        eng = llm.llm_engine
        eng.add_request("x", prompts[0], params[0])
        eng.step()
        eng.step()
        eng.add_request("y", prompts[1], params[1])
        done = {}
        while eng.get_num_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
        (a if llm is plain else b).extend([done["x"], done["y"]])
    assert _ids(a) == _ids(b)
    pa, pb = a[-1].prompt_logprobs, b[-1].prompt_logprobs
    assert pa is not None and pb is not None and len(pa) == len(pb) == len(prompts[1])
    for x, y in zip(pa[1:], pb[1:]):
        assert x.keys() == y.keys()
        assert all(y[t].logprob == pytest.approx(x[t].logprob, abs=1e-4) for t in x)
    assert spec.stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("reclaim", [
    dict(preemption_mode="recompute"),
    dict(preemption_mode="swap", num_host_blocks=64),
], ids=["recompute", "swap"])
def test_chunked_prefill_and_preemption_identical(model_dir, reclaim):
    # 24 blocks of 4 tokens for 4 sequences growing to ~20 + 24 tokens each: preemption.
    prompts = _prompts(6, [5, 6, 7, 4], repeat=4)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain, spec, a, b = _both(model_dir, prompts, params, num_blocks=24, watermark_blocks=1,
                              max_num_batched_tokens=16, **reclaim)
    assert _ids(a) == _ids(b)
    ss = spec.stats()
    assert ss.num_preemptions > 0 and ss.spec_num_accepted_tokens > 0
    if reclaim["preemption_mode"] == "swap":
        assert ss.num_preemptions_swap > 0 and ss.swapped_in_blocks > 0
    spec.llm_engine.manager.check_invariants()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_prefix_cache_tiers_hits_equal(model_dir, tmp_path, tier):
    # 40 device blocks of 4 tokens; six 36-token prompts and their 16 tokens need 13 each, so the
    # second round finds them in the host tier (and, with a small host tier, on disk): hits by
    # tier and outputs must be what the engine gives without speculation. One request at a time:
    # in a batch under pool pressure, speculation ends sequences at other steps, so what is
    # evicted when differs (the outputs stay identical).
    prompts = _prompts(12, [9] * 6, repeat=4)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    kw: dict = dict(num_blocks=40, host_cache_memory="64KiB", prefill_tokens_per_s=1.0)
    runs = []
    for spec in (None, SPEC):
        if tier == "disk":
            kw.update(host_cache_memory="16KiB", disk_cache_memory="1MiB",
                      disk_cache_dir=str(tmp_path / f"disk-{spec is not None}"))
        llm = _llm(model_dir, spec, **kw)
        outs = [o for _ in range(2) for p in prompts
                for o in llm.generate([p], params, use_tqdm=False)]
        llm.llm_engine.manager.check_invariants()
        runs.append((llm.stats(), outs))
        llm.shutdown()
    (sp, a), (ss, b) = runs
    assert _ids(a) == _ids(b)
    assert [o.num_cached_tokens for o in a] == [o.num_cached_tokens for o in b]
    assert ss.prefix_hits_by_tier == sp.prefix_hits_by_tier
    assert ss.prefix_hits_by_tier.get(tier, 0) > 0, ss.prefix_hits_by_tier
    assert ss.spec_num_accepted_tokens > 0


def test_context_length_limits_drafts(model_dir):
    # 6 tokens of room: drafts never push a sequence past the context, output ends at "length".
    prompt = _prompts(7, [10], repeat=25)[0][:250]
    params = SamplingParams(temperature=0.0, max_tokens=50)
    plain, spec, a, b = _both(model_dir, [prompt], params)
    assert _ids(a) == _ids(b)
    assert len(b[0].outputs[0].token_ids) == 6 and b[0].outputs[0].finish_reason == "length"


def test_sampling_seeded_reproducible_whatever_the_batch(model_dir):
    prompts = _prompts(8, [6, 5, 8])
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=123)
    others = SamplingParams(temperature=1.0, max_tokens=16)
    alone = _llm(model_dir, SPEC).generate(prompts[:1], seeded, use_tqdm=False)
    llm = _llm(model_dir, SPEC)
    mixed = llm.generate(prompts, [seeded, others, others], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    again = _llm(model_dir, SPEC).generate(prompts, [seeded, others, seeded], use_tqdm=False)
    assert again[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert len(alone[0].outputs[0].token_ids) == 24
    # n = 2 samples draw differently, reproducibly.
    two = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=5)
    x = _llm(model_dir, SPEC).generate(prompts[:2], two, use_tqdm=False)
    y = _llm(model_dir, SPEC).generate(prompts[:2], two, use_tqdm=False)
    assert _ids(x) == _ids(y)


def test_engine_steps_leave_no_provisional_tokens(model_dir):
    engine = LLMEngine(model_dir, device="cpu", block_size=BLOCK, num_blocks=128,
                       speculative_config=SPEC)
    assert engine.manager.max_provisional == K
    for i, p in enumerate(_prompts(9, [5, 7])):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=20))
    drafted = 0
    while engine.get_num_unfinished_requests():
        engine.step()
        for seq in engine.core.scheduler.running:
            assert engine.manager.num_provisional(seq.seq_id) == 0
            assert engine.manager.seq_len(seq.seq_id) == seq.num_computed_tokens
        engine.manager.check_invariants()
        drafted = engine.stats().spec_num_drafts
    assert drafted > 0


def test_disable_by_batch_size(model_dir):
    prompts = _prompts(10, [5, 6, 7])
    llm = _llm(model_dir, {**SPEC, "disable_by_batch_size": 2})
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert llm.stats().spec_num_drafts == 0  # three decodes: more than 2, never speculated
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert llm.stats().spec_num_drafts > 0
    llm.llm_engine.reset_stats()
    s = llm.stats()
    assert (s.spec_num_drafts, s.spec_num_accepted_tokens, s.spec_acceptance_rate) == (0, 0, 0.0)
    assert s.spec_accepted_tokens_by_position == [0] * K


def test_bad_speculative_config_raises(model_dir):
    with pytest.raises(ConfigArgumentError, match="num_speculative_tokens"):
        _llm(model_dir, {"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ConfigArgumentError, match="method"):
        _llm(model_dir, {"method": "lookahead", "num_speculative_tokens": 2})


def test_token_rows_give_each_verify_token_its_causal_length():
    """A verify step's tokens as decode rows: sequence s's j-th of q new tokens attends to
    ``seq_lens[s] - q + j + 1`` keys (its own included), in packed order."""
    from pagedkv.engine.runner_graphs import token_rows

    qsl = np.array([0, 4, 5, 9])  # 4, 1 and 4 new tokens
    rows = token_rows(qsl, np.array([20, 7, 4]))
    assert rows.dtype == np.int32
    assert rows[0].tolist() == [0, 0, 0, 0, 1, 2, 2, 2, 2]
    assert rows[1].tolist() == [17, 18, 19, 20, 7, 1, 2, 3, 4]


@pytest.mark.gpu
def test_gpu_verify_steps_replay_decode_graphs(model_dir):
    """On CUDA with graphs, a verify step (k + 1 tokens a sequence) replays a decode graph, one
    row per token; in fp32 the greedy outputs equal plain decoding's and the drafts are accepted."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prompts = _prompts(11, (7, 13, 5, 21))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = {}
    for name, spec in (("plain", None), ("spec", SPEC)):
        llm = LLM(model_dir, device="cuda", dtype=torch.float32, progress=False, block_size=16,
                  num_blocks=128, max_num_seqs=4, speculative_config=spec)
        runner = llm.llm_engine.core.runner
        assert runner.graph_sizes
        outs[name] = _ids(llm.generate(prompts, params, use_tqdm=False))
        st = llm.stats()
        if spec is not None:
            assert runner.max_graph_rows == 4 * (K + 1)
            assert runner.graph_sizes[-1] == 4 * (K + 1)
            assert runner.graph_verify_steps > 0
            assert st.spec_num_accepted_tokens > 0
        llm.llm_engine.manager.check_invariants()
        llm.shutdown()
    assert outs["spec"] == outs["plain"]
