"""Asynchronous scheduling behind ``AsyncLLM`` and ``pagedkv serve --async-scheduling``.

The flag reaches the engine config; a real uvicorn server over an ``AsyncLLM`` with
``async_scheduling`` answers the real ``openai`` client — concurrent requests, streaming or not,
some stopped by a stop string or a disconnect — with exactly the text of the synchronous engine,
and leaves no block in use.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from serve_server import ENGINE, NAME, Server, openai  # noqa: F401  (skips without serve extras)

import pagedkv  # noqa: E402
from pagedkv import SamplingParams  # noqa: E402
from pagedkv.cli import main  # noqa: E402

from tiny_llama import save_tiny_llama  # noqa: E402

PROMPTS = [" ".join(f"w{t}" for t in p) for p in
           ([93, 120, 113, 66, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41], [77] * 12)]


def test_serve_flag_parses_to_the_engine_config(monkeypatch):
    pytest.importorskip("fastapi")
    import pagedkv.serve.app as app

    calls: list = []
    monkeypatch.setattr(app, "serve", lambda model, **kw: calls.append(kw))
    assert main(["serve", "m", "--async-scheduling"]) == 0
    assert calls[0]["engine_config"].async_scheduling is True
    assert main(["serve", "m"]) == 0
    assert calls[1]["engine_config"].async_scheduling is False


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_async_serve")))


def test_concurrent_completions_equal_the_synchronous_engine(model_dir):
    plain = pagedkv.LLM(model_dir, progress=False, **ENGINE)
    want = [o.outputs[0].text for o in plain.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)]
    stop = want[1].split()[6]  # a word the second answer reaches mid-way
    want_stopped = plain.generate(PROMPTS[1:2], SamplingParams(
        temperature=0.0, max_tokens=24, stop=[stop]), use_tqdm=False)[0].outputs[0].text
    server = Server(model_dir, async_scheduling=True)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                               timeout=60)

        def complete(i: int) -> str:
            if i % 2:
                stream = client.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=24,
                                                   temperature=0.0, stream=True)
                return "".join(c.choices[0].text for c in stream)
            return client.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=24,
                                             temperature=0.0).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(complete, range(len(PROMPTS))))
        assert got == want
        stopped = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=24,
                                            temperature=0.0, stop=[stop])
        assert stopped.choices[0].text == want_stopped
        assert stopped.choices[0].finish_reason == "stop"
        # A streaming client that goes away after its first chunk: the request is aborted
        # while its next step is already queued; nothing is left behind.
        stream = client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=200,
                                           temperature=0.0, stream=True)
        next(iter(stream))
        stream.close()
        server.wait_idle()
        engine = server.llm.engine
        assert engine.core.num_async_steps > 0
        engine.manager.check_invariants()
    finally:
        server.stop()
