"""Asynchronous scheduling (``LLM(..., async_scheduling=True)``): step N + 1 scheduled and queued
while step N runs, N's decodes computing its still-unread tokens as provisional tokens.

On a tiny random Llama (loaded by the engine's real loader, CPU), every output must equal the same
engine's without it — greedy and seeded sampling, ``n = 2`` forks, stop tokens and strings (seen
one step late: the extra token is dropped), ``min_tokens``, prefix caching (equal hits), chunked
prefill, preemption by recompute and by swap, the host tier, aborts mid-run — while steps are
actually queued ahead (counted). Requests whose draws read what the host has not seen yet
(penalties, logprobs) keep steps synchronous while they live. Between steps no sequence holds a
provisional token, the manager's invariants hold, and no block leaks.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pagedkv import LLM, LLMEngine, SamplingParams  # noqa: E402
from pagedkv.errors import ConfigArgumentError  # noqa: E402

from tiny_llama import save_tiny_llama  # noqa: E402

BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_async")), max_len=256)


def _llm(model_dir, async_scheduling: bool, **kw) -> LLM:
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("num_blocks", 256)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("device", "cpu")
    return LLM(model_dir, progress=False, async_scheduling=async_scheduling, **kw)


def _prompts(seed: int, lengths):
    g = np.random.default_rng(seed)
    return [g.integers(3, 128, n).tolist() for n in lengths]


def _out(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outs]


def _both(model_dir, prompts, params, **kw):
    sync = _llm(model_dir, False, **kw)
    ahead = _llm(model_dir, True, **kw)
    a = sync.generate(prompts, params, use_tqdm=False)
    b = ahead.generate(prompts, params, use_tqdm=False)
    for llm in (sync, ahead):
        _check_quiet(llm)
    return sync, ahead, a, b


def _check_quiet(llm: LLM) -> None:
    """After a run: invariants hold, no sequence is left, every block is free (cached or not)."""
    m = llm.llm_engine.manager
    m.check_invariants()
    assert m.num_seqs == 0
    assert m.num_free_blocks == m.num_blocks


def _steps_ahead(llm: LLM) -> int:
    return llm.llm_engine.core.num_async_steps


def test_greedy_identical_and_steps_queued_ahead(model_dir):
    prompts = _prompts(0, [5, 30, 12, 70, 3, 41])
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (20, 1, 7, 33, 2, 16)]
    sync, ahead, a, b = _both(model_dir, prompts, params, max_num_batched_tokens=16)
    assert _out(a) == _out(b)
    assert [len(o.outputs[0].token_ids) for o in b] == [20, 1, 7, 33, 2, 16]
    assert _steps_ahead(sync) == 0 and _steps_ahead(ahead) > 20
    assert ahead.stats().num_generated_tokens == sync.stats().num_generated_tokens


def test_stop_tokens_and_strings_seen_late_identical(model_dir):
    prompt = _prompts(4, [7])[0]
    ref = _llm(model_dir, False).generate([prompt], SamplingParams(temperature=0.0, max_tokens=32),
                                          use_tqdm=False)[0].outputs[0].token_ids
    g = dict(temperature=0.0, max_tokens=32)
    cases = [
        SamplingParams(stop_token_ids=[ref[12]], **g),
        SamplingParams(stop=[f"w{ref[15]} w{ref[16]}"], **g),
        SamplingParams(stop=[f"w{ref[15]} w{ref[16]}"], include_stop_str_in_output=True, **g),
        SamplingParams(stop_token_ids=[ref[3]], min_tokens=9, **g),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]
    for j, params in enumerate(cases):
        sync, ahead, a, b = _both(model_dir, [prompt, _prompts(5, [9])[0]], params)
        assert _out(a) == _out(b), params
        assert ahead.stats().num_generated_tokens == sync.stats().num_generated_tokens
        if j == 0:
            # Stopped early, on the stop token's first draw, while steps were queued ahead.
            assert len(b[0].outputs[0].token_ids) == ref.index(ref[12]) + 1 < 32
            assert _steps_ahead(ahead) > 0


def test_seeded_sampling_and_forks_identical(model_dir):
    prompts = _prompts(8, [6, 5, 8])
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=24, seed=123),
              SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=5),
              SamplingParams(n=3, temperature=0.0, max_tokens=12)]
    sync, ahead, a, b = _both(model_dir, prompts, params)
    assert _out(a) == _out(b)
    assert a[1].outputs[0].token_ids != a[1].outputs[1].token_ids  # the two samples differ
    assert _steps_ahead(ahead) > 0


def test_prefix_cache_hits_equal(model_dir):
    system = _prompts(1, [24])[0]
    prompts = [system + t for t in _prompts(2, [5, 5, 5])]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    runs = []
    for flag in (False, True):
        llm = _llm(model_dir, flag)
        first = llm.generate(prompts[:1], greedy, use_tqdm=False)
        rest = llm.generate(prompts[1:], greedy, use_tqdm=False)
        # The first request's own output sent again: the blocks its decodes committed are hits.
        again = llm.generate([prompts[0] + first[0].outputs[0].token_ids[:20]], greedy,
                             use_tqdm=False)
        _check_quiet(llm)
        runs.append((llm, first + rest + again))
    (sync, a), (ahead, b) = runs
    assert _out(a) == _out(b)
    assert [o.num_cached_tokens for o in a] == [o.num_cached_tokens for o in b]
    assert b[3].num_cached_tokens >= 40
    assert ahead.stats().prefix_hit_tokens == sync.stats().prefix_hit_tokens
    assert _steps_ahead(ahead) > 0


@pytest.mark.parametrize("reclaim", [
    dict(preemption_mode="recompute"),
    dict(preemption_mode="swap", num_host_blocks=64),
], ids=["recompute", "swap"])
def test_preemption_identical(model_dir, reclaim):
    # 24 blocks of 4 tokens for 4 sequences growing to ~24 + 24 tokens each: preemption, and
    # steps that cannot be queued ahead (no room, or sequences swapped out).
    prompts = _prompts(6, [20, 24, 28, 16])
    params = SamplingParams(temperature=0.0, max_tokens=24)
    sync, ahead, a, b = _both(model_dir, prompts, params, num_blocks=24, watermark_blocks=1,
                              max_num_batched_tokens=16, **reclaim)
    assert _out(a) == _out(b)
    st = ahead.stats()
    assert st.num_preemptions > 0 and _steps_ahead(ahead) > 0
    if reclaim["preemption_mode"] == "swap":
        assert st.num_preemptions_swap > 0


def test_host_tier_identical(model_dir):
    # A device pool too small to keep the shared prefixes: the host tier serves them again.
    prompts = [p + t for p in _prompts(11, [16, 16]) for t in _prompts(12, [3, 6])]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    runs = []
    for flag in (False, True):
        llm = _llm(model_dir, flag, num_blocks=40, host_cache_memory="1MiB")
        outs = []
        for p in prompts + prompts:
            outs += llm.generate([p], params, use_tqdm=False)
        _check_quiet(llm)
        runs.append((llm, outs))
    (sync, a), (ahead, b) = runs
    assert _out(a) == _out(b)
    assert ahead.stats().prefix_hits_by_tier == sync.stats().prefix_hits_by_tier
    assert _steps_ahead(ahead) > 0


def test_penalties_and_logprobs_keep_steps_synchronous(model_dir):
    prompts = _prompts(13, [6, 9])
    for params in (SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3),
                   SamplingParams(temperature=0.0, max_tokens=16, logprobs=2),
                   SamplingParams(temperature=0.0, max_tokens=16, prompt_logprobs=1)):
        sync, ahead, a, b = _both(model_dir, prompts, params)
        assert [[c.token_ids for c in o.outputs] for o in a] == \
            [[c.token_ids for c in o.outputs] for o in b]
        assert _steps_ahead(ahead) == 0, params
    # Beside such a request, steps are queued ahead again once it finished.
    short = SamplingParams(temperature=0.0, max_tokens=3, logprobs=1)
    long = SamplingParams(temperature=0.0, max_tokens=30)
    sync, ahead, a, b = _both(model_dir, prompts, [short, long])
    assert _out(a) == _out(b) and _steps_ahead(ahead) > 10
    assert [lp.keys() for lp in a[0].outputs[0].logprobs] == \
        [lp.keys() for lp in b[0].outputs[0].logprobs]


def test_engine_steps_hold_no_provisional_tokens_and_aborts_mid_flight(model_dir):
    results = {}
    for flag in (False, True):
        eng = LLMEngine(model_dir, device="cpu", block_size=BLOCK, num_blocks=128,
                        async_scheduling=flag)
        assert eng.manager.max_provisional == (1 if flag else 0)
        for i, p in enumerate(_prompts(9, [5, 7, 11])):
            eng.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=20))
        done, steps = {}, 0
        while eng.get_num_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
            steps += 1
            if steps == 6:
                eng.abort_request("1")  # its next step is already queued when async
            for seq in eng.core.scheduler.running:
                assert eng.manager.num_provisional(seq.seq_id) == 0
            eng.manager.check_invariants()
        assert eng.manager.num_seqs == 0 and eng.manager.num_free_blocks == eng.manager.num_blocks
        results[flag] = {k: o.outputs[0].token_ids for k, o in done.items()}
        if flag:
            assert eng.core.num_async_steps > 0
    assert results[False].keys() == results[True].keys() == {"0", "2"}
    assert results[False] == results[True]


def test_bad_async_config_raises(model_dir):
    with pytest.raises(ConfigArgumentError, match="speculative_config"):
        _llm(model_dir, True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ConfigArgumentError, match="tensor_parallel_size"):
        _llm(model_dir, True, tensor_parallel_size=2)
    with pytest.raises(ConfigArgumentError, match="async_scheduling"):
        _llm(model_dir, "yes")


def test_schedule_ahead_without_room_changes_nothing():
    """The scheduler's half: a step scheduled ahead takes provisional tokens for its decodes or,
    when the pool cannot hold them, returns None and leaves every sequence and block as it was."""
    from pagedkv import BlockManager, StepBuffers
    from pagedkv.scheduler import Scheduler, Sequence

    m = BlockManager(num_blocks=4, block_size=2, max_blocks_per_seq=4, watermark_blocks=0,
                     max_provisional=1)
    m.attach_buffers(StepBuffers(4, 32, 4, max_copies=4, device="cpu"))
    sched = Scheduler(m, max_num_seqs=4, max_num_batched_tokens=16)
    a, b = Sequence(0, [1, 2, 3]), Sequence(1, [4, 5, 6])
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert [s.seq_id for s in first.seqs] == [0, 1] and first.num_new_tokens == [3, 3]
    sched.advance(first)
    # Each holds 2 blocks (3 tokens); one more token each fits (the 4th slot of their blocks).
    nxt = sched.schedule_ahead({0: 0, 1: 1})
    assert nxt is not None and nxt.ahead == {0: 0, 1: 1} and nxt.num_new_tokens == [1, 1]
    assert [m.num_provisional(i) for i in (0, 1)] == [1, 1]
    assert nxt.input_ids().tolist() == [0, 0] and nxt.sample_mask() == [True, True]
    m.commit_batch([0, 1], [1, 1], [7, 8])
    sched.postprocess(first, [7, 8])
    assert a.token_ids == [1, 2, 3, 7] and b.token_ids == [4, 5, 6, 8]
    sched.advance(nxt)
    # Now both need a third block, and the pool has none left: nothing changes.
    before = (m.num_free_blocks, [m.seq_len(i) for i in (0, 1)])
    assert sched.schedule_ahead({0: 0, 1: 1}) is None
    assert (m.num_free_blocks, [m.seq_len(i) for i in (0, 1)]) == before
    assert [m.num_provisional(i) for i in (0, 1)] == [0, 0]
    m.check_invariants()


@pytest.mark.gpu
def test_gpu_async_scheduling_identical_with_graphs(model_dir):
    """On CUDA with decode graphs: each step queued ahead reads its tokens from the previous
    step's sampled tokens on the device (never from the host); outputs equal the synchronous
    engine's for greedy, seeded and stopped requests with ragged prompts and chunked prefill."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prompts = _prompts(21, [5, 40, 12, 90, 3, 27, 60, 8])
    ref = _llm(model_dir, False, device="cuda").generate(
        prompts[:1], SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)
    stop = ref[0].outputs[0].token_ids[10]
    params = [SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop]),
              SamplingParams(temperature=0.9, top_p=0.8, max_tokens=25, seed=7),
              SamplingParams(n=2, temperature=1.0, max_tokens=20, seed=3)] + \
        [SamplingParams(temperature=0.0, max_tokens=m) for m in (1, 33, 17, 40, 9)]
    outs = {}
    for flag in (False, True):
        llm = _llm(model_dir, flag, device="cuda", max_num_batched_tokens=32)
        assert llm.llm_engine.core.runner.graph_sizes
        outs[flag] = llm.generate(prompts, params, use_tqdm=False)
        _check_quiet(llm)
        if flag:
            assert _steps_ahead(llm) > 20
    assert _out(outs[False]) == _out(outs[True])


