"""The engine under preemption by swap, by recompute, and without preemption: the same tokens.

A tiny random Llama (fp32, seeded, as in ``test_engine.py``) serves one ragged batch three times:
in a roomy pool (no preemption), in a tight pool with ``preemption_mode="recompute"``, and in the
same tight pool with a host KV pool and ``preemption_mode="swap"``. Greedy outputs must be
token-identical, and so must seeded sampled ones (draws depend only on seed and position); the
forced modes must really have preempted in that mode (engine stats, scheduler and metrics agree),
and swapped blocks must have travelled both ways. ``"auto"`` with given rates picks the cheaper
mode by the cost model. A forked request (``n = 2``) is swapped as a group. The same is run on
CUDA when one is present (gpu-marked: the side-stream copies ordered by events).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("pagedkv._core")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.manager import BlockManager  # noqa: E402

if not hasattr(BlockManager, "swap_out"):
    pytest.skip("the extension predates swap (BlockManager.swap_out)", allow_module_level=True)

VOCAB = 128
BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(4321)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   initializer_range=0.1, eos_token_id=None, bos_token_id=None,
                                   pad_token_id=None)
    path = str(tmp_path_factory.mktemp("swap-llama"))
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _prompts(seed, lengths):
    g = np.random.default_rng(seed)
    return [g.integers(0, VOCAB, n).tolist() for n in lengths]


def _llm(model_dir, device="cpu", **kw):
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    return LLM(model_dir, device=device, progress=False, cuda_graphs=False, **kw)


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], llm.stats()


def _three_ways(model_dir, device, params, prompts):
    roomy, s0 = _run(_llm(model_dir, device, num_blocks=256), prompts, params)
    recompute, s1 = _run(_llm(model_dir, device, num_blocks=16, watermark_blocks=1,
                              preemption_mode="recompute"), prompts, params)
    swap_llm = _llm(model_dir, device, num_blocks=16, watermark_blocks=1, num_host_blocks=64,
                    preemption_mode="swap")
    swapped, s2 = _run(swap_llm, prompts, params)
    assert s0.num_preemptions == 0
    assert s1.num_preemptions > 0 and s1.num_preemptions_recompute == s1.num_preemptions
    assert s1.num_preemptions_swap == 0
    assert s2.num_preemptions_swap > 0
    assert s2.num_preemptions_swap + s2.num_preemptions_recompute == s2.num_preemptions
    assert s2.swapped_out_blocks > 0 and s2.swapped_in_blocks == s2.swapped_out_blocks
    sched = swap_llm.llm_engine.scheduler
    assert sched.num_preemptions_by_mode["swap"] == s2.num_preemptions_swap
    assert roomy == recompute == swapped
    m = swap_llm.llm_engine.manager
    m.check_invariants()
    assert m.num_seqs == 0
    return swap_llm


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_greedy_identical_under_swap_recompute_and_none(model_dir, device):
    prompts = _prompts(6, [10, 9, 11, 8])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    _three_ways(model_dir, device, params, prompts)


def test_sampled_and_forked_identical(model_dir):
    prompts = _prompts(7, [10, 9, 11])
    params = [SamplingParams(temperature=0.9, max_tokens=20, seed=50 + i, ignore_eos=True,
                             n=2 if i == 1 else 1) for i in range(len(prompts))]
    _three_ways(model_dir, "cpu", params, prompts)


def test_auto_follows_the_cost_model(model_dir):
    prompts = _prompts(6, [10, 9, 11, 8])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # A link so fast that swapping is always cheaper, and one so slow that it never is.
    fast = _llm(model_dir, num_blocks=16, watermark_blocks=1, num_host_blocks=64,
                host_link_bytes_per_s=1e15, prefill_tokens_per_s=1.0)
    slow = _llm(model_dir, num_blocks=16, watermark_blocks=1, num_host_blocks=64,
                host_link_bytes_per_s=1.0, prefill_tokens_per_s=1e15)
    a, sa = _run(fast, prompts, params)
    b, sb = _run(slow, prompts, params)
    assert sa.num_preemptions > 0 and sa.num_preemptions_swap == sa.num_preemptions
    assert sb.num_preemptions > 0 and sb.num_preemptions_recompute == sb.num_preemptions
    assert a == b
    mode, swap_s, rec_s = fast.llm_engine.scheduler.last_decision
    assert mode == "swap" and swap_s < rec_s


def test_rates_measured_at_start_up(model_dir):
    llm = _llm(model_dir, num_blocks=32, num_host_blocks=16)
    link, tps, floor = llm.llm_engine.cost_rates
    assert link > 0 and tps > 0 and floor > 0
    cm = llm.llm_engine.manager.cost_model
    assert cm.step_floor_s == floor and cm.max_step_tokens > 0
