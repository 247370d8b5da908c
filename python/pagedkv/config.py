"""Model and cache specifications, and pool sizing.

This module owns the arithmetic that turns a model and a memory size into a number of KV blocks:

- :class:`CacheSpec` — what one KV block holds: layers, KV heads, head size, element type and
  block size. ``bytes_per_token = 2 × kv_heads × head_dim × dtype_bytes × layers`` (the 2 is K and
  V); ``bytes_per_block = bytes_per_token × block_size``. An MLA spec caches one latent per token
  per layer instead of a K and a V per KV head.
- :class:`ModelConfig` — the handful of Hugging Face ``config.json`` fields needed to derive a
  :class:`CacheSpec` and to estimate the weights' size (:attr:`ModelConfig.weight_params`), with
  :class:`MLAConfig` (DeepSeek's latent attention) and :class:`MoEConfig` (every expert counted).
  A config it cannot size is refused with the reason, never sized as something else.
- :class:`MemoryBudget` / :func:`num_blocks_for` — ``floor((total × utilization − weights −
  activation peak − graph reserve) / bytes_per_block)``.
- :class:`GroupSizing` / :func:`size_groups` — the same budget for a model whose layers mix full,
  sliding-window and chunked attention: the KV cache groups (:attr:`ModelConfig.layer_kinds` cut
  by :func:`pagedkv.layer_groups.group_layers`), the pages of one uniform size they share, the
  per-sequence need over every group, and the concurrency against the analytic optimum and
  against full-attention accounting.
- :data:`PRESETS` — a few common models, transcribed from their published ``config.json`` files.
- :func:`parse_bytes` / :func:`format_bytes` — ``"80GiB"``-style sizes for the CLI.

This module holds the presets and is the one import path for all of the above; the code lives by
concern in ``_config_spec`` (dtypes, :class:`CacheSpec`), ``_config_layers`` (:class:`MLAConfig`,
:class:`MoEConfig`), ``_config_model`` (:class:`ModelConfig`), ``_config_hf`` (reading a
``config.json``) and ``_config_sizing`` (:class:`MemoryBudget`, :class:`CapacityError`, sizes).

Invariants: every object here is immutable and validated on construction, so a :class:`CacheSpec`
or :class:`ModelConfig` that exists is usable. Bad input raises
:class:`pagedkv.errors.InvalidConfigError` (a field missing or out of range) or
:class:`CapacityError` (the memory budget leaves no room for a single block); both derive from
:class:`pagedkv.errors.PagedKVError` and :class:`ValueError`. No torch import:
sizing runs on machines without a GPU stack.
"""

from __future__ import annotations

from ._config_layers import MLAConfig, MoEConfig
from ._config_model import ModelConfig
from ._config_sizing import (
    CapacityError,
    GroupSizing,
    MemoryBudget,
    format_bytes,
    num_blocks_for,
    parse_bytes,
    size_groups,
)
from ._config_spec import DTYPE_BYTES, CacheSpec, normalize_dtype
from .errors import InvalidConfigError

__all__ = [
    "CacheSpec",
    "CapacityError",
    "DTYPE_BYTES",
    "GroupSizing",
    "MLAConfig",
    "MemoryBudget",
    "MoEConfig",
    "ModelConfig",
    "PRESETS",
    "format_bytes",
    "get_preset",
    "normalize_dtype",
    "num_blocks_for",
    "parse_bytes",
    "size_groups",
]

_SLIDING_1024 = ("sliding", 1024)
_SLIDING_128 = ("sliding", 128)


# Transcribed from each model's published config.json on the Hugging Face hub.
PRESETS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        ModelConfig("llama-3-8b", hidden_size=4096, intermediate_size=14336, num_layers=32,
                    num_attention_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256,
                    dtype="bfloat16", max_position_embeddings=8192),
        ModelConfig("llama-3.1-8b", hidden_size=4096, intermediate_size=14336, num_layers=32,
                    num_attention_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256,
                    dtype="bfloat16", max_position_embeddings=131072),
        ModelConfig("llama-3-70b", hidden_size=8192, intermediate_size=28672, num_layers=80,
                    num_attention_heads=64, num_kv_heads=8, head_dim=128, vocab_size=128256,
                    dtype="bfloat16", max_position_embeddings=8192),
        ModelConfig("mistral-7b", hidden_size=4096, intermediate_size=14336, num_layers=32,
                    num_attention_heads=32, num_kv_heads=8, head_dim=128, vocab_size=32000,
                    dtype="bfloat16", max_position_embeddings=32768),
        ModelConfig("qwen2.5-7b", hidden_size=3584, intermediate_size=18944, num_layers=28,
                    num_attention_heads=28, num_kv_heads=4, head_dim=128, vocab_size=152064,
                    dtype="bfloat16", attention_bias=True, max_position_embeddings=32768),
        ModelConfig("qwen2.5-0.5b", hidden_size=896, intermediate_size=4864, num_layers=24,
                    num_attention_heads=14, num_kv_heads=2, head_dim=64, vocab_size=151936,
                    dtype="bfloat16", tie_word_embeddings=True, attention_bias=True,
                    max_position_embeddings=32768),
        # The language model of google/gemma-3-27b-it (text_config): five sliding layers of
        # window 1024, then a full one (sliding_window_pattern 6); Q/K norms; tied embeddings.
        ModelConfig("gemma-3-27b", hidden_size=5376, intermediate_size=21504, num_layers=62,
                    num_attention_heads=32, num_kv_heads=16, head_dim=128, vocab_size=262208,
                    dtype="bfloat16", tie_word_embeddings=True, qk_norm=True,
                    max_position_embeddings=131072,
                    layer_kinds=tuple(("full", 0) if (i + 1) % 6 == 0 else _SLIDING_1024
                                      for i in range(62))),
        # openai/gpt-oss-120b: sliding (window 128) and full layers alternating, 128 experts
        # (the weights' count is bf16; the published checkpoint stores the experts in MXFP4).
        ModelConfig("gpt-oss-120b", hidden_size=2880, intermediate_size=2880, num_layers=36,
                    num_attention_heads=64, num_kv_heads=8, head_dim=64, vocab_size=201088,
                    dtype="bfloat16", attention_bias=True, max_position_embeddings=131072,
                    moe=MoEConfig(num_experts=128, expert_intermediate_size=2880,
                                  num_moe_layers=36),
                    layer_kinds=tuple(_SLIDING_128 if i % 2 == 0 else ("full", 0)
                                      for i in range(36))),
    )
}


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name`` (case-insensitive); :class:`InvalidConfigError` listing the known ones."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in PRESETS:
        raise InvalidConfigError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[key]