@pytest.mark.parametrize("kind", ["gemma3_text", "llama4_text", "mistral"])
def test_kv_cache_groups_identical(kind, tmp_path):
    """Hybrid (sliding + full, chunked + full) and all-sliding models: a step queued ahead holds
    its provisional token in every group, and the windowed groups release by the committed
    length; outputs equal the synchronous engine's and transformers' greedy search."""
    transformers = pytest.importorskip("transformers")
    from tiny_hybrid import VOCAB, greedy_reference, save_hybrid

    path = save_hybrid(kind, str(tmp_path))
    g = np.random.default_rng(17)
    prompts = [g.integers(0, VOCAB, n).tolist() for n in (30, 9, 21)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for flag in (False, True):
        llm = LLM(path, device="cpu", progress=False, block_size=BLOCK, num_blocks=128,
                  max_num_seqs=4, max_num_batched_tokens=16, async_scheduling=flag)
        outs[flag] = [o.outputs[0].token_ids for o in
                      llm.generate(prompts, params, use_tqdm=False)]
        _check_quiet(llm)
        if flag:
            assert _steps_ahead(llm) > 10
            assert (llm.llm_engine.manager.num_groups > 1) == (kind != "mistral")
    dense = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert outs[True] == outs[False] == [greedy_reference(dense, p, 16) for p in prompts]


def test_decodes_outside_the_step_ahead_are_not_starved(model_dir):
    """Sequences whose next token is already known when a step is queued ahead (the samples a
    prompt forks on its first draw, and the prompt itself) decode in that step too: they do not
    wait for the chain of steps queued ahead to break (here: the long request to end)."""
    prompts = _prompts(23, [6, 9])
    params = [SamplingParams(n=3, temperature=0.0, max_tokens=12),
              SamplingParams(temperature=0.0, max_tokens=80)]
    steps = {}
    for flag in (False, True):
        eng = LLMEngine(model_dir, device="cpu", block_size=BLOCK, num_blocks=256,
                        async_scheduling=flag)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(str(i), p, sp)
        n, done_at = 0, None
        while eng.get_num_unfinished_requests():
            n += 1
            if any(o.finished and o.request_id == "0" for o in eng.step()):
                done_at = n
        steps[flag] = done_at
        eng.manager.check_invariants()
        assert eng.manager.num_seqs == 0
    # The forked request ends within a few steps of where it ends synchronously, long before
    # the 80-token request (a step ahead adds at most one step of latency to each token).
    assert steps[True] <= steps[False] + 3 < 40


def test_schedule_ahead_drops_its_provisional_tokens_when_known_decodes_do_not_fit():
    """A step scheduled ahead takes the pending decodes' provisional tokens first, then appends
    the decodes whose token is known; when those do not fit, the provisional tokens are dropped
    again and nothing has changed."""
    from pagedkv import BlockManager, StepBuffers
    from pagedkv.scheduler import Scheduler, Sequence

    m = BlockManager(num_blocks=4, block_size=2, max_blocks_per_seq=4, watermark_blocks=0,
                     max_provisional=1)
    m.attach_buffers(StepBuffers(4, 32, 4, max_copies=4, device="cpu"))
    sched = Scheduler(m, max_num_seqs=4, max_num_batched_tokens=16)
    a, b = Sequence(0, [1, 2, 3]), Sequence(1, [4, 5, 6, 7])
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    sched.postprocess(first, [8, 9])  # both now decode-ready; all 4 blocks in use
    assert m.num_free_blocks == 0
    before = ([m.seq_len(i) for i in (0, 1)], [s.num_computed_tokens for s in (a, b)])
    # Sequence 0 as if its token were pending (its 4th slot is free); sequence 1's next token
    # needs a fifth block.
    assert sched.schedule_ahead({0: 0}) is None
    assert [m.num_provisional(i) for i in (0, 1)] == [0, 0]
    assert ([m.seq_len(i) for i in (0, 1)], [s.num_computed_tokens for s in (a, b)]) == before
    assert m.num_free_blocks == 0
    m.check_invariants()
