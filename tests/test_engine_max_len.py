"""max_model_len: the longest sequence the engine serves, from the model's context and the pool.

A pool that holds a whole context leaves ``max_model_len`` at the model's context (and a request
that runs into it ends with ``"length"``, as before). A pool that cannot is the limit: a warning at
start-up names both lengths, ``LLM.max_model_len`` reports the pool's, and a request that would
outgrow it is refused at ``add_request`` (a typed error naming the lengths and the limit, nothing
queued) instead of being cut short under ``finish_reason="length"``.
"""

from __future__ import annotations

import logging
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402

CONTEXT = 128
BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=CONTEXT,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)
    directory = str(tmp_path_factory.mktemp("tiny"))
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
    return directory


def _llm(model_dir, **kw) -> LLM:
    return LLM(model_dir, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=64,
               device="cpu", progress=False, **kw)


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_a_pool_that_holds_the_context_leaves_the_model_s_limit(model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        llm = _llm(model_dir, num_blocks=64)
    assert llm.max_model_len == llm.llm_engine.max_model_len == CONTEXT
    assert llm.llm_engine.model_context_len == CONTEXT
    assert not [r for r in caplog.records if "max_model_len" in r.getMessage()]
    # Running into the model's own context ends the request there, as it always did.
    out = llm.generate([list(range(1, CONTEXT - 3))], _params(50), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_a_small_pool_sets_max_model_len_warns_and_refuses_what_cannot_fit(model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        llm = _llm(model_dir, num_blocks=16, watermark_blocks=0)
    limit = 16 * BLOCK
    assert llm.max_model_len == llm.llm_engine.max_model_len == limit < CONTEXT
    warned = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
    assert len(warned) == 1 and str(limit) in warned[0] and str(CONTEXT) in warned[0]

    engine = llm.llm_engine
    prompt = list(range(1, 41))
    # Prompt + max_tokens past the pool's limit: refused, naming the lengths and the limit.
    with pytest.raises(InvalidArgumentError) as info:
        engine.add_request("too-long", prompt, _params(limit - 40 + 1))
    msg = str(info.value)
    assert "40" in msg and str(limit - 40 + 1) in msg and str(limit) in msg
    assert info.value.what == "max_tokens"
    # A prompt that alone reaches the limit: refused too.
    with pytest.raises(InvalidArgumentError) as info:
        engine.add_request("prompt-too-long", list(range(1, limit + 1)), _params(1))
    assert str(limit) in str(info.value)
    # Nothing was queued, and generate refuses the whole batch before queuing any of it.
    with pytest.raises(InvalidArgumentError):
        llm.generate([[1, 2, 3], prompt], [_params(4), _params(limit)], use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_requests == 0

    # Exactly the limit fits, and ends at max_tokens.
    out = llm.generate([prompt], _params(limit - 40), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == limit - 40 and out.finish_reason == "length"
