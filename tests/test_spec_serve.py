"""Speculative decoding behind ``AsyncLLM`` and ``pagedkv serve``.

``--speculative-config JSON`` (vLLM's flag) reaches the engine config; a real uvicorn server over
an ``AsyncLLM`` with n-gram speculation answers the real ``openai`` client with exactly the greedy
text of an engine without speculation, streaming or not; ``/metrics`` carries the ``spec_decode``
counters.
"""

from __future__ import annotations

import re

import pytest

from test_serve import NAME, Server, httpx, openai  # noqa: F401  (skips as test_serve does)

import pagedkv  # noqa: E402
from pagedkv import SamplingParams  # noqa: E402
from pagedkv.cli import build_parser, main  # noqa: E402
from pagedkv.engine.spec_decode import SpeculativeConfig  # noqa: E402

from tiny_llama import save_tiny_llama  # noqa: E402

SPEC_JSON = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
ENGINE = dict(device="cpu", num_blocks=128, block_size=4, max_num_seqs=8,
              max_num_batched_tokens=64)
# A passage repeated: the n-gram proposer drafts from it (the words of the tiny tokenizer).
PROMPT = " ".join(f"w{t}" for t in [93, 120, 113, 66, 7, 125, 124] * 3)


def test_serve_flag_parses_to_the_engine_config(monkeypatch):
    pytest.importorskip("fastapi")
    import pagedkv.serve.app as app

    calls: list = []
    monkeypatch.setattr(app, "serve", lambda model, **kw: calls.append(kw))
    assert main(["serve", "m", "--speculative-config", SPEC_JSON]) == 0
    cfg = calls[0]["engine_config"]
    assert cfg.speculative == SpeculativeConfig("ngram", 3, 1, 3)
    assert "--speculative-config" in build_parser().subcommand_parsers["serve"].format_help()


def test_serve_flag_bad_config_exits_2(capsys):
    assert main(["serve", "m", "--speculative-config", '{"num_speculative_tokens": 0}']) == 2
    assert "num_speculative_tokens" in capsys.readouterr().err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_spec_serve")))


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir, speculative_config=SPEC_JSON)
    yield s
    s.stop()


def test_greedy_completions_equal_no_speculation_and_metrics(server, model_dir):
    plain = pagedkv.LLM(model_dir, progress=False, **ENGINE)
    want = plain.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24),
                          use_tqdm=False)[0].outputs[0]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    got = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0.0)
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == 24
    stream = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0.0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == want.text
    server.wait_idle()
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        m = re.search(rf'^pagedkv_spec_decode_{name}_total\{{model_name="{NAME}"\}} (\S+)$', text,
                      re.M)
        assert m, name
        values[name] = float(m.group(1))
    assert values["num_accepted_tokens"] > 0
    assert values["num_draft_tokens"] >= values["num_accepted_tokens"]
    pos = re.findall(r'^pagedkv_spec_decode_num_accepted_tokens_per_pos_total\{model_name="tiny",'
                     r'position="(\d)"\} (\S+)$', text, re.M)
    assert [p for p, _ in pos] == ["0", "1", "2"]
    assert sum(float(v) for _, v in pos) == values["num_accepted_tokens"]
    s = server.llm.engine.stats()
    assert s.spec_num_accepted_tokens == values["num_accepted_tokens"]
