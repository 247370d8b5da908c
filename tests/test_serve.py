"""``pagedkv serve``: the real ``openai`` client against a real uvicorn server on loopback.

The server runs in this process (a uvicorn thread on a free 127.0.0.1 port, over a tiny random
Llama from ``tests/tiny_llama.py``), so the tests can read its engine's block counts. Completions
and chat, streaming and not, stop strings, logprobs, ``n > 1`` with a seed; greedy text equals
``LLM.generate`` / ``LLM.chat`` with the same parameters; errors are OpenAI-shaped; ``/metrics``
carries the KV-cache and request signals. A bounded load test (a fixed number of concurrent
streaming requests, some dropped mid-stream, a time limit) ends with every request completed or
refused with 503 and every block back.
"""

from __future__ import annotations

import asyncio

import pytest

from serve_server import (  # noqa: F401  (fixtures; skips without the serve extras)
    CHAT, ENGINE, NAME, Server, client, httpx, model_dir, openai, server,
)

import pagedkv  # noqa: E402
from pagedkv import SamplingParams  # noqa: E402
from pagedkv.serve.bench import BenchConfig, format_report, run_bench  # noqa: E402


@pytest.fixture(scope="module")
def offline(model_dir):
    return pagedkv.LLM(model_dir, progress=False, **ENGINE)


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


# ------------------------------------------------------------------------------ basic routes

def test_models_health_and_loopback(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.server.config.host == "127.0.0.1"


def test_completion_greedy_equals_generate(client, offline):
    prompt = "w3 w4 w5 w6"
    ref = offline.generate([prompt], greedy(8), use_tqdm=False)[0]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 8

    stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert len([c for c in chunks if c.choices]) >= 2  # streamed, not one final chunk
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8

    # Token-id prompts and a batch of prompts: one choice per prompt, in order.
    ids = [[9, 10, 11], [12, 13]]
    refs = offline.generate(ids, greedy(5), use_tqdm=False)
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in refs]


def test_chat_greedy_equals_llm_chat(client, offline):
    ref = offline.chat(CHAT, greedy(6), use_tqdm=False)[0].outputs[0].text
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=6, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref
    stream = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=6,
                                            temperature=0, stream=True)
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings(client, offline):
    prompt = "w3 w4 w5 w6"
    full = offline.generate([prompt], greedy(8), use_tqdm=False)[0].outputs[0].text
    words = full.split()
    stop = words[3]  # the fourth generated word
    ref = offline.generate([prompt], greedy(8, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert ref.finish_reason == "stop" and stop not in ref.text
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.text
    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=8, temperature=0,
                                          stop=[stop], stream=True)
    chat_ref = offline.chat(CHAT, greedy(8, stop=[stop]), use_tqdm=False)[0].outputs[0].text
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == chat_ref


def test_logprobs(client):
    r = client.completions.create(model=NAME, prompt="w3 w4", max_tokens=4, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(" " + t for t in lp.tokens) == r.choices[0].text
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token_lp <= 0 and token in top
        assert token_lp == pytest.approx(max(top.values()))  # greedy: the chosen is the top one
    c = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in content)
    assert "".join(" " + e.token for e in content) == c.choices[0].message.content
    streamed = client.completions.create(model=NAME, prompt="w3 w4", max_tokens=4,
                                         temperature=0, logprobs=2, stream=True)
    tokens = [t for ch in streamed if ch.choices and ch.choices[0].logprobs
              for t in ch.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_n_and_seed(client, offline):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7)
    ref = offline.generate(["w8 w9"], params, use_tqdm=False)[0]
    r = client.completions.create(model=NAME, prompt="w8 w9", max_tokens=6, temperature=1.0,
                                  n=3, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [c.text for c in ref.outputs]
    assert len({c.text for c in r.choices}) > 1  # three different samples
    again = client.completions.create(model=NAME, prompt="w8 w9", max_tokens=6, temperature=1.0,
                                      n=3, seed=7, stream=True)
    texts = ["", "", ""]
    for chunk in again:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == [c.text for c in r.choices]
    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4, n=2, seed=1,
                                          temperature=1.0)
    assert [c.index for c in chat.choices] == [0, 1]


def test_errors_are_openai_shaped(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="w3", max_tokens=4, temperature=-1)
    assert info.value.status_code == 400
    body = info.value.body
    assert set(body) == {"message", "type", "param", "code"}, body
    assert body["param"] == "temperature" and body["type"] == "invalid_request_error"
    # A field the server does not use is accepted (tests/test_serve_clients.py); one that would
    # change the output and is not implemented is a 400 naming it.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="w3",
                                  extra_body={"guided_json": {"type": "object"}})
    assert info.value.body["param"] == "guided_json"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt=" ".join(["w3"] * 400), max_tokens=4)
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=CHAT, logit_bias={"3": 1.0})
    assert info.value.body["param"] == "logit_bias"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="other", prompt="w3")
    assert info.value.body["code"] == "model_not_found"
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert server.used_blocks() == 0


