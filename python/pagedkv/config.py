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
- :data:`PRESETS` — a few common models, transcribed from their published ``config.json`` files.
- :func:`parse_bytes` / :func:`format_bytes` — ``"80GiB"``-style sizes for the CLI.

Invariants: every object here is immutable and validated on construction, so a :class:`CacheSpec`
or :class:`ModelConfig` that exists is usable. Bad input raises
:class:`pagedkv.errors.InvalidConfigError` (a field missing or out of range) or
:class:`CapacityError` (the memory budget leaves no room for a single block); both derive from
:class:`pagedkv.errors.PagedKVError` and :class:`ValueError`. No torch import:
sizing runs on machines without a GPU stack.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping, Optional, Union

from ._checks import DEFAULT_BLOCK_SIZE, check_block_size
from .errors import InvalidConfigError, PagedKVError

__all__ = [
    "CacheSpec",
    "CapacityError",
    "DTYPE_BYTES",
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
]


class CapacityError(PagedKVError, ValueError):
    """The memory budget leaves no room for even one KV block."""


# Element sizes of the dtypes a KV cache is stored in. Names follow torch's attribute names so a
# spec's dtype maps one-to-one onto ``getattr(torch, spec.dtype)``.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
}

# Spellings seen in config files and on command lines, mapped to the canonical names above.
_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def normalize_dtype(dtype: str) -> str:
    """Canonical torch name for ``dtype`` (``"bf16"`` → ``"bfloat16"``); :class:`InvalidConfigError` if unknown."""
    if not isinstance(dtype, str):
        raise InvalidConfigError(f"dtype must be a string such as 'bfloat16', got {dtype!r}")
    name = dtype.strip().lower()
    if name.startswith("torch."):
        name = name[len("torch."):]
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise InvalidConfigError(f"unknown dtype {dtype!r}; expected one of {known}")
    return name


