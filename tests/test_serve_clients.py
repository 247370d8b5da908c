"""``pagedkv serve`` as real clients use it: tolerant of fields it does not use, strict about the
ones that would change the answer, OpenAI-shaped errors on every route, vLLM's extra routes, and
``usage.prompt_tokens_details.cached_tokens``.

Real uvicorn on loopback (the ``Server`` of ``tests/test_serve.py``) and the real ``openai`` client.
"""

from __future__ import annotations

import logging

import pytest

from serve_server import (  # noqa: F401  (fixtures; skips without the serve extras)
    CHAT, NAME, Server, client, httpx, model_dir, openai, server,
)

import pagedkv


ERROR_KEYS = {"message", "type", "param", "code"}


# ------------------------------------------------------------------------ tolerant / strict

def test_unused_fields_are_accepted_and_logged_once(server, client, caplog):
    caplog.set_level(logging.WARNING, logger="pagedkv.serve")
    extra = {"store": True, "metadata": {"k": "v"}, "parallel_tool_calls": False,
             "service_tier": "auto", "reasoning_effort": "low", "user": "u1",
             "tool_choice": "auto"}
    for _ in range(2):
        r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2, **extra,
                                           extra_body={"some_future_field": {"x": 1}})
        assert r.choices[0].finish_reason == "length"
        c = client.completions.create(model=NAME, prompt="w3", max_tokens=2, user="u1",
                                      extra_body={"some_future_field": 1})
        assert c.choices[0].finish_reason == "length"
    logged = [rec.getMessage() for rec in caplog.records if "not used" in rec.getMessage()]
    text = "\n".join(logged)
    for name in ("store", "metadata", "service_tier", "some_future_field"):
        assert text.count(repr(name)) == 1, text  # once, whatever the number of requests


def test_continuous_usage_stats(client):
    # GuideLLM's default: usage (so far) in every chunk.
    chunks = list(client.completions.create(
        model=NAME, prompt="w3 w4", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    done = [c.usage.completion_tokens for c in with_choices]
    assert done == sorted(done) and done[-1] == 5
    assert all(c.usage.prompt_tokens == 2 for c in with_choices)
    assert chunks[-1].usage.total_tokens == 7
    # Without it, usage only in the last chunk.
    chunks = list(client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=3, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens == 3


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("response_format", {"type": "json_object"}),
    ("logit_bias", {"3": 5.0}),
    ("functions", [{"name": "f"}]),
    ("guided_regex", "w[0-9]+"),
])
def test_fields_that_change_the_output_are_400(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2,
                                       extra_body={field: value})
    body = info.value.body
    assert set(body) == ERROR_KEYS and body["param"] == field, body
    assert body["code"] == "unsupported_parameter"


def test_echo_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="w3", max_tokens=2, echo=True)
    assert info.value.body["param"] == "echo"


# ------------------------------------------------------------------------------ routes

def test_unknown_routes_and_methods_are_openai_shaped(server):
    r = httpx.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == ERROR_KEYS, r.text
    assert r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{server.url}/v1/completions")
    assert r.status_code == 405 and set(r.json()["error"]) == ERROR_KEYS, r.text
    r = httpx.delete(f"{server.url}/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    for body in (b"{not json", b"[1, 2]", b'{"prompt": 3}'):
        r = httpx.post(f"{server.url}/v1/completions", content=body,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and set(r.json()["error"]) == ERROR_KEYS, r.text
    with pytest.raises(openai.NotFoundError) as info:
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0).models \
            .retrieve("other-model")
    assert info.value.body["code"] == "model_not_found"


def test_model_version_tokenize_detokenize(server, client):
    m = client.models.retrieve(NAME)
    assert m.id == NAME and m.object == "model"
    assert httpx.get(f"{server.url}/version").json() == {"version": pagedkv.__version__}

    r = httpx.post(f"{server.url}/tokenize", json={"model": NAME, "prompt": "w3 w4 w127"}).json()
    assert r["tokens"] == [3, 4, 127] and r["count"] == 3 and r["max_model_len"] == 256
    assert r["token_strs"] is None
    r = httpx.post(f"{server.url}/tokenize",
                   json={"prompt": "w3 w4", "return_token_strs": True}).json()
    assert r["token_strs"] == ["w3", "w4"]
    # A chat's tokens are those the chat route generates from.
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()
    used = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1)
    assert chat["count"] == used.usage.prompt_tokens
    assert chat["tokens"][0] == 1 and chat["tokens"][-1] == 2  # the template's turn markers

    r = httpx.post(f"{server.url}/detokenize", json={"model": NAME, "tokens": [3, 4, 127]})
    assert r.json() == {"prompt": "w3 w4 w127"}
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [3, 128]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "w3", "messages": CHAT})
    assert r.status_code == 400 and set(r.json()["error"]) == ERROR_KEYS
    r = httpx.post(f"{server.url}/tokenize", json={"model": "other", "prompt": "w3"})
    assert r.status_code == 404


# -------------------------------------------------------------------------- cached tokens

def test_cached_tokens_in_usage_and_metrics(server, client):
    metrics = server.llm.observers[-1]
    before = metrics.snapshot()["cached_prompt_tokens"]
    prompt = "w40 w41 w42 w43 w44 w45 w46 w47 w48 w49 w50 w51 w52"  # 13 tokens: 3 full blocks
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 12
    streamed = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=2,
                                              stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == 12
    # Chat, streaming and not.
    conv = [{"role": "user", "content": "w60 w61 w62 w63 w64 w65 w66 w67 w68"}]
    c1 = client.chat.completions.create(model=NAME, messages=conv, max_tokens=2)
    assert c1.usage.prompt_tokens_details.cached_tokens == 0
    c2 = client.chat.completions.create(model=NAME, messages=conv, max_tokens=2)
    hit = c2.usage.prompt_tokens_details.cached_tokens
    assert hit > 0 and hit % 4 == 0 and hit < c2.usage.prompt_tokens
    c3 = list(client.chat.completions.create(model=NAME, messages=conv, max_tokens=2,
                                             stream=True,
                                             stream_options={"include_usage": True}))
    assert c3[-1].usage.prompt_tokens_details.cached_tokens == hit
    # The request metrics count each request's hit tokens.
    server.wait_idle()
    snap = metrics.snapshot()
    assert snap["cached_prompt_tokens"] - before == 12 + 12 + 2 * hit
    text = httpx.get(f"{server.url}/metrics").text
    assert "pagedkv_cached_prompt_tokens_total" in text
    assert "pagedkv_request_cached_prompt_tokens_bucket" in text
