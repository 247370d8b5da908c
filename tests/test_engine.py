"""The engine (``pagedkv.LLM`` / ``LLMEngine``) end to end against transformers' dense ``generate``.

Small random-initialised Llama and Qwen2 models (fp32, seeded; the Llama one with a word-level
tokenizer) are saved with ``save_pretrained`` and reloaded through the engine's real loader. Greedy
token ids must equal ``model.generate(do_sample=False)`` with transformers' own dense cache on: a ragged batch,
shared prefixes (prefix-cache hits, checked in the stats), ``n = 2`` samples (forked copy-on-write),
chunked prefill (a small token budget), and forced preemption (a tiny pool; preemptions counted, the
output unchanged). Sampling: seeded requests are reproducible, and survive preemption unchanged.
Bad input raises typed errors and leaves the engine empty.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pagedkv  # noqa: E402
from pagedkv import LLM, CompletionOutput, LLMEngine, RequestOutput, SamplingParams  # noqa: E402
from pagedkv.errors import InvalidArgumentError, ModelLoadError, PagedKVError  # noqa: E402

VOCAB = 128
BLOCK = 4
MAX_LEN = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _save_tiny(kind: str, directory: str) -> str:
    torch.manual_seed(1234)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
                  initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
    else:
        cfg = transformers.Qwen2Config(use_sliding_window=False, **common)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # Qwen2's Q/K/V biases start at zero; make them matter
                p.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    if kind == "llama":
        # Only the Llama model gets a tokenizer: transformers maps a Qwen2 config to its own
        # byte-level BPE class, and the Qwen2 model covers the no-tokenizer path instead.
        _save_tokenizer(directory)
    return directory


def _save_tokenizer(directory: str) -> None:
    # A word-level tokenizer: token i is the word "w<i>", so text round-trips exactly.
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    fast.save_pretrained(directory)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    return _save_tiny(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def dense(model_dir):
    """The same checkpoint loaded by transformers alone: the reference."""
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _llm(model_dir, **kw) -> LLM:
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("num_blocks", 128)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("device", "cpu")
    return LLM(model_dir, progress=False, **kw)


def _reference(dense, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        # An explicit mask: otherwise generate masks out prompt tokens equal to the pad id.
        out = dense.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _prompts(seed, lengths):
    g = np.random.default_rng(seed)
    return [g.integers(0, VOCAB, n).tolist() for n in lengths]


def _assert_greedy_equal(dense, prompts, outs, max_tokens):
    assert [o.prompt_token_ids for o in outs] == [list(p) for p in prompts]
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            assert c.token_ids == _reference(dense, p, max_tokens), (len(p), c.index)


# --------------------------------------------------------------------------------- greedy equality

def test_ragged_batch_matches_generate(model_dir, dense):
    llm = _llm(model_dir)
    prompts = _prompts(0, [1, 5, 17, 30, 9, 44])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(isinstance(o, RequestOutput) and o.finished for o in outs)
    assert all(isinstance(c, CompletionOutput) for o in outs for c in o.outputs)
    assert [len(o.outputs[0].token_ids) for o in outs] == [10] * len(prompts)
    assert {o.outputs[0].finish_reason for o in outs} == {"length"}
    _assert_greedy_equal(dense, prompts, outs, 10)
    s = llm.stats()
    assert s.num_finished_requests == len(prompts)
    assert s.num_generated_tokens == 10 * len(prompts)
    assert s.peak_running_seqs == len(prompts)  # all ran together (continuous batching)
    assert 0 < s.peak_kv_utilization <= 1
    assert s.mean_ttft_s is not None and s.mean_ttft_s >= 0


def test_shared_prefix_hits(model_dir, dense):
    llm = _llm(model_dir)
    system = _prompts(1, [24])[0]  # 6 full blocks
    prompts = [system + tail for tail in _prompts(2, [3, 7, 5, 11])]
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    _assert_greedy_equal(dense, prompts, first + rest, 10)
    # Every later request found the system prompt's 6 blocks cached.
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [24, 24, 24]
    s = llm.stats()
    assert s.prefix_hit_tokens >= 3 * 24
    assert s.request_prefix_hit_ratio == pytest.approx(72 / sum(map(len, prompts)))
    assert s.prefix_hit_ratio > 0


def test_n2_samples_greedy_fork(model_dir, dense):
    llm = _llm(model_dir)
    prompts = _prompts(3, [6, 13])  # 13 tokens: a partial tail block shared copy-on-write
    params = SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.index for c in o.outputs] for o in outs] == [[0, 1], [0, 1]]
    _assert_greedy_equal(dense, prompts, outs, 10)
    s = llm.stats()
    # The prompt ran once per request, not once per sample.
    assert s.num_prefill_tokens == sum(map(len, prompts))
    assert s.cow_copies >= 2
    assert s.num_generated_tokens == 2 * 2 * 10


def test_n2_samples_sampled_differ_and_reproduce(model_dir):
    prompts = _prompts(4, [7, 12])
    params = SamplingParams(n=2, temperature=1.0, top_k=50, top_p=0.95, max_tokens=12, seed=11,
                            ignore_eos=True)
    a = _llm(model_dir).generate(prompts, params, use_tqdm=False)
    b = _llm(model_dir).generate(prompts, params, use_tqdm=False)
    ids = lambda outs: [[c.token_ids for c in o.outputs] for o in outs]  # noqa: E731
    assert ids(a) == ids(b)
    for o in a:
        assert o.outputs[0].token_ids != o.outputs[1].token_ids
        assert all(0 <= t < VOCAB for c in o.outputs for t in c.token_ids)


def test_chunked_prefill_matches_generate(model_dir, dense):
    llm = _llm(model_dir, max_num_batched_tokens=8, max_num_seqs=4)
    prompts = _prompts(5, [30, 19, 3, 41])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _assert_greedy_equal(dense, prompts, outs, 10)
    s = llm.stats()
    # 93 prompt tokens through an 8-token budget: at least 12 steps just for prefill.
    assert s.num_steps >= 12 + 9


def test_forced_preemption_output_unchanged(model_dir, dense):
    # 16 blocks of 4 tokens = 64 token slots for 4 sequences that grow to 10 + 24 tokens each.
    llm = _llm(model_dir, num_blocks=16, watermark_blocks=1)
    prompts = _prompts(6, [10, 9, 11, 8])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    s = llm.stats()
    assert s.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == s.num_preemptions
    _assert_greedy_equal(dense, prompts, outs, 24)


def test_preempted_sampled_request_resumes_unchanged(model_dir):
    prompts = _prompts(7, [10, 9, 11, 8])
    params = [SamplingParams(temperature=0.9, max_tokens=24, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    roomy = _llm(model_dir, num_blocks=256)
    tight = _llm(model_dir, num_blocks=16, watermark_blocks=1)
    a = roomy.generate(prompts, params, use_tqdm=False)
    b = tight.generate(prompts, params, use_tqdm=False)
    assert roomy.stats().num_preemptions == 0 and tight.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


# --------------------------------------------------------------------------- finishing, text, salt

def _has_tokenizer(llm):
    return llm.get_tokenizer() is not None


def test_stop_tokens_and_context_length(model_dir, dense):
    llm = _llm(model_dir)
    prompt = _prompts(8, [12])[0]
    ref = _reference(dense, prompt, 10)
    stop = ref[3]
    first = ref.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # The stop token is not in the text; the rest round-trips through the word-level tokenizer.
    if _has_tokenizer(llm):
        assert out.text.split() == [f"w{t}" for t in ref[:first]]
    else:
        assert out.text == ""

    # The model's context (128 tokens) ends generation with "length" before max_tokens does.
    long = _prompts(9, [MAX_LEN - 5])[0]
    out = llm.generate([long], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert out.token_ids == _reference(dense, long, 5)


def test_eos_stops_unless_ignored(model_dir, dense):
    llm = _llm(model_dir)
    prompt = _prompts(10, [9])[0]
    ref = _reference(dense, prompt, 12)
    eng = llm.llm_engine
    eng.eos_token_ids = frozenset({ref[4]})  # pretend the model's EOS is the 5th greedy token
    first = ref.index(ref[4])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref[:first + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref and out[0].outputs[0].finish_reason == "length"


def test_string_prompts_and_detokenized_text(model_dir, dense):
    llm = _llm(model_dir)
    if not _has_tokenizer(llm):
        with pytest.raises(InvalidArgumentError, match="no tokenizer"):
            llm.generate("w1 w2", GREEDY, use_tqdm=False)
        return
    text = "w5 w17 w99 w3 w64"
    outs = llm.generate([text, {"prompt": "w1 w2"}, {"prompt_token_ids": [7, 8, 9]}], GREEDY,
                        use_tqdm=False)
    assert outs[0].prompt == text and outs[0].prompt_token_ids == [5, 17, 99, 3, 64]
    assert outs[1].prompt_token_ids == [1, 2] and outs[2].prompt is None
    ref = _reference(dense, [5, 17, 99, 3, 64], 10)
    assert outs[0].outputs[0].token_ids == ref
    assert outs[0].outputs[0].text.split() == [f"w{t}" for t in ref]


def test_cache_salt_separates_tenants(model_dir):
    llm = _llm(model_dir)
    prompt = _prompts(11, [20])[0]
    llm.generate([prompt], GREEDY, cache_salt="tenant-a", use_tqdm=False)
    other = llm.generate([prompt], GREEDY, cache_salt="tenant-b", use_tqdm=False)[0]
    same = llm.generate([prompt], GREEDY, cache_salt=b"tenant-a", use_tqdm=False)[0]
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 16
    assert other.outputs[0].token_ids == same.outputs[0].token_ids


def test_empty_cache_salt_is_refused(model_dir):
    llm = _llm(model_dir)
    prompt = _prompts(13, [20])[0]
    for salt in ("", b"", ["tenant-a", ""]):
        with pytest.raises(InvalidArgumentError, match="pass None for no salt") as info:
            llm.generate([prompt, prompt] if isinstance(salt, list) else [prompt], GREEDY,
                         cache_salt=salt, use_tqdm=False)
        assert info.value.what == "cache_salt"
        with pytest.raises(InvalidArgumentError, match="pass None for no salt"):
            llm.llm_engine.add_request(None, prompt, GREEDY, cache_salt=b"" if salt else "")
        assert not llm.llm_engine.has_unfinished_requests()


def test_prefix_caching_off(model_dir):
    llm = _llm(model_dir, enable_prefix_caching=False)
    prompt = _prompts(12, [20])[0]
    llm.generate([prompt, prompt], GREEDY, use_tqdm=False)
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and llm.stats().prefix_hit_tokens == 0


def test_engine_step_api(model_dir, dense):
    engine = LLMEngine(model_dir, device="cpu", block_size=BLOCK, num_blocks=64, max_num_seqs=4,
                       max_num_batched_tokens=16)
    prompts = _prompts(13, [6, 21])
    assert engine.add_request("a", prompts[0], GREEDY) == "a"
    rid = engine.add_request(None, prompts[1], SamplingParams(temperature=0, max_tokens=4,
                                                              ignore_eos=True))
    with pytest.raises(InvalidArgumentError):
        engine.add_request("a", prompts[0], GREEDY)  # id in use
    final = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.outputs[0].token_ids  # only requests with new tokens are reported
            if out.finished:
                final[out.request_id] = out
        steps += 1
        assert steps < 100
    assert set(final) == {"a", rid}
    assert final["a"].outputs[0].token_ids == _reference(dense, prompts[0], 10)
    assert final[rid].outputs[0].token_ids == _reference(dense, prompts[1], 4)
    assert engine.step() == []
    assert engine.manager.num_seqs == 0  # every sequence's blocks were freed


def test_abort_request_frees_blocks(model_dir):
    engine = LLMEngine(model_dir, device="cpu", block_size=BLOCK, num_blocks=64)
    engine.add_request("x", _prompts(14, [9])[0], GREEDY)
    engine.step()
    assert engine.manager.num_seqs == 1
    engine.abort_request("x")
    assert not engine.has_unfinished_requests() and engine.manager.num_seqs == 0
    with pytest.raises(InvalidArgumentError):
        engine.abort_request("x")


def test_exports_are_lazy_and_public():
    assert pagedkv.LLM is LLM and pagedkv.SamplingParams is SamplingParams
    assert pagedkv.RequestOutput is RequestOutput and pagedkv.CompletionOutput is CompletionOutput
    assert {"LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"} <= set(
        pagedkv.__all__)


# ------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs", [
    dict(n=0), dict(max_tokens=0), dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.01),
    dict(top_k=0), dict(top_k=-2), dict(n=True), dict(max_tokens=2.0), dict(seed=-1),
    dict(stop_token_ids=[-1]), dict(stop_token_ids="ab"), dict(ignore_eos="yes"),
    dict(temperature=float("nan")),
])
def test_sampling_params_rejected(kwargs):
    with pytest.raises(InvalidArgumentError) as exc:
        SamplingParams(**kwargs)
    assert exc.value.what == next(iter(kwargs))


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError):
        LLM(str(tmp_path / "no-such-model"), progress=False, device="cpu")


@pytest.mark.parametrize("prompt", [[], "", [1.5], [-1], [VOCAB], [1, 2**70], [2, True],
                                    list(range(MAX_LEN)), b"w1"])
def test_bad_prompts_rejected_nothing_queued(model_dir, prompt):
    llm = _llm(model_dir)
    good = _prompts(15, [5])[0]
    with pytest.raises(InvalidArgumentError) as exc:
        llm.generate([good, prompt], GREEDY, use_tqdm=False)
    assert exc.value.what == "prompt"
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests() and eng.manager.num_seqs == 0
    assert eng.scheduler.num_waiting == 0
    # Still serves the good prompt afterwards.
    assert llm.generate([good], GREEDY, use_tqdm=False)[0].finished


def test_bad_generate_arguments(model_dir):
    llm = _llm(model_dir)
    p = _prompts(16, [5, 6])
    with pytest.raises(InvalidArgumentError):
        llm.generate(p, [GREEDY], use_tqdm=False)  # one params for two prompts
    with pytest.raises(InvalidArgumentError):
        llm.generate(p, {"temperature": 0}, use_tqdm=False)
    with pytest.raises(InvalidArgumentError):
        llm.generate(p, GREEDY, cache_salt=["a"], use_tqdm=False)
    with pytest.raises(InvalidArgumentError):
        llm.generate(p, SamplingParams(n=9), use_tqdm=False)  # n above max_num_seqs (8)
    assert not llm.llm_engine.has_unfinished_requests()


def test_bad_engine_config(model_dir):
    with pytest.raises(PagedKVError):
        LLM(model_dir, num_blocks=8, kv_cache_memory=2**20, progress=False, device="cpu")
    with pytest.raises(PagedKVError):
        LLM(model_dir, block_size=0, progress=False, device="cpu")


# ---------------------------------------------------------------------------------------------- GPU

#: A greedy token chosen by the engine in bf16 must be the dense bf16 model's argmax up to bf16
#: noise: its dense log-prob may trail the dense maximum by at most this much.
GPU_GREEDY_MARGIN = 0.15


@pytest.mark.gpu
def test_gpu_llm_greedy_is_dense_argmax_with_forks_hits_and_preemption(tmp_path):
    """The whole engine on CUDA (Triton kernels, CUDA-graph decode): ragged prompts with a shared
    prefix, n=2 forks and a pool small enough to preempt. Every greedy token is the dense model's
    argmax (teacher forcing over the engine's own output, bf16 tolerance above)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024,
                                   num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=2, max_position_embeddings=1024,
                                   initializer_range=0.05, eos_token_id=None, bos_token_id=None,
                                   pad_token_id=None)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path))
    g = np.random.default_rng(3)
    shared = g.integers(0, 1024, 40).tolist()
    prompts = [shared + g.integers(0, 1024, n).tolist() for n in (5, 60, 17, 1, 90, 33)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, n=2 if i % 3 == 0 else 1,
                             ignore_eos=True) for i in range(len(prompts))]
    llm = LLM(str(tmp_path), device="cuda", dtype=torch.bfloat16, block_size=16, num_blocks=24,
              max_num_seqs=8, max_num_batched_tokens=128, progress=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    st = llm.stats()
    assert st.num_preemptions > 0
    dense = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.bfloat16).to("cuda").eval()
    worst = 0.0
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            assert len(c.token_ids) == 24
            ids = torch.tensor([p + c.token_ids], device="cuda")
            with torch.no_grad():
                lp = torch.log_softmax(dense(ids).logits[0].float(), -1)
            pos = torch.arange(len(p) - 1, len(p) - 1 + len(c.token_ids), device="cuda")
            chosen = lp[pos, torch.tensor(c.token_ids, device="cuda")]
            gap = (lp[pos].max(-1).values - chosen).max().item()
            worst = max(worst, gap)
    print(f"engine on CUDA: {st.num_preemptions} preemptions; worst greedy log-prob gap to the "
          f"dense bf16 argmax {worst:.4f}")
    assert worst <= GPU_GREEDY_MARGIN
