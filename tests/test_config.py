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