def test_metrics_on_the_same_port(server, client):
    client.completions.create(model=NAME, prompt="w3 w4", max_tokens=3, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("pagedkv_kv_cache_usage_ratio", "pagedkv_num_requests_running",
                 "pagedkv_num_requests_waiting", "pagedkv_time_to_first_token_seconds_bucket",
                 "pagedkv_inter_token_latency_seconds_bucket",
                 "pagedkv_e2e_request_latency_seconds_count", "pagedkv_prompt_tokens_total",
                 "pagedkv_generation_tokens_total", "pagedkv_request_success_total"):
        assert name in text, name
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#") and "_bucket" not in line
              and "finished_reason" not in line}
    assert values["pagedkv_generation_tokens_total"] >= 3
    assert values["pagedkv_time_to_first_token_seconds_count"] >= 1
    assert values["pagedkv_num_free_blocks"] == values["pagedkv_num_blocks"]


# ------------------------------------------------------------------------------------ load

def test_disconnects_free_their_blocks(server):
    before = server.llm.observers[-1].snapshot()["finished"]["abort"]

    async def drop_after(n_chunks: int, chat: bool) -> None:
        route = "chat/completions" if chat else "completions"
        body = {"model": NAME, "max_tokens": 200, "ignore_eos": True, "stream": True}
        body.update({"messages": CHAT} if chat else {"prompt": "w3 w4 w5"})
        async with httpx.AsyncClient(timeout=30) as c:
            async with c.stream("POST", f"{server.url}/v1/{route}", json=body) as resp:
                assert resp.status_code == 200
                seen = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                        if seen >= n_chunks:
                            break  # leaving the block closes the connection mid-stream

    async def drop_before_first_token() -> None:
        async with httpx.AsyncClient(timeout=0.001) as c:
            with pytest.raises(httpx.TimeoutException):
                await c.post(f"{server.url}/v1/completions",
                             json={"model": NAME, "prompt": "w3 w4", "max_tokens": 200,
                                   "ignore_eos": True})

    async def main():
        await asyncio.gather(*(drop_after(2 + i % 3, chat=i % 2 == 1) for i in range(6)),
                             drop_before_first_token())

    asyncio.run(asyncio.wait_for(main(), 60))
    server.wait_idle()
    after = server.llm.observers[-1].snapshot()["finished"]["abort"]
    assert after - before >= 6


def test_bounded_load_all_complete_or_503(model_dir):
    # Two sequences at a time and a queue of two: most of a burst of 24 is refused with 503.
    s = Server(model_dir, max_queue_size=2, max_num_seqs=2)
    try:
        cfg = BenchConfig(url=s.url, num_prompts=24, input_len=6, output_len=16, range_ratio=0.5,
                          ignore_eos=True, seed=1, timeout_s=60)
        burst = asyncio.run(asyncio.wait_for(run_bench(cfg), 90))
        assert burst["completed"] + burst["failed"] == 24
        assert burst["completed"] >= 2 and set(burst["failed_by_status"]) <= {"503"}
        assert burst["failed_by_status"].get("503", 0) >= 1
        s.wait_idle()
    finally:
        s.stop()
    # Without a queue limit every one of 24 concurrent Poisson-arriving streams completes.
    s = Server(model_dir)
    try:
        cfg = BenchConfig(url=s.url, num_prompts=24, request_rate=50.0, input_len=8,
                          output_len=8, dataset="prefix", prefix_len=8, num_prefixes=2,
                          ignore_eos=True, seed=2, timeout_s=60)
        summary = asyncio.run(asyncio.wait_for(run_bench(cfg), 90))
        print("\n" + format_report(summary))
        assert summary["completed"] == 24 and summary["failed"] == 0
        assert summary["total_output_tokens"] == 24 * 8
        assert summary["ttft_ms"]["p99"] is not None and summary["itl_ms"]["p50"] is not None
        s.wait_idle()
        assert s.llm.engine.stats().prefix_hit_tokens > 0
    finally:
        s.stop()
