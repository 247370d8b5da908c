"""``AsyncLLM``: concurrent asyncio streams over one engine stepped by one thread.

A tiny random Llama (``tests/tiny_llama.py``) through the real loader. Streams end with what
``LLM.generate`` gives for the same greedy parameters; cancelling a consumer, closing its generator
or calling ``abort`` frees the request's blocks by the time the call returns; bad input, a full
queue and a stopped engine are typed errors; the observers see every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pagedkv  # noqa: E402
from pagedkv import AsyncLLM, SamplingParams  # noqa: E402
from pagedkv.errors import (EngineDeadError, EngineOverloadedError,  # noqa: E402
                            InvalidArgumentError)

from tiny_llama import save_tiny_llama  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny")))


def _engine_args():
    return dict(device="cpu", num_blocks=96, block_size=4, max_num_seqs=8,
                max_num_batched_tokens=64)


class Recorder:
    def __init__(self):
        self.first, self.tokens, self.finished = [], [], []

    def on_first_token(self, ttft_s, num_prompt_tokens):
        self.first.append((ttft_s, num_prompt_tokens))

    def on_tokens(self, num_new_tokens, since_last_s):
        self.tokens.append((num_new_tokens, since_last_s))

    def on_finished(self, e2e_s, finish_reason):
        self.finished.append((e2e_s, finish_reason))


@pytest.fixture(scope="module")
def llm(model_dir):
    rec = Recorder()
    a = AsyncLLM(model_dir, observers=[rec], **_engine_args())
    a.recorder = rec
    yield a
    a.shutdown()


def used_blocks(a: AsyncLLM) -> int:
    # The manager's reads are safe from any thread.
    return a.engine.manager.stats().used_blocks


async def _collect(a, prompt, params, request_id=None):
    outs = []
    async for out in a.generate(prompt, params, request_id=request_id):
        outs.append(out)
    return outs


def test_streams_match_offline_generate(llm, model_dir):
    prompts = ["w3 w4 w5", [7, 8, 9, 10, 11], "w20 w21"]

    async def main():
        return await asyncio.gather(*(_collect(llm, p, GREEDY) for p in prompts))

    streams = asyncio.run(main())
    offline = pagedkv.LLM(model_dir, progress=False, **_engine_args()).generate(
        prompts, GREEDY, use_tqdm=False)
    for outs, ref in zip(streams, offline):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert len(outs) >= 2  # streamed, not one final output
        assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        assert outs[-1].outputs[0].text == ref.outputs[0].text
    assert used_blocks(llm) == 0


def test_cancel_frees_blocks_at_once(llm):
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in llm.generate("w5 w6 w7 w8 w9", LONG, request_id="cancel-me"):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 30)
        assert used_blocks(llm) > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # No waiting: the abort was applied before the cancellation completed.
        assert used_blocks(llm) == 0
        assert llm.num_unfinished == 0

        # Leaving the loop under aclosing aborts likewise.
        async with contextlib.aclosing(llm.generate([3, 4, 5, 6], LONG)) as gen:
            async for out in gen:
                if len(out.outputs[0].token_ids) >= 2:
                    break
        assert used_blocks(llm) == 0

        # abort() from elsewhere ends the stream with CancelledError.
        gen2 = llm.generate([9, 9, 9], LONG, request_id="aborted")
        first = await gen2.__anext__()
        assert not first.finished
        assert await llm.abort("aborted") is True
        assert used_blocks(llm) == 0
        with pytest.raises(asyncio.CancelledError):
            await gen2.__anext__()
        assert await llm.abort("aborted") is False

    asyncio.run(asyncio.wait_for(main(), 60))
    assert any(reason == "abort" for _, reason in llm.recorder.finished)


def test_many_concurrent_streams_and_observers(llm):
    rec = llm.recorder
    before = len(rec.finished)
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=3)

    async def main():
        return await asyncio.gather(*(_collect(llm, [i + 3, i + 4], params) for i in range(12)))

    streams = asyncio.run(asyncio.wait_for(main(), 60))
    assert all(len(s[-1].outputs[0].token_ids) == 5 for s in streams)
    assert len(rec.finished) - before == 12
    assert all(reason == "length" for _, reason in rec.finished[before:])
    assert all(t >= 0 for t, _ in rec.first)
    assert sum(n for n, _ in rec.tokens) >= 12 * 5
    assert used_blocks(llm) == 0


def test_errors_are_typed(llm, model_dir):
    async def main():
        with pytest.raises(InvalidArgumentError):
            await _collect(llm, "", GREEDY)
        with pytest.raises(InvalidArgumentError):
            await _collect(llm, [1, 2], GREEDY, request_id="")
        with pytest.raises(InvalidArgumentError, match="already in use"):
            gen = llm.generate([1, 2], LONG, request_id="dup")
            await gen.__anext__()
            try:
                await _collect(llm, [1, 2], GREEDY, request_id="dup")
            finally:
                await gen.aclose()
        assert used_blocks(llm) == 0
        # The engine still serves afterwards.
        assert (await _collect(llm, [4, 5], GREEDY))[-1].finished

    asyncio.run(asyncio.wait_for(main(), 60))


def test_queue_limit_and_shutdown(model_dir):
    a = AsyncLLM(model_dir, max_queue_size=2, **_engine_args())
    try:
        async def main():
            gens = [a.generate([5, 6, 7], LONG) for _ in range(2)]
            # Each generator is queued when it is first iterated.
            firsts = [asyncio.create_task(g.__anext__()) for g in gens]
            await asyncio.sleep(0)
            assert a.num_waiting == 2
            with pytest.raises(EngineOverloadedError) as info:
                await _collect(a, [1, 2], GREEDY)
            assert (info.value.waiting, info.value.max_queue_size) == (2, 2)
            await asyncio.gather(*firsts)
            assert a.num_waiting == 0
            # Both now run: a third request is accepted.
            assert (await _collect(a, [1, 2], GREEDY))[-1].finished
            await asyncio.get_running_loop().run_in_executor(None, a.shutdown)
            for g in gens:
                with pytest.raises(EngineDeadError):
                    while True:
                        await g.__anext__()
            with pytest.raises(EngineDeadError):
                await _collect(a, [1, 2], GREEDY)
            assert a.errored

        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        a.shutdown()
    with pytest.raises(InvalidArgumentError):
        AsyncLLM.from_engine(a.engine, max_queue_size=0)


def test_call_runs_on_engine_thread(llm):
    async def main():
        started = time.perf_counter()
        stats = await llm.call(lambda e: e.stats())
        assert stats.num_blocks == 96
        with pytest.raises(ZeroDivisionError):
            await llm.call(lambda e: 1 // 0)
        return time.perf_counter() - started

    assert asyncio.run(main()) < 30


def test_two_engines_in_two_threads(llm, model_dir):
    # The engine thread steps while this thread runs another engine: each forward must see its
    # own step's attention metadata, never the other's.
    offline = pagedkv.LLM(model_dir, progress=False, **_engine_args())
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in offline.generate(prompts, params, use_tqdm=False)]

    async def main():
        streams = [asyncio.create_task(_collect(llm, p, params)) for p in prompts]
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        side = [await loop.run_in_executor(None, lambda: offline.generate(
            prompts, params, use_tqdm=False)) for _ in range(3)]
        return await asyncio.gather(*streams), side

    streams, side = asyncio.run(asyncio.wait_for(main(), 120))
    assert [s[-1].outputs[0].token_ids for s in streams] == ref
    for outs in side:
        assert [o.outputs[0].token_ids for o in outs] == ref


def test_loaded_model_in_memory(llm, model_dir):
    # A model built in memory (no checkpoint on disk, e.g. random weights for a benchmark) is
    # served as it is: same tokens and text as the engine that loaded the directory.
    from pagedkv.engine.loader import load_model

    loaded = load_model(model_dir, device="cpu")
    a = AsyncLLM(loaded, **{k: v for k, v in _engine_args().items() if k != "device"})
    try:
        assert a.engine.loaded is loaded
        prompt = [5, 6, 7, 8]
        mine = asyncio.run(_collect(a, prompt, GREEDY))[-1].outputs[0]
        ref = asyncio.run(_collect(llm, prompt, GREEDY))[-1].outputs[0]
        assert mine.token_ids == ref.token_ids and mine.text == ref.text
        assert used_blocks(a) == 0
    finally:
        a.shutdown()
