"""Pool-sizing arithmetic, Hugging Face config parsing and every validation error of pagedkv.config."""

import json

import pytest

from pagedkv.config import (
    PRESETS,
    CacheSpec,
    CapacityError,
    MemoryBudget,
    ModelConfig,
    format_bytes,
    get_preset,
    normalize_dtype,
    num_blocks_for,
    parse_bytes,
)
from pagedkv.errors import InvalidConfigError, PagedKVError

GiB = 2**30


def test_llama3_8b_bytes_per_token_and_block():
    spec = CacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert spec.dtype_bytes == 2
    assert spec.bytes_per_token == 2 * 8 * 128 * 2 * 32 == 131072
    assert spec.bytes_per_block == 131072 * 16
    assert spec.blocks_for_tokens(0) == 0
    assert spec.blocks_for_tokens(16) == 1
    assert spec.blocks_for_tokens(17) == 2


@pytest.mark.parametrize(
    "dtype, size", [("float32", 4), ("float16", 2), ("bf16", 2), ("float8_e4m3fn", 1), ("fp8", 1),
                    ("torch.bfloat16", 2), ("FLOAT16", 2)],
)
def test_dtype_sizes_and_aliases(dtype, size):
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=dtype, block_size=1)
    assert spec.dtype_bytes == size
    assert spec.bytes_per_token == 2 * 4 * size
    assert spec.dtype in {"float32", "float16", "bfloat16", "float8_e4m3fn"}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_size=0),
        dict(block_size=-16),
        dict(block_size=24),
        dict(block_size=16.0),
        dict(num_layers=0),
        dict(num_layers=True),
        dict(num_kv_heads=-1),
        dict(head_dim=0),
        dict(dtype="int7"),
        dict(dtype=None),
    ],
)
def test_cache_spec_rejects_bad_fields(kwargs):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_size=16)
    base.update(kwargs)
    with pytest.raises(InvalidConfigError) as info:
        CacheSpec(**base)
    assert isinstance(info.value, PagedKVError) and isinstance(info.value, ValueError)


def test_block_size_one_and_large_powers_of_two_accepted():
    for b in (1, 2, 8, 256):
        assert CacheSpec(1, 1, 8, "float16", b).bytes_per_block == 2 * 8 * 2 * b


def test_presets_match_published_parameter_counts():
    # Parameter counts published with each model (billions, rounded as published).
    published = {"llama-3-8b": 8.03, "llama-3-70b": 70.55, "mistral-7b": 7.24,
                 "qwen2.5-7b": 7.62, "qwen2.5-0.5b": 0.49}
    for name, billions in published.items():
        assert round(PRESETS[name].weight_params / 1e9, 2) == billions, name
    # Exact for Llama-3-8B: every matrix and norm vector summed by hand.
    assert PRESETS["llama-3-8b"].weight_params == 8_030_261_248
    assert PRESETS["llama-3-8b"].weight_bytes == 2 * 8_030_261_248
    assert get_preset("Llama-3-8B") is PRESETS["llama-3-8b"]
    assert PRESETS["llama-3-70b"].cache_spec().bytes_per_token == 2 * 8 * 128 * 2 * 80
    assert PRESETS["qwen2.5-7b"].cache_spec(dtype="fp8").bytes_per_token == 2 * 4 * 128 * 1 * 28


def test_unknown_preset():
    with pytest.raises(InvalidConfigError, match="llama-3-8b"):
        get_preset("gpt-5")


def _llama_like(**overrides):
    cfg = {
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    cfg.update(overrides)
    return cfg


def test_hf_config_from_file_and_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_llama_like()))
    for source in (tmp_path / "config.json", str(tmp_path)):
        m = ModelConfig.from_hf_config(source)
        assert (m.num_layers, m.num_kv_heads, m.head_dim, m.dtype) == (4, 2, 64, "bfloat16")
        spec = CacheSpec.from_hf_config(source, block_size=32)
        assert spec == CacheSpec(4, 2, 64, "bfloat16", 32)
        assert spec.bytes_per_token == 2 * 2 * 64 * 2 * 4


