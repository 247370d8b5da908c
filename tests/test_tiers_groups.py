"""The host tier of the prefix cache on models whose layers form several KV cache groups.

Tiny random hybrid models (Gemma 3 text and gpt-oss: sliding beside full layers; Llama 4 text:
chunked beside full; fp32, seeded, saved with ``save_pretrained`` and loaded through the engine's
loader) run a trace whose prompts do not fit the device pool together: each prompt is served
alone, twice over, so the second round finds its prefixes only in the host tier (every group's
blocks, keyed by chain hash and group). Greedy token ids must equal a run without the host tier
and transformers' own ``generate``; the host tier must serve hits (``prefix_hits_by_tier``), the
manager keep its invariants, and no host block stay referenced once the engine is idle. A second
trace shares the host pool between the tier and swap preemption. The disk and remote tiers are
still refused for such a model, with a message that says what works.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pagedkv import LLM, LLMEngine, SamplingParams  # noqa: E402
from pagedkv.engine.builder import sequence_blocks  # noqa: E402
from pagedkv.engine.loader import load_model  # noqa: E402
from pagedkv.errors import ConfigArgumentError  # noqa: E402
from pagedkv.layer_groups import group_layers, layer_kinds  # noqa: E402

from tiny_hybrid import (  # noqa: E402
    MAX_LEN, VOCAB, greedy_reference, hybrid_config, save_hybrid)

BLOCK = 4
NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=["gemma3_text", "gpt_oss", "llama4_text"])
def model_dir(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Tuple[str, str]:
    return request.param, save_hybrid(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def dense(model_dir: Tuple[str, str]) -> Any:
    """The same checkpoint loaded by transformers alone: the reference."""
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir[1],
                                                             dtype=torch.float32).eval()


def _reference(dense: Any, prompt: List[int], max_new_tokens: int = NEW) -> List[int]:
    return greedy_reference(dense, prompt, max_new_tokens)


def _prompts(seed: int, lengths: List[int]) -> List[List[int]]:
    g = np.random.default_rng(seed)
    return [g.integers(0, VOCAB, n).tolist() for n in lengths]


#: Six prompts of 10 full blocks and a bit; with a shared head, so a second round can also hit
#: a prefix another prompt left on the device.
PROMPTS = [_prompts(7, [12])[0] + p for p in _prompts(8, [30, 31, 29, 33, 30, 32])]


def _page_bytes(kind: str) -> int:
    grouping = group_layers(layer_kinds(hybrid_config(kind)), MAX_LEN, BLOCK)
    return int(grouping.slots) * 2 * BLOCK * 2 * 16 * 4  # slots x K,V x tokens x heads x dims x 4


def _idle_host_pool(llm: LLM) -> None:
    """Nothing holds a host block once every request finished: each is free or host-cached."""
    m = llm.llm_engine.manager
    m.check_invariants()
    assert m.num_seqs == 0
    assert all(m.host_block_refcount(h) == 0 for h in range(m.num_host_blocks))
    s = m.stats()
    assert m.num_free_host_blocks + s.host_cached_blocks == m.num_host_blocks


def _run(model_dir: Tuple[str, str], rounds: int = 2, **kw: Any) -> Tuple[List[List[int]], Any]:
    """Each prompt alone, ``rounds`` times, in a pool that holds one of them and a little more
    (a chunked group's finished prompt keeps few blocks: a few such prompts fit)."""
    grouping = group_layers(layer_kinds(hybrid_config(model_dir[0])), MAX_LEN, BLOCK)
    peak = sequence_blocks(grouping.groups, max(map(len, PROMPTS)) + NEW, BLOCK, 64)
    llm = LLM(model_dir[1], device="cpu", progress=False, block_size=BLOCK,
              num_blocks=peak + peak // 4, max_num_seqs=2, max_num_batched_tokens=64, **kw)
    try:
        outs = []
        for _ in range(rounds):
            for p in PROMPTS:
                got = llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)
                outs.append(list(got[0].outputs[0].token_ids))
        if "host_cache_memory" in kw:
            _idle_host_pool(llm)
        else:
            llm.llm_engine.manager.check_invariants()
        return outs, llm.stats()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("write_through", [False, True])
def test_host_tier_serves_every_groups_blocks_with_the_same_outputs(
        model_dir: Tuple[str, str], dense: Any, write_through: bool) -> None:
    kind, _ = model_dir
    base, base_stats = _run(model_dir)
    assert base_stats.prefix_hits_by_tier == {"gpu": base_stats.prefix_hit_tokens}
    outs, stats = _run(model_dir, host_cache_memory=256 * _page_bytes(kind),
                       host_cache_write_through=write_through)
    assert outs == base
    assert outs[:len(PROMPTS)] == [_reference(dense, p) for p in PROMPTS]
    hits = stats.prefix_hits_by_tier
    # Round two: the pool kept a few prompts at most; the others' prefixes come from the host.
    assert hits["host"] >= 2 * 10 * BLOCK, hits
    assert sum(hits.values()) == stats.prefix_hit_tokens > base_stats.prefix_hit_tokens
    # Whole pages move, of whichever group; a hit may load fewer blocks than it adds (group 0
    # still on the device, another group's few blocks loaded) or more (several groups').
    page = _page_bytes(kind)
    assert stats.tier_bytes_read["host"] > 0 and stats.tier_bytes_read["host"] % page == 0
    assert stats.tier_bytes_written["host"] > 0 and stats.tier_bytes_written["host"] % page == 0


def test_host_tier_and_swap_share_the_host_pool(model_dir: Tuple[str, str], dense: Any) -> None:
    """Requests growing together in a small pool are swapped out and back through the same host
    pool the tier keeps prefixes in (swapped blocks win); a later round hits the tier; every
    token is transformers'."""
    kind, _ = model_dir
    prompts = _prompts(3, [20, 17, 23])
    params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    grouping = group_layers(layer_kinds(hybrid_config(kind)), MAX_LEN, BLOCK)
    peak = sequence_blocks(grouping.groups, 23 + 28, BLOCK, 16)
    page = _page_bytes(kind)
    llm = LLM(model_dir[1], device="cpu", progress=False, block_size=BLOCK, num_blocks=peak + 2,
              max_num_seqs=4, max_num_batched_tokens=16, swap_space=64 * page + page // 2,
              preemption_mode="swap", host_cache_memory=64 * page)
    try:
        want = [_reference(dense, p, 28) for p in prompts]
        for _ in range(2):
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == want
        stats = llm.stats()
        assert stats.num_preemptions_swap > 0
        core = llm.llm_engine.manager.stats()
        assert core.swapped_out_blocks > 0 and core.swapped_in_blocks > 0
        assert stats.prefix_hits_by_tier.get("host", 0) > 0
        _idle_host_pool(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("setting", [
    dict(disk_cache_dir="DIR", disk_cache_memory="1MiB"),
    dict(remote_cache_url="redis://127.0.0.1:1/0", hash_seed=7)])
def test_lower_tiers_are_refused_saying_what_works(model_dir: Tuple[str, str], setting: Dict[str, Any],
                                                   tmp_path: Any) -> None:
    kind, directory = model_dir
    setting = {k: (str(tmp_path / "kv") if v == "DIR" else v) for k, v in setting.items()}
    loaded = load_model(directory, device="cpu")
    with pytest.raises(ConfigArgumentError) as info:
        LLMEngine(loaded, block_size=BLOCK, num_blocks=64, host_cache_memory="1MiB", **setting)
    name = next(iter(setting))
    assert info.value.field == name
    msg = str(info.value)
    assert directory in msg and "KV cache groups" in msg
    assert "host_cache_memory" in msg and "swap_space" in msg
