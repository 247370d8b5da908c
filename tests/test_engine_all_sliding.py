"""The engine on models whose every layer slides: one windowed KV cache group (group 0 included).

Tiny random fp32 models (seeded): a ``MistralConfig`` with ``sliding_window`` on every layer, and a
``Qwen2Config`` with ``use_sliding_window`` and ``max_window_layers = 0`` (every layer slides).
Windows of 8 tokens, blocks of 4, prompts several windows long, prefix caching on. Greedy token
ids must equal transformers' own ``generate`` (whose cache honours the window). The manager runs
them as one sliding group: while a sequence decodes it holds at most ``window / B + 1`` blocks
(the rest released, ``-1`` in its table); a request sharing a finished one's prompt hits the
cache up to its last full block though it reads only the window ending there (its table starts
with released entries), and the manager's invariants hold throughout.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pagedkv import LLM, KVCacheGroup, SamplingParams  # noqa: E402

from tiny_hybrid import COMMON, VOCAB, WINDOW, greedy_reference  # noqa: E402

BLOCK = 4
#: Blocks a decoding sequence holds at most: the window's, plus the block it starts in.
BOUND = WINDOW // BLOCK + 1


def _config(kind: str):
    if kind == "mistral":
        return transformers.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **COMMON)
    return transformers.Qwen2Config(num_hidden_layers=2, use_sliding_window=True,
                                    sliding_window=WINDOW, max_window_layers=0, **COMMON)


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def model(request, tmp_path_factory):
    torch.manual_seed(4321)
    m = transformers.AutoModelForCausalLM.from_config(_config(request.param))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    path = str(tmp_path_factory.mktemp(request.param))
    m.save_pretrained(path)
    dense = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, dense


def _llm(path: str, **kw) -> LLM:
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("num_blocks", 64)
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 16)
    return LLM(path, device="cpu", progress=False, enable_prefix_caching=True, **kw)


def _prompts(seed, lengths):
    g = np.random.default_rng(seed)
    return [g.integers(0, VOCAB, n).tolist() for n in lengths]


def _held(table) -> int:
    return sum(b >= 0 for b in table)


def test_every_layer_sliding_runs_as_one_sliding_group(model):
    kind, path, dense = model
    llm = _llm(path)
    engine = llm.llm_engine
    manager = engine.manager
    assert engine.core.runner.kv_groups == (KVCacheGroup.sliding(WINDOW),), kind
    assert manager.groups == (KVCacheGroup.sliding(WINDOW),)
    prompts = _prompts(0, [41, 5, 57, 23])
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs = {}
    decoding_checked = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        for seq in engine.core.scheduler.running:
            table = manager.block_table(seq.seq_id, 0)
            assert len(table) == -(-manager.seq_len(seq.seq_id) // BLOCK)
            if seq.num_computed_tokens > seq.num_prompt_tokens:
                # Past its first decode step: the window's blocks only, the released ones -1
                # at the front (a prefill chunk's step holds the chunk's blocks besides).
                assert _held(table) <= BOUND, (kind, table)
                decoding_checked += 1
        manager.check_invariants()
    assert decoding_checked > 0
    for i, p in enumerate(prompts):
        assert outs[str(i)] == greedy_reference(dense, p, 20), (kind, len(p))
    manager.check_invariants()
    assert manager.num_seqs == 0


def test_prefix_hit_reads_only_the_window(model):
    """A finished request's prompt, sent again with another ending: the hit reaches the prompt's
    last full block, but the new sequence's table holds only the window ending there."""
    kind, path, dense = model
    llm = _llm(path)
    engine, manager = llm.llm_engine, llm.llm_engine.manager
    shared = _prompts(2, [40])[0]
    first, second = shared + [5, 6, 7], shared + [9, 10]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    a = llm.generate([first], params, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == greedy_reference(dense, first, 12)
    engine.add_request("b", second, params)
    engine.step()
    seq = engine.core.scheduler.running[0]
    table = manager.block_table(seq.seq_id, 0)
    # Boundary 10 blocks (40 tokens): the window ending there starts at position 33, in block 8.
    assert seq.num_cached_tokens == 40
    assert table[:8] == [-1] * 8 and min(table[8:]) >= 0, table
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
        manager.check_invariants()
    assert outs[0].outputs[0].token_ids == greedy_reference(dense, second, 12)
    manager.check_invariants()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_past_the_window_matches_generate(model, mode):
    """A sequence preempted while its table starts with released entries: swapped out and back
    (only its window's blocks travel, the released entries stay -1) or recomputed (re-admitted
    with the window's prefix hit), it goes on with transformers' tokens."""
    kind, path, dense = model
    kw = dict(preemption_mode=mode)
    if mode == "swap":
        kw["num_host_blocks"] = 32
    llm = _llm(path, **kw)
    engine, manager = llm.llm_engine, llm.llm_engine.manager
    sched = engine.core.scheduler
    prompts = _prompts(5, [33, 26])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs, victim = {}, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        if victim is None:
            past = [s for s in sched.running
                    if s.num_computed_tokens > s.num_prompt_tokens + WINDOW]
            if past:
                victim = past[0]
                table = manager.block_table(victim.seq_id, 0)
                assert table[0] == -1 and _held(table) <= BOUND
                assert sched.preempt(victim) == mode
        manager.check_invariants()
    assert victim is not None
    st = llm.stats()
    assert sched.num_preemptions == 1 and sched.num_preemptions_by_mode[mode] == 1
    if mode == "swap":
        assert 0 < st.swapped_out_blocks <= BOUND
        assert st.swapped_in_blocks == st.swapped_out_blocks
        assert manager.num_free_host_blocks == 32
    for i, p in enumerate(prompts):
        assert outs[str(i)] == greedy_reference(dense, p, 24), (kind, mode, len(p))
    assert manager.num_seqs == 0