def test_hf_weight_formula_and_tied_embeddings():
    h, inter, layers, heads, kv, vocab = 512, 1024, 4, 8, 2, 1000
    hd = h // heads
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * inter + 2 * h
    untied = vocab * h + layers * per_layer + h + vocab * h
    m = ModelConfig.from_hf_config(_llama_like())
    assert m.weight_params == untied
    assert m.weight_bytes == 2 * untied
    tied = ModelConfig.from_hf_config(_llama_like(tie_word_embeddings=True))
    assert tied.weight_params == untied - vocab * h
    biased = ModelConfig.from_hf_config(_llama_like(attention_bias=True))
    assert biased.weight_params == untied + layers * (heads * hd + 2 * kv * hd)
    moe = ModelConfig.from_hf_config(_llama_like(num_local_experts=4))
    assert moe.weight_params == untied + layers * (3 * 3 * h * inter + 4 * h)


def test_hf_fallbacks_dtype_key_head_dim_and_kv_heads():
    cfg = _llama_like(head_dim=96)
    del cfg["num_key_value_heads"]
    del cfg["torch_dtype"]
    cfg["dtype"] = "float16"
    m = ModelConfig.from_hf_config(cfg)
    assert (m.num_kv_heads, m.head_dim, m.dtype) == (8, 96, "float16")
    assert ModelConfig.from_hf_config(cfg, dtype="float32").dtype == "float32"
    nested = {"model_type": "multimodal", "torch_dtype": "bfloat16",
              "text_config": {k: v for k, v in _llama_like().items() if k != "torch_dtype"}}
    assert ModelConfig.from_hf_config(nested).cache_spec() == CacheSpec(4, 2, 64, "bfloat16")
    qwen = ModelConfig.from_hf_config(_llama_like(model_type="qwen2"))
    assert qwen.attention_bias


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.pop("num_hidden_layers"), "num_hidden_layers"),
        (lambda c: c.pop("torch_dtype"), "dtype"),
        (lambda c: c.update(hidden_size=500), "head_dim"),
        (lambda c: c.update(num_key_value_heads=3), "multiple"),
        (lambda c: c.update(torch_dtype="int4"), "int4"),
        (lambda c: c.update(num_hidden_layers=0), "num_layers"),
    ],
)
def test_hf_config_errors(mutate, message):
    cfg = _llama_like()
    mutate(cfg)
    with pytest.raises(InvalidConfigError, match=message):
        ModelConfig.from_hf_config(cfg)


def test_hf_config_file_errors(tmp_path):
    with pytest.raises(InvalidConfigError, match="no such file"):
        ModelConfig.from_hf_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidConfigError, match="not valid JSON"):
        ModelConfig.from_hf_config(bad)
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(InvalidConfigError, match="JSON object"):
        ModelConfig.from_hf_config(arr)
    with pytest.raises(InvalidConfigError):
        ModelConfig.from_hf_config(42)