def _check_int(name: str, value: Any, minimum: int) -> None:
    # bool is an int subclass; True as a layer count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidConfigError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class CacheSpec:
    """Shape and element type of the KV cache: what one block of ``block_size`` tokens holds.

    ``block_size`` follows the package's rule for a KV pool (:func:`pagedkv._checks.check_block_size`:
    a power of two the attention kernels take).

    ``mla`` marks multi-head latent attention (DeepSeek-V2/V3): each token stores, per layer, one
    latent vector of ``head_dim`` elements (``kv_lora_rank + qk_rope_head_dim``) shared by every
    head, instead of a K and a V per KV head; ``num_kv_heads`` is then 1. The pool and kernels of
    this package implement the K/V layout only; an MLA spec serves sizing (``pagedkv plan``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_size: int = DEFAULT_BLOCK_SIZE
    mla: bool = False

    def __post_init__(self) -> None:
        _check_int("num_layers", self.num_layers, 1)
        _check_int("num_kv_heads", self.num_kv_heads, 1)
        _check_int("head_dim", self.head_dim, 1)
        check_block_size(self.block_size)
        if not isinstance(self.mla, bool):
            raise InvalidConfigError(f"mla must be a bool, got {self.mla!r}")
        if self.mla and self.num_kv_heads != 1:
            raise InvalidConfigError(
                f"an MLA cache holds one latent per token per layer: num_kv_heads must be 1, "
                f"got {self.num_kv_heads}"
            )
        # Frozen dataclass: normalising the dtype spelling needs object.__setattr__.
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return DTYPE_BYTES[self.dtype]

    @property
    def vectors_per_token(self) -> int:
        """Cached vectors per token per KV head and layer: 2 (K and V), or 1 (the MLA latent)."""
        return 1 if self.mla else 2

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers.

        ``2 × kv_heads × head_dim × dtype_bytes × layers``; for MLA ``1 × 1 × latent_dim ×
        dtype_bytes × layers``.
        """
        return self.vectors_per_token * self.num_kv_heads * self.head_dim * self.dtype_bytes * self.num_layers

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block: :attr:`bytes_per_token` × :attr:`block_size`."""
        return self.bytes_per_token * self.block_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens occupies: ``ceil(num_tokens / block_size)``."""
        _check_int("num_tokens", num_tokens, 0)
        return -(-num_tokens // self.block_size)

    @classmethod
    def from_hf_config(
        cls,
        source: Union[str, "os.PathLike[str]", Mapping[str, Any]],
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: str | None = None,
    ) -> "CacheSpec":
        """Spec from a Hugging Face ``config.json`` (a path, a directory holding one, or a dict).

        ``dtype`` overrides the config's weight dtype, e.g. ``"float8_e4m3fn"`` for an FP8 KV cache.
        """
        return ModelConfig.from_hf_config(source, dtype=dtype).cache_spec(block_size=block_size)


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): the projections around a compressed KV latent.

    Per layer and token the cache holds :attr:`latent_dim` = ``kv_lora_rank + qk_rope_head_dim``
    elements: the compressed K/V latent and the shared rotary key. Weights per layer:
    ``q_proj`` (``hidden × heads·(nope + rope)``) or, with ``q_lora_rank``, ``q_a_proj`` (``hidden ×
    q_lora_rank``) + its norm + ``q_b_proj`` (``q_lora_rank × heads·(nope + rope)``);
    ``kv_a_proj_with_mqa`` (``hidden × latent_dim``) + a ``kv_lora_rank`` norm; ``kv_b_proj``
    (``kv_lora_rank × heads·(nope + v_head_dim)``); ``o_proj`` (``heads·v_head_dim × hidden``).
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            _check_int(name, getattr(self, name), 1)
        _check_int("qk_nope_head_dim", self.qk_nope_head_dim, 0)
        if self.q_lora_rank is not None:
            _check_int("q_lora_rank", self.q_lora_rank, 1)

    @property
    def latent_dim(self) -> int:
        """Elements cached per token per layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key size: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params(self, hidden: int, heads: int, bias: bool) -> int:
        """Attention weights of one layer (formula in the class docstring)."""
        if self.q_lora_rank is None:
            q = hidden * heads * self.qk_head_dim
        else:
            q = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim
            q += self.q_lora_rank if bias else 0
        kv = hidden * self.latent_dim + self.kv_lora_rank
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        kv += self.latent_dim if bias else 0
        o = heads * self.v_head_dim * hidden + (hidden if bias else 0)
        return q + kv + o


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: which layers have one, and how large its experts are.

    Per MoE layer: ``num_experts`` routed experts of ``3 × hidden × expert_intermediate_size``
    (gated), a ``hidden × num_experts`` router, and shared experts that every token passes through
    (``3 × hidden × shared_intermediate_size``; DeepSeek's ``n_shared_experts × moe_intermediate_size``,
    Qwen-MoE's ``shared_expert_intermediate_size`` plus a ``hidden × 1`` gate). The other
    ``num_layers − num_moe_layers`` layers (DeepSeek's ``first_k_dense_replace``, Qwen-MoE's
    ``mlp_only_layers``) have a dense MLP of the model's ``intermediate_size``. Every expert is
    counted: all of them sit in device memory, however few a token is routed to.
    """

    num_experts: int
    expert_intermediate_size: int
    num_moe_layers: int
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False

    def __post_init__(self) -> None:
        _check_int("num_experts", self.num_experts, 1)
        _check_int("expert_intermediate_size", self.expert_intermediate_size, 1)
        _check_int("num_moe_layers", self.num_moe_layers, 0)
        _check_int("shared_intermediate_size", self.shared_intermediate_size, 0)

    def params(self, hidden: int) -> int:
        """MLP weights of one MoE layer (formula in the class docstring)."""
        n = 3 * hidden * self.expert_intermediate_size * self.num_experts + hidden * self.num_experts
        n += 3 * hidden * self.shared_intermediate_size
        if self.shared_expert_gate:
            n += hidden
        return n


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a decoder-only transformer's config that sizing needs.

    :attr:`weight_params` estimates the parameter count of a Llama-style model (the shape shared by
    Llama, Mistral, Qwen2 and most current open models), with MLA and MoE variants:

    - embedding: ``vocab × hidden``
    - per layer, attention: ``hidden × heads·head_dim`` (Q) + ``2 × hidden × kv_heads·head_dim``
      (K, V) + ``heads·head_dim × hidden`` (O), plus ``heads·head_dim + 2·kv_heads·head_dim`` bias
      terms when ``attention_bias`` is set (Qwen2 has Q/K/V biases), plus ``2 × head_dim`` for
      per-head Q/K norms (``qk_norm``, Qwen3); with :attr:`mla`, :meth:`MLAConfig.params` instead
    - per layer, MLP: ``3 × hidden × intermediate`` (gated: gate, up and down projections); in the
      layers of a mixture of experts (:attr:`moe`), :meth:`MoEConfig.params` instead
    - per layer, two RMSNorm weight vectors (``2 × hidden``), plus one final norm (``hidden``)
    - LM head: ``vocab × hidden``, left out when ``tie_word_embeddings`` shares it with the embedding

    :attr:`weight_bytes` is that count times the dtype's size. It ignores quantization schemes,
    vision towers, multi-token-prediction heads and rotary tables; pass the real figure
    (``--weights``) when it is known.
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str = "bfloat16"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: Optional[int] = None
    qk_norm: bool = False
    mla: Optional[MLAConfig] = None
    moe: Optional[MoEConfig] = None

    def __post_init__(self) -> None:
        for field_name in ("hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
                           "num_kv_heads", "head_dim", "vocab_size"):
            _check_int(field_name, getattr(self, field_name), 1)
        if self.num_attention_heads % self.num_kv_heads:
            raise InvalidConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention"
            )
        if self.max_position_embeddings is not None:
            _check_int("max_position_embeddings", self.max_position_embeddings, 1)
        for field_name in ("tie_word_embeddings", "attention_bias"):
            value = getattr(self, field_name)
            if not isinstance(value, bool):
                # `bool("false")` is True: a flag must be a bool (a JSON true/false).
                raise InvalidConfigError(
                    f"{field_name} must be a bool, got {value!r}",
                    field=field_name, value=value, reason="must be a bool",
                )
        if self.mla is not None and not isinstance(self.mla, MLAConfig):
            raise InvalidConfigError(f"mla must be an MLAConfig, got {type(self.mla).__name__}")
        if self.moe is not None:
            if not isinstance(self.moe, MoEConfig):
                raise InvalidConfigError(f"moe must be a MoEConfig, got {type(self.moe).__name__}")
            if self.moe.num_moe_layers > self.num_layers:
                raise InvalidConfigError(
                    f"num_moe_layers ({self.moe.num_moe_layers}) exceeds num_layers ({self.num_layers})"
                )
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer; 1 for a dense model."""
        return 1 if self.moe is None else self.moe.num_experts

    def cache_spec(self, *, block_size: int = DEFAULT_BLOCK_SIZE, dtype: str | None = None) -> CacheSpec:
        """The KV cache spec of this model; ``dtype`` overrides the weight dtype for the cache.

        For MLA: one latent of ``kv_lora_rank + qk_rope_head_dim`` elements per token per layer.
        """
        if self.mla is not None:
            return CacheSpec(num_layers=self.num_layers, num_kv_heads=1, head_dim=self.mla.latent_dim,
                             dtype=self.dtype if dtype is None else dtype, block_size=block_size,
                             mla=True)
        return CacheSpec(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype if dtype is None else dtype,
            block_size=block_size,
        )

    @property
    def weight_params(self) -> int:
        """Estimated parameter count (formula in the class docstring)."""
        h = self.hidden_size
        if self.mla is not None:
            attn = self.mla.params(h, self.num_attention_heads, self.attention_bias)
        else:
            q_dim = self.num_attention_heads * self.head_dim
            kv_dim = self.num_kv_heads * self.head_dim
            attn = h * q_dim + 2 * h * kv_dim + q_dim * h
            if self.attention_bias:
                attn += q_dim + 2 * kv_dim
            if self.qk_norm:
                attn += 2 * self.head_dim
        dense_mlp = 3 * h * self.intermediate_size
        norms = 2 * h
        num_moe = 0 if self.moe is None else self.moe.num_moe_layers
        layers = self.num_layers * (attn + norms) + (self.num_layers - num_moe) * dense_mlp
        if self.moe is not None:
            layers += num_moe * self.moe.params(h)
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + layers + h + lm_head

    @property
    def weight_bytes(self) -> int:
        """Estimated weight bytes: :attr:`weight_params` × bytes of :attr:`dtype`."""
        return self.weight_params * DTYPE_BYTES[self.dtype]

    @classmethod
    def from_hf_config(
        cls,
        source: Union[str, "os.PathLike[str]", Mapping[str, Any]],
        *,
        dtype: str | None = None,
        name: str | None = None,
    ) -> "ModelConfig":
        """Parse a Hugging Face ``config.json`` (path, directory holding one, or an already-loaded dict).

        Reads ``num_hidden_layers``, ``num_key_value_heads`` (falling back to
        ``num_attention_heads``: plain multi-head attention), ``head_dim`` (falling back to
        ``hidden_size / num_attention_heads``), ``torch_dtype`` or ``dtype``, ``hidden_size``,
        ``intermediate_size``, ``vocab_size``, ``tie_word_embeddings``, ``attention_bias`` (or
        ``qkv_bias``) and ``max_position_embeddings``. Multimodal configs that nest the language
        model under ``text_config`` are read from there.

        MLA (``kv_lora_rank`` set): ``qk_rope_head_dim``, ``qk_nope_head_dim``, ``v_head_dim``,
        ``q_lora_rank``. MoE (``n_routed_experts``, ``num_local_experts`` or ``num_experts``):
        ``moe_intermediate_size`` (else ``intermediate_size``), ``n_shared_experts`` or
        ``shared_expert_intermediate_size``, and which layers are dense: ``first_k_dense_replace``
        and ``moe_layer_freq`` (DeepSeek), ``decoder_sparse_step`` and ``mlp_only_layers`` (Qwen).

        A config this cannot size — layers without a KV cache (state-space or linear-attention
        hybrids), an encoder-decoder, an MoE or MLA block missing its sizes — raises
        :class:`InvalidConfigError` saying why, rather than returning a wrong figure.
        """
        cfg, origin = _load_config_dict(source)
        if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
            outer_dtype = cfg.get("torch_dtype") or cfg.get("dtype")
            cfg = dict(cfg["text_config"])
            if outer_dtype and not (cfg.get("torch_dtype") or cfg.get("dtype")):
                cfg["torch_dtype"] = outer_dtype

        def need(key: str) -> Any:
            value = cfg.get(key)
            if value is None:
                raise InvalidConfigError(f"{origin}: missing required field {key!r}")
            return value

        _refuse_unsizable(cfg, origin)
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads")
        if kv_heads is None:
            kv_heads = heads
        if dtype is None:
            dtype = cfg.get("torch_dtype") or cfg.get("dtype")
            if dtype is None:
                raise InvalidConfigError(f"{origin}: no 'torch_dtype' or 'dtype' field; pass the dtype explicitly")
        model_type = str(cfg.get("model_type", ""))
        attention_bias = cfg.get("attention_bias")
        if attention_bias is None:
            attention_bias = cfg.get("qkv_bias")
        if attention_bias is None:
            # Qwen2 and Qwen2-MoE configs do not spell out their Q/K/V biases (on by default).
            attention_bias = model_type.startswith("qwen2")
        num_layers = need("num_hidden_layers")
        try:
            mla = _parse_mla(cfg, need)
            head_dim = cfg.get("head_dim")
            if mla is not None:
                head_dim = mla.qk_head_dim
            elif head_dim is None:
                if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0 or hidden % heads:
                    raise InvalidConfigError(
                        f"no head_dim, and hidden_size ({hidden!r}) is not a multiple of "
                        f"num_attention_heads ({heads!r})"
                    )
                head_dim = hidden // heads
            return cls(
                name=name or str(cfg.get("_name_or_path") or model_type or origin),
                hidden_size=hidden,
                intermediate_size=need("intermediate_size"),
                num_layers=num_layers,
                num_attention_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                vocab_size=need("vocab_size"),
                dtype=dtype,
                tie_word_embeddings=cfg.get("tie_word_embeddings", False),
                attention_bias=attention_bias,
                max_position_embeddings=cfg.get("max_position_embeddings"),
                # Qwen3 (dense and MoE) normalises each head's Q and K.
                qk_norm=mla is None and model_type.startswith("qwen3"),
                mla=mla,
                moe=_parse_moe(cfg, num_layers),
            )
        except InvalidConfigError as exc:
            if str(exc).startswith(origin):
                raise
            raise InvalidConfigError(f"{origin}: {exc}") from None


# Keys whose presence means some layers keep no (or not only a) per-token KV cache: state-space and
# linear-attention hybrids. Sizing them as attention everywhere would overstate the cache.
_UNSIZABLE_KEYS = ("hybrid_override_pattern", "layers_block_type", "attn_layer_indices", "mamba_d_state",
                   "ssm_state_size", "linear_num_value_heads", "attn_type_list")
# Per-layer kinds in ``layer_types`` that keep a KV cache for every token (a sliding window is
# cached in full here: the manager does not drop blocks that leave the window).
_KV_LAYER_TYPES = {"full_attention", "sliding_attention", "attention", "chunked_attention"}


def _refuse_unsizable(cfg: Mapping[str, Any], origin: str) -> None:
    def refuse(why: str) -> None:
        raise InvalidConfigError(f"{origin}: cannot size this model's KV cache: {why}")

    if cfg.get("is_encoder_decoder"):
        refuse("it is an encoder-decoder model; only decoder-only models are supported")
    for key in _UNSIZABLE_KEYS:
        if cfg.get(key) is not None:
            refuse(f"'{key}' marks layers that are not attention (a state-space or linear-attention "
                   "hybrid); their state is not a per-token paged cache")
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, (list, tuple)):
        other = sorted({str(t) for t in layer_types} - _KV_LAYER_TYPES)
        if other:
            refuse(f"layer_types holds {', '.join(repr(t) for t in other)}, which keep no per-token KV cache")
    if isinstance(cfg.get("ffn_config"), Mapping):
        refuse("its MLP sizes are nested in 'ffn_config' (DBRX layout), which is not read")


def _parse_mla(cfg: Mapping[str, Any], need: Any) -> Optional[MLAConfig]:
    if cfg.get("kv_lora_rank") is None:
        return None
    return MLAConfig(
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_rope_head_dim=need("qk_rope_head_dim"),
        qk_nope_head_dim=need("qk_nope_head_dim"),
        v_head_dim=need("v_head_dim"),
        q_lora_rank=cfg.get("q_lora_rank"),
    )


def _parse_moe(cfg: Mapping[str, Any], num_layers: int) -> Optional[MoEConfig]:
    experts = None
    for key in ("n_routed_experts", "num_local_experts", "num_experts"):
        if cfg.get(key) is not None:
            experts = cfg[key]
            break
    if experts is None or experts == 1:
        return None
    _check_int("num_experts", experts, 1)
    _check_int("num_hidden_layers", num_layers, 1)
    size = cfg.get("moe_intermediate_size")
    if size is None:
        size = cfg.get("intermediate_size")
    if size is None:
        raise InvalidConfigError("an MoE config needs 'moe_intermediate_size' or 'intermediate_size'")
    # Which layers route to experts: DeepSeek keeps the first `first_k_dense_replace` dense and puts
    # experts every `moe_layer_freq` layers; Qwen-MoE puts them where (i + 1) % decoder_sparse_step
    # == 0, outside `mlp_only_layers`. Each model sets only its own keys; the defaults are neutral.
    first_dense = cfg.get("first_k_dense_replace") or 0
    freq = cfg.get("moe_layer_freq") or 1
    step = cfg.get("decoder_sparse_step") or 1
    mlp_only = cfg.get("mlp_only_layers") or []
    for key, value, lo in (("first_k_dense_replace", first_dense, 0), ("moe_layer_freq", freq, 1),
                           ("decoder_sparse_step", step, 1)):
        _check_int(key, value, lo)
    if not isinstance(mlp_only, (list, tuple)) or not all(isinstance(i, int) for i in mlp_only):
        raise InvalidConfigError(f"mlp_only_layers must be a list of layer indices, got {mlp_only!r}")
    dense = set(mlp_only)
    moe_layers = sum(1 for i in range(num_layers)
                     if i >= first_dense and i % freq == 0 and (i + 1) % step == 0 and i not in dense)
    shared = 0
    gate = False
    if cfg.get("n_shared_experts"):
        _check_int("n_shared_experts", cfg["n_shared_experts"], 0)
        shared = cfg["n_shared_experts"] * size
    elif cfg.get("shared_expert_intermediate_size"):
        shared = cfg["shared_expert_intermediate_size"]
        gate = True  # Qwen-MoE scales its shared expert by a learned sigmoid gate
    return MoEConfig(num_experts=experts, expert_intermediate_size=size, num_moe_layers=moe_layers,
                     shared_intermediate_size=shared, shared_expert_gate=gate)


def _load_config_dict(source: Union[str, "os.PathLike[str]", Mapping[str, Any]]) -> tuple[Mapping[str, Any], str]:
    if isinstance(source, Mapping):
        return source, "config"
    if not isinstance(source, (str, os.PathLike)):
        raise InvalidConfigError(f"expected a path to config.json or a dict, got {type(source).__name__}")
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise InvalidConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidConfigError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InvalidConfigError(f"{path}: not valid JSON: {exc}") from None
    except RecursionError:
        # json's decoder recurses once per nesting level; no config.json nests more than a few.
        raise InvalidConfigError(f"{path}: not a usable config: JSON nested too deeply") from None
    if not isinstance(data, Mapping):
        raise InvalidConfigError(f"{path}: expected a JSON object at the top level")
    return data, path


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
    )
}


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name`` (case-insensitive); :class:`InvalidConfigError` listing the known ones."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in PRESETS:
        raise InvalidConfigError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[key]


@dataclass(frozen=True)
class MemoryBudget:
    """How a device's memory splits between weights, activations, graphs and the KV pool.

    ``utilization`` is the fraction of ``total_bytes`` the server may use at all (the rest is left
    to the CUDA context, fragmentation and other processes). The KV pool gets what remains:
    ``floor(total × utilization) − weights − activation peak − graph reserve``.
    """

    total_bytes: int
    weights_bytes: int = 0
    activation_peak_bytes: int = 0
    graph_reserve_bytes: int = 0
    utilization: float = 0.9

    def __post_init__(self) -> None:
        _check_int("total_bytes", self.total_bytes, 1)
        _check_int("weights_bytes", self.weights_bytes, 0)
        _check_int("activation_peak_bytes", self.activation_peak_bytes, 0)
        _check_int("graph_reserve_bytes", self.graph_reserve_bytes, 0)
        u = self.utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not math.isfinite(u) or not 0 < u <= 1:
            raise InvalidConfigError(f"utilization must be in (0, 1], got {u!r}")

    @property
    def usable_bytes(self) -> int:
        """``floor(total × utilization)``, exact (no float rounding at the byte level)."""
        return math.floor(self.total_bytes * Fraction(str(self.utilization)))

    @property
    def kv_bytes(self) -> int:
        """Bytes left for the KV pool; negative when the other terms do not fit."""
        return self.usable_bytes - self.weights_bytes - self.activation_peak_bytes - self.graph_reserve_bytes

    def num_blocks(self, spec: CacheSpec) -> int:
        """Blocks of ``spec`` that fit in :attr:`kv_bytes`; :class:`CapacityError` when none do."""
        if not isinstance(spec, CacheSpec):
            raise InvalidConfigError(f"spec must be a CacheSpec, got {type(spec).__name__}")
        kv = self.kv_bytes
        blocks = kv // spec.bytes_per_block if kv > 0 else 0
        if blocks < 1:
            raise CapacityError(
                "no room for a KV block: "
                f"total {format_bytes(self.total_bytes)} × utilization {self.utilization} = "
                f"{format_bytes(self.usable_bytes)}, − weights {format_bytes(self.weights_bytes)}"
                f" − activation peak {format_bytes(self.activation_peak_bytes)}"
                f" − graph reserve {format_bytes(self.graph_reserve_bytes)}"
                f" = {format_bytes(kv)} for the KV pool, "
                f"but one block needs {format_bytes(spec.bytes_per_block)}"
            )
        # The core addresses blocks with u32 ids and reserves u32::MAX.
        if blocks >= 2**32 - 1:
            raise CapacityError(f"{blocks} blocks exceed the core's u32 block ids; use a larger block_size")
        return blocks


def num_blocks_for(
    spec: CacheSpec,
    total_bytes: int,
    weights_bytes: int = 0,
    activation_peak_bytes: int = 0,
    graph_reserve_bytes: int = 0,
    utilization: float = 0.9,
) -> int:
    """``floor((total × utilization − weights − activation peak − graph reserve) / bytes_per_block)``.

    Raises :class:`CapacityError` naming every term when the result would be zero or less.
    """
    budget = MemoryBudget(
        total_bytes=total_bytes,
        weights_bytes=weights_bytes,
        activation_peak_bytes=activation_peak_bytes,
        graph_reserve_bytes=graph_reserve_bytes,
        utilization=utilization,
    )
    return budget.num_blocks(spec)


_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
# Far above any real size (2**64 bytes has 20 digits), and far below Python's 4300-digit limit
# on int() of a string, which would otherwise surface as a bare ValueError.
_MAX_SIZE_CHARS = 64
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: Union[str, int]) -> int:
    """Parse ``"80GiB"``, ``"80GB"``, ``"1.5 TiB"``, ``"4096"`` (bytes) into an integer byte count.

    GB/MB/KB/TB are decimal (10⁹…), GiB/MiB/KiB/TiB binary (2³⁰…). A bare ``G``/``M`` is refused as
    ambiguous rather than guessed. Fractions of a byte round down.

    Raises:
        InvalidConfigError: Not a size, a negative int, an unknown unit, or longer than 64
            characters.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidConfigError(f"size must be >= 0, got {text}")
        return text
    if not isinstance(text, str):
        raise InvalidConfigError(f"size must be a string like '80GiB', got {text!r}")
    if len(text) > _MAX_SIZE_CHARS:
        raise InvalidConfigError(
            f"size {text[:20]!r}... is {len(text)} characters long; a size has at most "
            f"{_MAX_SIZE_CHARS} (e.g. '80GiB')", field="size", value=len(text),
            reason=f"at most {_MAX_SIZE_CHARS} characters")
    match = _SIZE_RE.match(text)
    if not match:
        raise InvalidConfigError(f"cannot parse size {text!r}; expected e.g. '80GiB', '80GB' or '4096'")
    number, unit = match.groups()
    unit = unit.lower() or "b"
    if unit not in _UNITS:
        raise InvalidConfigError(
            f"unknown size unit {match.group(2)!r} in {text!r}; use B, KB, MB, GB, TB (decimal) "
            "or KiB, MiB, GiB, TiB (binary)"
        )
    return math.floor(Fraction(number) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """Human-readable binary size, e.g. ``format_bytes(131072) == "128.00 KiB"``; sign kept."""
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
