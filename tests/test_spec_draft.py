"""Speculative decoding with a draft model (``speculative_config={"model": path, ...}``) on tiny
random Llamas (fp32, CPU, the engine's real loader).

The draft's KV lives in a pool indexed by the target's block ids, computed at exactly the
positions the target computes. Checked here: greedy outputs identical to no speculation with the
target as its own draft (every draft accepted, with and without sampling: the draft's
distributions reach verification, so ``p / q = 1``), with a perturbed copy of the target (some
drafts rejected) and with a draft of another shape (layers, heads, head dim) — across prefix-cache
hits, ``n = 2`` forks, chunked prefill and preemption by recompute and by swap (after which the
target-as-draft still has every draft accepted: the draft's KV survived the prefix cache, the
host pool and copy-on-write); ``check_invariants()`` after; the configurations that are refused.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pagedkv import LLM, LLMEngine, SamplingParams  # noqa: E402
from pagedkv.errors import ConfigArgumentError  # noqa: E402

from tiny_llama import VOCAB, save_tiny_llama  # noqa: E402

K = 3
BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
_COMMON = dict(hidden_size=64, intermediate_size=128, max_position_embeddings=256,
               initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def _save(directory: str, cfg, seed: int = 3) -> str:
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_draft")
    target = save_tiny_llama(str(root / "target"), max_len=256)
    # The target's weights plus a little noise: it agrees with the target often, not always.
    m = transformers.AutoModelForCausalLM.from_pretrained(target)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * torch.randn_like(p))
    m.save_pretrained(str(root / "noisy"))
    llama = transformers.LlamaConfig
    return {
        "target": target,
        "noisy": str(root / "noisy"),
        # One layer, two query heads, one KV head of 32: a pool of another shape.
        "odd": _save(str(root / "odd"), llama(vocab_size=VOCAB, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=1,
                                              **_COMMON)),
        "vocab96": _save(str(root / "vocab96"), llama(vocab_size=96, num_hidden_layers=1,
                                                      num_attention_heads=4,
                                                      num_key_value_heads=2, **_COMMON)),
        # Full layers beside sliding ones: several KV cache groups.
        "hybrid": _save(str(root / "hybrid"), transformers.Qwen2Config(
            vocab_size=VOCAB, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            use_sliding_window=True, sliding_window=8, max_window_layers=2, **_COMMON)),
    }


def _spec(path: str, k: int = K) -> dict:
    return {"model": path, "num_speculative_tokens": k}


def _llm(target: str, spec=None, **kw) -> LLM:
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("num_blocks", 256)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    return LLM(target, device="cpu", progress=False, speculative_config=spec, **kw)


def _prompts(seed: int, lengths, repeat: int = 2):
    g = np.random.default_rng(seed)
    return [g.integers(3, VOCAB, n).tolist() * repeat for n in lengths]


def _ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _run_workload(llm: LLM):
    """Shared-prefix prompts (prefix hits), then the first request's own output sent again (a hit
    on blocks whose tokens were drafts), then ``n = 2`` samples of two prompts (forks)."""
    system = _prompts(1, [6], repeat=4)[0]  # 24 tokens: 6 full blocks
    prompts = [system + t[:5] for t in _prompts(2, [5, 5, 5])]
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    again = llm.generate([prompts[0] + first[0].outputs[0].token_ids[:20]], GREEDY,
                         use_tqdm=False)
    forks = llm.generate(_prompts(3, [6, 7]), SamplingParams(n=2, temperature=0.0,
                                                             max_tokens=16), use_tqdm=False)
    return first + rest + again + forks


@pytest.fixture(scope="module")
def plain_workload(models):
    llm = _llm(models["target"])
    outs = _run_workload(llm)
    return llm.stats(), outs, llm


def test_target_as_its_own_draft_accepts_every_draft(models, plain_workload):
    sp, a, plain = plain_workload
    llm = _llm(models["target"], _spec(models["target"]))
    b = _run_workload(llm)
    assert _ids(a) == _ids(b)
    assert [o.num_cached_tokens for o in a] == [o.num_cached_tokens for o in b]
    assert [o.num_cached_tokens for o in b][1:3] == [24, 24] and b[3].num_cached_tokens >= 40
    ss = llm.stats()
    assert ss.prefix_hit_tokens == sp.prefix_hit_tokens and ss.cow_copies >= 1
    assert ss.spec_num_drafts > 0 and ss.spec_num_draft_tokens > ss.spec_num_drafts
    assert ss.spec_num_accepted_tokens == ss.spec_num_draft_tokens  # every draft accepted
    assert ss.spec_acceptance_rate == 1.0
    assert ss.spec_accepted_tokens_by_position[0] == ss.spec_num_drafts
    assert ss.num_generated_tokens == sp.num_generated_tokens and ss.num_steps < sp.num_steps
    engine = llm.llm_engine
    assert engine.core.proposer.runner.pool.num_blocks == engine.manager.num_blocks
    # The draft-length policy prices the draft's forwards with the draft runner's measured rates.
    rate, floor = engine.core.spec_policy.draft_rates
    assert rate > 0 and floor >= 0
    engine.manager.check_invariants()


@pytest.mark.parametrize("draft", ["noisy", "odd"])
def test_other_draft_greedy_identical(models, plain_workload, draft):
    sp, a, _ = plain_workload
    llm = _llm(models["target"], _spec(models[draft]))
    b = _run_workload(llm)
    assert _ids(a) == _ids(b)
    assert [o.num_cached_tokens for o in a] == [o.num_cached_tokens for o in b]
    ss = llm.stats()
    assert ss.spec_num_draft_tokens > 0
    assert ss.spec_num_accepted_tokens < ss.spec_num_draft_tokens  # some rejected
    if draft == "noisy":
        assert ss.spec_num_accepted_tokens > 0  # and some accepted
    pool = llm.llm_engine.core.proposer.runner.pool
    assert tuple(pool.kv.shape[:1]) == ((2,) if draft == "noisy" else (1,))
    llm.llm_engine.manager.check_invariants()


@pytest.mark.parametrize("reclaim", [
    dict(preemption_mode="recompute"),
    dict(preemption_mode="swap", num_host_blocks=64),
], ids=["recompute", "swap"])
def test_chunked_prefill_and_preemption(models, reclaim):
    # 24 blocks of 4 tokens for 4 sequences growing to ~20 + 24 tokens each: preemption, and
    # prompts prefilled in chunks of at most 16 tokens.
    prompts = _prompts(6, [5, 6, 7, 4], repeat=4)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    kw = dict(num_blocks=24, watermark_blocks=1, max_num_batched_tokens=16, **reclaim)
    a = _llm(models["target"], **kw).generate(prompts, params, use_tqdm=False)
    for draft in ("target", "noisy"):
        llm = _llm(models["target"], _spec(models[draft]), **kw)
        b = llm.generate(prompts, params, use_tqdm=False)
        assert _ids(a) == _ids(b), draft
        ss = llm.stats()
        assert ss.num_preemptions > 0 and ss.spec_num_accepted_tokens > 0
        if reclaim["preemption_mode"] == "swap":
            assert ss.num_preemptions_swap > 0 and ss.swapped_in_blocks > 0
        if draft == "target":  # the draft's KV came back whole: every draft still accepted
            assert ss.spec_num_accepted_tokens == ss.spec_num_draft_tokens
        llm.llm_engine.manager.check_invariants()


def test_host_tier_serves_the_draft_kv_too(models):
    # 48 device blocks of 4 tokens; each 40-token prompt and its 12 tokens need 13. A host tier
    # of 96 blocks keeps what the device evicts; the prompts sent again hit it. With the target as
    # its own draft every draft is accepted only if the draft's KV came back from the host whole.
    prompts = _prompts(12, [10, 10, 10, 10, 10, 10], repeat=4)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    plain = _llm(models["target"], num_blocks=48)
    a = plain.generate(prompts, params, use_tqdm=False)
    a2 = plain.generate(prompts, params, use_tqdm=False)
    target = models["target"]
    for draft in ("target", "noisy"):
        spec = _spec(models[draft])
        probe = _llm(target, spec, num_blocks=48)
        bpb = (probe.llm_engine.runner.spec.bytes_per_block
               + probe.llm_engine.core.proposer.runner.spec.bytes_per_block)
        llm = _llm(target, spec, num_blocks=48, host_cache_memory=96 * bpb,
                   prefill_tokens_per_s=1.0)
        engine = llm.llm_engine
        # The host pool holds both models' KV per block: 96 of them in the budget given.
        assert engine.manager.num_host_blocks == 96
        assert engine.core.proposer.runner.swap is not None
        b = llm.generate(prompts, params, use_tqdm=False)
        b2 = llm.generate(prompts, params, use_tqdm=False)
        assert _ids(a) == _ids(b) and _ids(a2) == _ids(b2), draft
        ss = llm.stats()
        assert ss.prefix_hits_by_tier.get("host", 0) > 0, draft  # the second round hit the host tier
        assert ss.spec_num_draft_tokens > 0
        if draft == "target":
            assert ss.spec_num_accepted_tokens == ss.spec_num_draft_tokens
        engine.manager.check_invariants()


def test_sampling_passes_the_draft_distribution_and_is_reproducible(models):
    prompts = _prompts(8, [6, 5, 8])
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=123)
    others = SamplingParams(temperature=1.0, max_tokens=16)
    spec = _spec(models["target"])
    alone = _llm(models["target"], spec).generate(prompts[:1], seeded, use_tqdm=False)
    llm = _llm(models["target"], spec)
    mixed = llm.generate(prompts, [seeded, others, others], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert len(alone[0].outputs[0].token_ids) == 24
    s = llm.stats()
    # The draft is the target: q = p, so min(1, p/q) accepts every sampled draft (a point-mass
    # treatment, p(d) < 1, would reject many).
    assert s.spec_num_draft_tokens > 20
    assert s.spec_num_accepted_tokens >= 0.95 * s.spec_num_draft_tokens


def test_engine_steps_keep_draft_kv_in_lockstep(models):
    engine = LLMEngine(models["target"], device="cpu", block_size=BLOCK, num_blocks=128,
                       speculative_config=_spec(models["target"], 2))
    proposer = engine.core.proposer
    assert engine.manager.max_provisional == 2 and proposer.method == "draft_model"
    longest: list = []
    real = proposer.draft_step

    def spy(batch, rows):
        drawn = real(batch, rows)
        longest.append(max((len(d) for d in batch.drafts), default=0))
        return drawn

    proposer.draft_step = spy
    for i, p in enumerate(_prompts(9, [5, 7])):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=20))
    while engine.get_num_unfinished_requests():
        before = proposer.num_forwards
        engine.step()
        # One forward over the step's known tokens, then one per draft position (k = 2).
        assert proposer.num_forwards - before == 1 + longest[-1]
        for seq in engine.core.scheduler.running:
            assert engine.manager.num_provisional(seq.seq_id) == 0
        engine.manager.check_invariants()
    assert engine.stats().spec_num_drafts > 0 and 2 in longest and 0 in longest


def test_pool_sizing_counts_both_models(models):
    budget = 4 * 2**20
    plain = LLMEngine(models["target"], device="cpu", block_size=BLOCK, kv_cache_memory=budget)
    spec = LLMEngine(models["target"], device="cpu", block_size=BLOCK, kv_cache_memory=budget,
                     speculative_config=_spec(models["odd"]))
    t_bpb = plain.runner.spec.bytes_per_block
    d_bpb = spec.core.proposer.runner.spec.bytes_per_block
    assert plain.manager.num_blocks == budget // t_bpb
    assert spec.manager.num_blocks == budget // (t_bpb + d_bpb)
    assert spec.core.proposer.runner.pool.num_blocks == spec.manager.num_blocks


def test_bad_draft_configs_raise(models, tmp_path):
    target = models["target"]
    with pytest.raises(ConfigArgumentError, match="num_speculative_tokens"):
        _llm(target, _spec(models["noisy"], 0))
    with pytest.raises(ConfigArgumentError, match=r"speculative_config\.model.*no such file"):
        _llm(target, _spec(str(tmp_path / "absent")))
    with pytest.raises(ConfigArgumentError, match=r"96 tokens, the target's 128") as e:
        _llm(target, _spec(models["vocab96"]))
    assert e.value.field == "speculative_config.model"
    with pytest.raises(ConfigArgumentError, match="several KV cache groups"):
        _llm(target, _spec(models["hybrid"]))
    with pytest.raises(ConfigArgumentError, match="attend fully"):
        _llm(models["hybrid"], _spec(target))
    with pytest.raises(ConfigArgumentError, match="disk_cache_dir"):
        _llm(target, _spec(models["noisy"]), host_cache_memory=2**20, disk_cache_memory=2**20,
             disk_cache_dir=str(tmp_path / "disk"))
    with pytest.raises(ConfigArgumentError, match=r"speculative_config\.model.*needs the draft"):
        _llm(target, {"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ConfigArgumentError, match="method 'draft_model', not 'ngram'"):
        _llm(target, {"method": "ngram", "model": target, "num_speculative_tokens": 2})
    with pytest.raises(ConfigArgumentError, match="prompt_lookup_max"):
        _llm(target, {**_spec(target), "prompt_lookup_max": 3})


def test_serve_flag_takes_a_draft_model(monkeypatch, models):
    pytest.importorskip("fastapi")
    import pagedkv.serve.app as app
    from pagedkv.cli import main

    calls: list = []
    monkeypatch.setattr(app, "serve", lambda model, **kw: calls.append(kw))
    flag = '{"model": "%s", "num_speculative_tokens": 2}' % models["noisy"]
    assert main(["serve", models["target"], "--speculative-config", flag]) == 0
    spec = calls[0]["engine_config"].speculative
    assert (spec.method, spec.model, spec.num_speculative_tokens) == (
        "draft_model", models["noisy"], 2)


def test_server_with_a_draft_model_answers_the_plain_greedy_text(models):
    for mod in ("fastapi", "uvicorn", "openai", "httpx"):
        pytest.importorskip(mod)
    import json

    from serve_server import NAME, Server, openai

    prompt = " ".join(f"w{t}" for t in _prompts(12, [7])[0])
    want = _llm(models["target"]).generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=20), use_tqdm=False)[0].outputs[0].text
    server = Server(models["target"], speculative_config=json.dumps(_spec(models["noisy"], 2)))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=20,
                                        temperature=0.0)
        assert got.choices[0].text == want and got.usage.completion_tokens == 20
        stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=20,
                                           temperature=0.0, stream=True)
        assert "".join(c.choices[0].text for c in stream) == want
        server.wait_idle()
        s = server.llm.engine.stats()
        assert s.spec_num_draft_tokens > 0 and s.spec_num_accepted_tokens > 0
    finally:
        server.stop()