def test_num_blocks_for_arithmetic():
    spec = PRESETS["llama-3-8b"].cache_spec()
    weights = PRESETS["llama-3-8b"].weight_bytes
    total = 80 * GiB
    expected = (int(total * 9 // 10) - weights - GiB - GiB // 2) // spec.bytes_per_block
    got = num_blocks_for(spec, total, weights, GiB, GiB // 2, utilization=0.9)
    assert got == expected
    # Utilization 1.0 and no other terms: the whole memory, floor-divided.
    assert num_blocks_for(spec, 10 * spec.bytes_per_block + 5, utilization=1.0) == 10
    budget = MemoryBudget(total_bytes=total, weights_bytes=weights, utilization=0.5)
    assert budget.usable_bytes == 40 * GiB
    assert budget.kv_bytes == 40 * GiB - weights
    assert budget.num_blocks(spec) == (40 * GiB - weights) // spec.bytes_per_block


def test_capacity_error_names_every_term():
    spec = PRESETS["llama-3-70b"].cache_spec()
    with pytest.raises(CapacityError) as info:
        num_blocks_for(spec, 80 * GiB, PRESETS["llama-3-70b"].weight_bytes, GiB, GiB)
    msg = str(info.value)
    for term in ("total", "utilization", "weights", "activation peak", "graph reserve", "one block needs"):
        assert term in msg
    assert isinstance(info.value, PagedKVError) and isinstance(info.value, ValueError)
    # Exactly one block short of a block still fails.
    with pytest.raises(CapacityError):
        num_blocks_for(spec, spec.bytes_per_block - 1, utilization=1.0)
    assert num_blocks_for(spec, spec.bytes_per_block, utilization=1.0) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(total_bytes=0),
        dict(total_bytes=-1),
        dict(weights_bytes=-1),
        dict(activation_peak_bytes=-5),
        dict(graph_reserve_bytes=-5),
        dict(utilization=0.0),
        dict(utilization=1.5),
        dict(utilization=float("nan")),
        dict(total_bytes=1.5e9),
    ],
)
def test_memory_budget_rejects_bad_fields(kwargs):
    base = dict(total_bytes=GiB)
    base.update(kwargs)
    with pytest.raises(InvalidConfigError):
        MemoryBudget(**base)


def test_num_blocks_rejects_non_spec():
    with pytest.raises(InvalidConfigError):
        MemoryBudget(total_bytes=GiB).num_blocks("llama")


@pytest.mark.parametrize(
    "text, expected",
    [("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("80 gib", 80 * 2**30), ("1.5TiB", 3 * 2**39),
     ("4096", 4096), ("512MiB", 2**29), ("2KB", 2000), ("7b", 7), (123, 123), (".5KiB", 512)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["80G", "eighty", "", "-1GiB", "1.2.3GB", -5, None, "80 XB"])
def test_parse_bytes_errors(text):
    with pytest.raises(InvalidConfigError):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(131072) == "128.00 KiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(-3 * 2**30) == "-3.00 GiB"
    assert format_bytes(5 * 2**40) == "5.00 TiB"


def test_normalize_dtype():
    assert normalize_dtype("BF16") == "bfloat16"
    with pytest.raises(InvalidConfigError):
        normalize_dtype(16)


# ---------------------------------------------------------------- MLA and mixture-of-experts configs
# Literal config.json contents (the fields that matter, as published). The expected parameter
# counts are what the Hugging Face implementations of these architectures instantiate from the
# same dicts (counted on the meta device with transformers 5.17), which also match the published
# sizes: 15.7B, 671B, 46.7B, 14.3B, 30.5B.

DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "torch_dtype": "bfloat16",
    "hidden_size": 2048, "intermediate_size": 10944, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 102400,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "attention_bias": False, "max_position_embeddings": 163840,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "moe_intermediate_size": 1408, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "tie_word_embeddings": False,
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "torch_dtype": "bfloat16", "hidden_size": 7168,
    "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "vocab_size": 129280, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "attention_bias": False,
    "n_routed_experts": 256, "n_shared_experts": 1, "moe_intermediate_size": 2048,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "num_nextn_predict_layers": 1,
    "max_position_embeddings": 163840, "tie_word_embeddings": False,
}
MIXTRAL_8X7B = {
    "model_type": "mixtral", "torch_dtype": "bfloat16", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
    "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}
QWEN15_MOE_A27B = {
    "model_type": "qwen2_moe", "torch_dtype": "bfloat16", "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
    "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "max_position_embeddings": 8192, "tie_word_embeddings": False,
}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "torch_dtype": "bfloat16", "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
    "max_position_embeddings": 40960, "tie_word_embeddings": False,
}


def test_mla_caches_one_latent_per_token_per_layer():
    m = ModelConfig.from_hf_config(DEEPSEEK_V2_LITE)
    assert m.mla is not None and m.mla.latent_dim == 512 + 64
    spec = m.cache_spec()
    assert spec.mla and (spec.num_kv_heads, spec.head_dim, spec.num_layers) == (1, 576, 27)
    # (kv_lora_rank + qk_rope_head_dim) × bf16 × layers: about 30 KiB, not the 216 KiB that plain
    # attention with 16 KV heads of 128 would claim.
    assert spec.bytes_per_token == 576 * 2 * 27 == 31104
    assert spec.bytes_per_token != 2 * 16 * 128 * 2 * 27 == 216 * 1024
    assert spec.bytes_per_block == 31104 * 16
    assert m.cache_spec(dtype="fp8").bytes_per_token == 576 * 27
    v3 = ModelConfig.from_hf_config(DEEPSEEK_V3).cache_spec()
    assert v3.bytes_per_token == 576 * 2 * 61


def test_mla_weight_formula_by_hand():
    h, heads, layers, vocab = 2048, 16, 27, 102400
    rank, rope, nope, v = 512, 64, 128, 128
    attn = (h * heads * (nope + rope)              # q_proj (no q_lora_rank)
            + h * (rank + rope) + rank             # kv_a_proj_with_mqa, kv_a_layernorm
            + rank * heads * (nope + v)            # kv_b_proj
            + heads * v * h)                       # o_proj
    dense_mlp = 3 * h * 10944
    moe_mlp = 3 * h * 1408 * 64 + h * 64 + 3 * h * 1408 * 2   # routed experts, router, 2 shared
    total = 2 * vocab * h + layers * (attn + 2 * h) + 1 * dense_mlp + 26 * moe_mlp + h
    assert ModelConfig.from_hf_config(DEEPSEEK_V2_LITE).weight_params == total == 15_706_484_224


@pytest.mark.parametrize(
    "cfg, params, experts, moe_layers",
    [
        (DEEPSEEK_V2_LITE, 15_706_484_224, 64, 26),   # first_k_dense_replace = 1
        (DEEPSEEK_V3, 671_026_404_352, 256, 58),      # first 3 layers dense; MTP head not counted
        (MIXTRAL_8X7B, 46_702_792_704, 8, 32),
        (QWEN15_MOE_A27B, 14_315_784_192, 60, 24),    # gated shared expert, Q/K/V biases
        (QWEN3_30B_A3B, 30_532_122_624, 128, 48),     # per-head Q/K norms
    ],
)
def test_moe_counts_every_expert(cfg, params, experts, moe_layers):
    m = ModelConfig.from_hf_config(cfg)
    assert m.moe is not None
    assert (m.num_experts, m.moe.num_moe_layers) == (experts, moe_layers)
    assert m.weight_params == params
    assert m.weight_bytes == 2 * params
    assert m.max_position_embeddings == cfg["max_position_embeddings"]


def test_moe_dense_layer_placement():
    # Qwen-MoE: experts where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers.
    m = ModelConfig.from_hf_config(dict(QWEN15_MOE_A27B, decoder_sparse_step=2, mlp_only_layers=[1, 2]))
    assert m.moe is not None and m.moe.num_moe_layers == 12 - 1   # odd layers, minus layer 1
    # DeepSeek: dense below first_k_dense_replace, experts every moe_layer_freq layers after.
    m = ModelConfig.from_hf_config(dict(DEEPSEEK_V2_LITE, first_k_dense_replace=3, moe_layer_freq=2))
    assert m.moe is not None and m.moe.num_moe_layers == len([i for i in range(3, 27) if i % 2 == 0])
    # One expert is a dense model.
    assert ModelConfig.from_hf_config(dict(MIXTRAL_8X7B, num_local_experts=1)).moe is None


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.pop("qk_rope_head_dim"), "qk_rope_head_dim"),
        (lambda c: c.pop("v_head_dim"), "v_head_dim"),
        (lambda c: c.update(kv_lora_rank=0), "kv_lora_rank"),
        (lambda c: c.update(n_routed_experts=0), "num_experts"),
        (lambda c: c.update(first_k_dense_replace=-1), "first_k_dense_replace"),
        (lambda c: c.update(layer_types=["full_attention", "linear_attention"] * 13 + ["full_attention"]),
         "cannot size"),
        (lambda c: c.update(hybrid_override_pattern="M-M*"), "cannot size"),
        (lambda c: c.update(is_encoder_decoder=True), "encoder-decoder"),
        (lambda c: c.update(ffn_config={"moe_num_experts": 16}), "ffn_config"),
    ],
)
def test_unsizable_configs_are_refused(mutate, message):
    cfg = dict(DEEPSEEK_V2_LITE)
    mutate(cfg)
    with pytest.raises(InvalidConfigError, match=message) as info:
        ModelConfig.from_hf_config(cfg)
    assert "\n" not in str(info.value)


def test_sliding_window_layers_are_sized_in_full():
    cfg = _llama_like(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=128)
    assert ModelConfig.from_hf_config(cfg).cache_spec() == CacheSpec(4, 2, 64, "bfloat16")


def test_mla_spec_validation():
    assert CacheSpec(2, 1, 576, "bf16", mla=True).bytes_per_token == 576 * 2 * 2
    with pytest.raises(InvalidConfigError, match="num_kv_heads must be 1"):
        CacheSpec(2, 2, 576, "bf16", mla=True)
    with pytest.raises(InvalidConfigError, match="mla"):
        CacheSpec(2, 1, 576, "bf16", mla=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["9" * 5000, "1." + "0" * 5000 + "1GiB", " " * 100 + "1GiB"])
def test_parse_bytes_refuses_huge_numbers_naming_the_limit(text):
    with pytest.raises(InvalidConfigError, match="at most 64") as e:
        parse_bytes(text)
    assert e.value.value == len(text)
    assert "\n" not in str(e.value) and len(str(e.value)) < 200
    # The longest accepted spelling still parses.
    assert parse_bytes("1" + "0" * 59 + " GiB") == 10**59 * 2**30
