"""Group-aware sizing: :func:`pagedkv.config.size_groups`, the layer kinds of a
:class:`ModelConfig`, and ``pagedkv plan`` for models with sliding-window layers."""

import json

import numpy as np
import pytest

from pagedkv import BlockManager, StepBuffers
from pagedkv.capacity import format_plan, make_plan, plan_json
from pagedkv.cli import main
from pagedkv.config import (
    PRESETS,
    CacheSpec,
    CapacityError,
    MemoryBudget,
    ModelConfig,
    size_groups,
)
from pagedkv.errors import InvalidConfigError, OutOfBlocksError
from pagedkv.groups import KVCacheGroup

GiB = 2**30

# google/gemma-3-27b-it's language model, every field spelled out (the hub file leaves defaults out).
GEMMA3_27B = {
    "model_type": "gemma3",
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text", "head_dim": 128, "hidden_size": 5376,
        "intermediate_size": 21504, "num_attention_heads": 32, "num_hidden_layers": 62,
        "num_key_value_heads": 16, "vocab_size": 262208, "max_position_embeddings": 131072,
        "sliding_window": 1024, "sliding_window_pattern": 6, "tie_word_embeddings": True,
    },
}
GPT_OSS_120B = {
    "model_type": "gpt_oss", "torch_dtype": "bfloat16", "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088, "num_local_experts": 128,
    "num_experts_per_tok": 4, "sliding_window": 128, "attention_bias": True,
    "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}


def test_hand_arithmetic_small_hybrid():
    # 6 layers: 4 sliding (window 64), 2 full; 2 KV heads × 64 × fp16 = 512 B a layer per token.
    spec = CacheSpec(num_layers=6, num_kv_heads=2, head_dim=64, dtype="float16", block_size=16)
    kinds = [("sliding", 64)] * 2 + [("full", 0)] + [("sliding", 64)] * 2 + [("full", 0)]
    s = size_groups(spec, kinds, 10 * 2**20, 1024)
    # Best cut: 2 layers a page (1 full group, 2 sliding groups, no padding).
    assert s.grouping.slots == 2 and [g.kind for g in s.groups] == ["full", "sliding", "sliding"]
    assert s.layer_bytes_per_token == 512 and s.page_bytes == 2 * 512 * 16 == 16384
    assert s.num_blocks == 10 * 2**20 // 16384 == 640
    # 1024 tokens: full 64 blocks; sliding min(64, ceil(63 / 16) + 1) = 5 each.
    assert s.blocks_per_seq(1024) == 64 + 5 + 5
    assert s.max_seqs(1024) == 640 // 74
    # Optimum: 2 full layers × 64 + 4 sliding × 5 = 148 layer-blocks of 512 × 16 bytes.
    assert s.optimum_seqs(1024) == pytest.approx(10 * 2**20 / (148 * 512 * 16))
    assert s.efficiency(1024) == pytest.approx(1.0)
    # Token bound: 2 × 1024 + 4 × 64 tokens a layer.
    assert s.token_bound_seqs(1024) == pytest.approx(10 * 2**20 / ((2 * 1024 + 4 * 64) * 512))
    # Full-attention accounting: 6-layer blocks of 48 KiB, 64 a sequence.
    assert s.full_num_blocks == 10 * 2**20 // (6 * 512 * 16) == 213
    assert s.full_max_seqs(1024) == 213 // 64 == 3
    assert s.max_seqs(1024) == 8
    # vLLM's grouping here is the same (smallest kind has 2 layers): no padding either.
    assert s.smallest_kind_page_efficiency(1024) == pytest.approx(1.0)


def test_the_sizing_is_what_a_real_manager_holds():
    """A pool of exactly max_seqs × blocks_per_seq pages runs that many sequences decoding to L
    in lockstep; one page fewer runs out at the peak."""
    spec = CacheSpec(num_layers=6, num_kv_heads=2, head_dim=64, dtype="float16", block_size=16)
    kinds = [("sliding", 64)] * 4 + [("full", 0)] * 2
    L = 257  # the window's 64 positions span 5 blocks here (the sliding peak), full holds 17
    s = size_groups(spec, kinds, 10 * 2**20, L)
    need = s.blocks_per_seq(L)
    assert need == 17 + 5 + 5
    n = 6
    for pool, fits in ((n * need, True), (n * need - 1, False)):
        mgr = BlockManager(pool, 16, groups=s.groups, watermark_blocks=0,
                           enable_prefix_caching=False)
        mgr.attach_buffers(StepBuffers(n, 64, 32, device="cpu", backend="numpy",
                                       num_groups=s.num_groups))
        seqs = np.arange(n, dtype=np.int64)
        for i in range(n):
            mgr.admit(i, [i + 1])
        mgr.step(seqs, 1)
        try:
            for _ in range(L - 1):
                mgr.append_batch(seqs, np.ones(n, dtype=np.int64))
                mgr.step(seqs, 1)
        except OutOfBlocksError:
            assert not fits
            continue
        assert fits
        assert mgr.num_free_blocks == 0
        mgr.check_invariants()


@pytest.mark.parametrize("cfg, name, groups, slots", [
    (GEMMA3_27B, "gemma-3-27b", 31, 2),
    (GPT_OSS_120B, "gpt-oss-120b", 2, 18),
])
@pytest.mark.parametrize("context", [8192, 32768, 131072])
def test_published_hybrids_reach_99_percent_of_the_optimum(cfg, name, groups, slots, context):
    model = ModelConfig.from_hf_config(cfg)
    assert model.layer_kinds == PRESETS[name].layer_kinds  # the preset is the config's reading
    assert model.has_windowed_layers
    spec = model.cache_spec()
    s = size_groups(spec, model.layer_kinds, 20 * GiB, context)
    assert (s.num_groups, s.grouping.slots, s.grouping.padding) == (groups, slots, 0)
    assert s.efficiency(context) >= 0.99
    assert s.token_efficiency(context) >= 0.99
    assert s.max_seqs(context) >= s.full_max_seqs(context)


def test_gemma_beats_the_smallest_kind_page_at_8k():
    model = PRESETS["gemma-3-27b"]
    s = size_groups(model.cache_spec(), model.layer_kinds, 20 * GiB, 8192)
    # Pages of 10 layers (the full layers' count): 1 full + 6 sliding groups, 8 padded slots;
    # (10 × 512 + 52 × 65) / ((512 + 6 × 65) × 10) = 8500 / 9020.
    assert s.smallest_kind_page_efficiency(8192) == pytest.approx(8500 / 9020, rel=1e-3)
    assert s.efficiency(8192) > 0.999
    # 3× and more the concurrency of full-attention accounting at 8K.
    assert s.max_seqs(8192) >= 3 * s.full_max_seqs(8192)


def test_full_attention_model_sizes_as_one_group():
    spec = PRESETS["llama-3-8b"].cache_spec()
    assert PRESETS["llama-3-8b"].layer_kinds is None
    s = size_groups(spec, None, 10 * GiB, 8192)
    assert s.num_groups == 1 and s.grouping.slots == 32
    assert s.num_blocks == s.full_num_blocks == 10 * GiB // spec.bytes_per_block
    assert s.max_seqs(8192) == s.full_max_seqs(8192)
    model = ModelConfig.from_hf_config({
        "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
        "num_attention_heads": 16, "vocab_size": 1000, "torch_dtype": "bfloat16"})
    assert model.layer_kinds is None and not model.has_windowed_layers


def test_bad_input_is_refused():
    spec = CacheSpec(num_layers=4, num_kv_heads=2, head_dim=64)
    with pytest.raises(InvalidConfigError, match="one attention kind per layer"):
        size_groups(spec, [("full", 0)] * 3, GiB, 1024)
    with pytest.raises(InvalidConfigError, match=r"layer_kinds\[1\]"):
        size_groups(spec, [("full", 0), ("window", 4), ("full", 0), ("full", 0)], GiB, 1024)
    with pytest.raises(InvalidConfigError, match=r"layer_kinds\[0\]"):
        size_groups(spec, [("sliding", 0)] + [("full", 0)] * 3, GiB, 1024)
    with pytest.raises(InvalidConfigError, match="context"):
        size_groups(spec, None, GiB, 0)
    with pytest.raises(InvalidConfigError, match="CacheSpec"):
        size_groups("spec", None, GiB, 16)  # type: ignore[arg-type]
    with pytest.raises(CapacityError, match="no room for a KV page"):
        size_groups(spec, None, 100, 1024)
    with pytest.raises(InvalidConfigError, match="layer_kinds"):
        ModelConfig("x", 64, 64, 2, 2, 2, 32, 10, layer_kinds=(("full", 0),))
    # KVCacheGroup objects are taken as they are.
    m = ModelConfig("x", 64, 64, 2, 2, 2, 32, 10,
                    layer_kinds=(KVCacheGroup.full(), KVCacheGroup.sliding(8)))
    assert m.layer_kinds == (("full", 0), ("sliding", 8))
    assert m.kv_groups() == [KVCacheGroup.full(), KVCacheGroup.sliding(8)]


def test_make_plan_groups_text_and_json():
    model = PRESETS["gemma-3-27b"]
    budget = MemoryBudget(total_bytes=80 * GiB, weights_bytes=model.weight_bytes)
    plan = make_plan(model.cache_spec(), budget, [8192, 32768], 131072,
                     layer_kinds=model.layer_kinds)
    assert plan.groups is not None and plan.groups.context == 131072
    text = format_plan(plan)
    assert "31 of 2 layers (5 full, 26 sliding 1,024), no padding" in text
    obj = json.loads(plan_json(plan))
    g = obj["groups"]
    assert g["num_groups"] == 31 and g["slots"] == 2 and g["page_bytes"] == 2 * 8192 * 16
    assert g["num_blocks"] == budget.kv_bytes // g["page_bytes"]
    r8k = g["rows"][0]
    assert r8k["blocks_per_seq"] == 5 * 512 + 26 * 65
    assert r8k["max_seqs"] == g["num_blocks"] // r8k["blocks_per_seq"]
    assert r8k["full_max_seqs"] == obj["rows"][0]["paged_max_seqs"]
    assert r8k["efficiency"] >= 0.99
    # Without windowed layers (or without kinds) there is no group section.
    plain = make_plan(model.cache_spec(), budget, [8192], 131072)
    assert plain.groups is None and "KV cache groups" not in format_plan(plain)
    assert json.loads(plan_json(plain))["groups"] is None


def test_cli_plan_hf_config_groups(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_120B))
    argv = ["plan", "--hf-config", str(tmp_path), "--gpu-mem", "80GiB", "--weights", "61GiB",
            "--seq-lens", "8k,32k,128k"]
    assert main(argv + ["--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    g = obj["groups"]
    assert g["groups"] == [["full", 0], ["sliding", 128]] and g["slots"] == 18
    assert [r["seq_len"] for r in g["rows"]] == [8192, 32768, 131072]
    assert all(r["efficiency"] >= 0.99 for r in g["rows"])
    # 8K: 512 full pages + 9 sliding pages of half the bytes of a full-attention block.
    assert g["rows"][0]["blocks_per_seq"] == 521
    assert main(argv) == 0
    assert "KV cache groups" in capsys.readouterr().out
    assert main(argv + ["--no-kv-groups", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["groups"] is None


def test_every_layer_windowed_plans_as_one_sliding_group():
    # Mistral-7B v0.1: a sliding window on every layer. One sliding group (group 0 windowed): a
    # sequence holds its window's pages, whatever its length.
    cfg = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
           "torch_dtype": "bfloat16", "sliding_window": 4096, "max_position_embeddings": 32768}
    model = ModelConfig.from_hf_config(cfg)
    assert model.layer_kinds == (("sliding", 4096),) * 32
    s = size_groups(model.cache_spec(), model.layer_kinds, 10 * GiB, 32768)
    assert s.num_groups == 1 and s.grouping.saves_memory
    assert s.groups == (KVCacheGroup.sliding(4096),)
    # ceil(4095 / 16) + 1 = 257 pages a sequence, at any length past the window.
    assert s.blocks_per_seq(32768) == s.blocks_per_seq(8192) == 257
    assert s.blocks_per_seq(4096) == 256
    assert s.max_seqs(32768) == s.num_blocks // 257
    assert s.full_max_seqs(32768) == s.num_blocks // 2048
    plan = make_plan(model.cache_spec(), MemoryBudget(total_bytes=80 * GiB), [8192, 32768],
                     layer_kinds=model.layer_kinds)
    assert plan.groups is not None and plan.groups.groups == (KVCacheGroup.sliding(4096),)
    # Qwen2 with use_sliding_window false: every layer full.
    qwen = dict(cfg, model_type="qwen2", use_sliding_window=False)
    assert ModelConfig.from_hf_config(qwen).layer_kinds is None
