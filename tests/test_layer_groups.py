"""Layers into KV cache groups: kinds read from Hugging Face configs, the grouping's padding and
its capacity against the analytic optimum, and typed errors on bad configs."""

from __future__ import annotations

import pytest

from pagedkv import BlockManager
from pagedkv.errors import InvalidConfigError
from pagedkv.groups import KVCacheGroup as K
from pagedkv.layer_groups import group_layers, layer_kinds

FULL = K.full()


def _gemma27() -> list:
    return [FULL if (i + 1) % 6 == 0 else K.sliding(1024) for i in range(62)]


def test_kinds_from_layer_types_window_and_chunk() -> None:
    cfg = {"num_hidden_layers": 4, "sliding_window": 8, "attention_chunk_size": 16,
           "layer_types": ["sliding_attention", "full_attention", "chunked_attention", "attention"]}
    assert layer_kinds(cfg) == [K.sliding(8), FULL, K.chunked(16), FULL]
    # Mistral: every layer slides; off when use_sliding_window is false; Qwen2's first
    # max_window_layers layers stay full; an old Gemma's pattern makes every 3rd layer full.
    assert layer_kinds({"num_hidden_layers": 2, "sliding_window": 5}) == [K.sliding(5)] * 2
    assert layer_kinds({"num_hidden_layers": 2, "sliding_window": 5,
                        "use_sliding_window": False}) == [FULL] * 2
    assert layer_kinds({"model_type": "qwen2", "num_hidden_layers": 3, "sliding_window": 5,
                        "max_window_layers": 2}) == [FULL, FULL, K.sliding(5)]
    assert layer_kinds({"num_hidden_layers": 3, "sliding_window": 5,
                        "sliding_window_pattern": 3}) == [K.sliding(5), K.sliding(5), FULL]
    assert layer_kinds({"text_config": {"num_hidden_layers": 1}}) == [FULL]


@pytest.mark.parametrize("cfg", [
    {},
    {"num_hidden_layers": 2, "layer_types": ["full_attention"]},
    {"num_hidden_layers": 1, "layer_types": ["mamba"]},
    {"num_hidden_layers": 1, "layer_types": ["sliding_attention"]},
    {"num_hidden_layers": 1, "layer_types": ["sliding_attention"], "sliding_window": 0},
    {"num_hidden_layers": 1, "layer_types": ["chunked_attention"]},
])
def test_bad_configs_are_typed_errors(cfg: dict) -> None:
    with pytest.raises(InvalidConfigError):
        layer_kinds(cfg)


def test_gemma3_27b_groups_without_padding_and_beat_one_10_layer_page() -> None:
    kinds = _gemma27()
    g = group_layers(kinds, 8192, 16)
    assert (g.slots, g.num_groups, g.padding) == (2, 31, 0)
    assert g.groups[:5] == (FULL,) * 5 and set(g.groups[5:]) == {K.sliding(1024)}
    for T in (8192, 32768, 131072):
        assert group_layers(kinds, T, 16).efficiency(kinds, T, 16) >= 0.99
    # Every layer has one place; each group's layers share its kind.
    seen = sorted((g.layer_group[i], g.layer_slot[i]) for i in range(62))
    assert len(set(seen)) == 62
    for gi, layers in enumerate(g.group_layers):
        assert all(kinds[i] == g.groups[gi] for i in layers)
        assert all(g.layer_group[i] == gi and g.layer_slot[i] == j for j, i in enumerate(layers))
    # A manager takes the grouping as is.
    m = BlockManager(64, 16, groups=g.groups)
    assert m.num_groups == 31


def test_group_limit_trades_padding_for_fewer_groups() -> None:
    kinds = _gemma27()
    g = group_layers(kinds, 8192, 16, max_groups=8)
    assert g.num_groups <= 8 and g.padding > 0
    assert g.efficiency(kinds, 8192, 16) < group_layers(kinds, 8192, 16).efficiency(kinds, 8192, 16)


def test_uniform_models_are_one_group() -> None:
    g = group_layers([FULL] * 4, 100, 4)
    assert g.groups == (FULL,) and g.slots == 4 and not g.saves_memory
    # Every layer windowed: one group of that kind (group 0 windowed), or one full group when a
    # tier below the GPU needs group 0 full.
    g = group_layers([K.sliding(4)] * 4, 100, 4)
    assert g.groups == (K.sliding(4),) and g.slots == 4 and g.saves_memory
    assert g.need_blocks(100, 4) == 2
    g = group_layers([K.sliding(4)] * 4, 100, 4, windowed_group0=False)
    assert g.groups == (FULL,) and not g.saves_memory and g.need_blocks(100, 4) == 25
    with pytest.raises(InvalidConfigError):
        group_layers([FULL], 100, 4, windowed_group0=1)  # type: ignore[arg-type]
    # Two windowed kinds: no full group at all; group 0 is one of them.
    mixed = [K.chunked(8), K.sliding(4), K.sliding(4), K.chunked(8)]
    g = group_layers(mixed, 100, 4)
    assert all(k.kind != "full" for k in g.groups) and g.saves_memory
    assert sorted(set(g.groups), key=str) == sorted({K.chunked(8), K.sliding(4)}, key=str)
    oss = [K.sliding(128) if i % 2 == 0 else FULL for i in range(36)]
    g = group_layers(oss, 32768, 16)
    assert (g.num_groups, g.slots, g.padding) == (2, 18, 0) and g.saves_memory
    with pytest.raises(InvalidConfigError):
        group_layers([], 100, 4)
    with pytest.raises(InvalidConfigError):
        group_layers(oss, 0, 16)


@pytest.mark.parametrize("raw", [
    {"model_type": "gemma3_text", "num_hidden_layers": 13, "sliding_window": 512},
    {"model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": 512,
     "sliding_window_pattern": 3},
    {"model_type": "gpt_oss", "num_hidden_layers": 5, "sliding_window": 128},
    {"model_type": "llama4_text", "num_hidden_layers": 9, "attention_chunk_size": 8192},
    {"model_type": "llama4_text", "num_hidden_layers": 3, "attention_chunk_size": 64,
     "no_rope_layers": [0, 1, 1]},
    {"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 64,
     "use_sliding_window": True, "max_window_layers": 1},
    {"model_type": "mistral", "num_hidden_layers": 3, "sliding_window": 4096},
    {"model_type": "llama", "num_hidden_layers": 3},
])
def test_a_config_json_without_layer_types_reads_as_transformers_fills_them(raw: dict) -> None:
    """A ``config.json`` written without ``layer_types`` (older checkpoints) gets the kinds
    transformers derives for its model type, so ``pagedkv plan --hf-config`` on the file and the
    engine on the loaded config group the layers alike."""
    transformers = pytest.importorskip("transformers")
    built = transformers.AutoConfig.for_model(**raw)
    if raw["model_type"] not in ("mistral", "llama"):  # these have no layer_types at all
        assert built.layer_types is not None
    assert layer_kinds(raw) == layer_kinds(built)
    if raw["model_type"] in ("gemma3_text", "gpt_oss", "llama4_text"):
        kinds = layer_kinds(raw)
        assert FULL in kinds and any(k != FULL for k in kinds)  # hybrid, not all one kind
