"""What a model is, for sizing: :class:`ModelConfig`, read from a Hugging Face ``config.json``.

Owns :class:`ModelConfig`: the fields needed to derive a :class:`~pagedkv.config.CacheSpec`
(:meth:`ModelConfig.cache_spec`) and to estimate the weights' size
(:attr:`ModelConfig.weight_params`), and :meth:`ModelConfig.from_hf_config`, which reads them with
the helpers of :mod:`pagedkv._config_hf`. Re-exported by :mod:`pagedkv.config`.

Each layer's attention kind (:attr:`ModelConfig.layer_kinds`: full, sliding window or chunked,
read by :func:`pagedkv.layer_groups.layer_kinds`) is kept as plain ``(kind, size)`` pairs, so the
presets need no extension import; :meth:`ModelConfig.kv_groups` gives them as
:class:`~pagedkv.groups.KVCacheGroup` objects for the grouping and the group-aware sizing
(:func:`pagedkv.config.size_groups`).

**Invariants.** Immutable and validated on construction; a config that cannot be sized is refused
with :class:`pagedkv.errors.InvalidConfigError` saying why, never sized as something else.
``layer_kinds`` is ``None`` (every layer full) or lists one valid kind per layer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, List, Mapping, Optional, Sequence, Tuple, Union

from ._checks import DEFAULT_BLOCK_SIZE
from ._config_hf import _load_config_dict, _parse_mla, _parse_moe, _refuse_unsizable
from ._config_layers import MLAConfig, MoEConfig
from ._config_spec import DTYPE_BYTES, CacheSpec, _check_int, normalize_dtype
from .errors import InvalidConfigError

if TYPE_CHECKING:
    from .groups import KVCacheGroup

#: One layer's attention kind as plain data: ``("full", 0)``, ``("sliding", window)``,
#: ``("chunked", chunk)``.
LayerKind = Tuple[str, int]


def normalize_layer_kinds(kinds: Any, num_layers: int) -> Optional[Tuple[LayerKind, ...]]:
    """``kinds`` (one per layer: :class:`~pagedkv.groups.KVCacheGroup` objects or ``(kind, size)``
    pairs) as a tuple of ``(kind, size)`` pairs; ``None`` stays ``None`` (every layer full).

    Raises:
        InvalidConfigError: Not one entry per layer, an unknown kind, a full layer with a size, or
            a window or chunk that is not an int in ``[1, 2**32 - 1]``.
    """
    if kinds is None:
        return None
    if isinstance(kinds, (str, bytes)) or not isinstance(kinds, Sequence) or len(kinds) != num_layers:
        raise InvalidConfigError(
            f"layer_kinds must list one attention kind per layer ({num_layers}), got "
            f"{kinds!r}"[:300], field="layer_kinds", value=kinds, reason="one kind per layer")
    out: List[LayerKind] = []
    for i, k in enumerate(kinds):
        pair = (getattr(k, "kind", None), getattr(k, "size", None)) if hasattr(k, "kind") else k
        if not isinstance(pair, (tuple, list)) or len(pair) not in (1, 2):
            raise InvalidConfigError(f"layer_kinds[{i}] = {k!r}: not an attention kind",
                                     field="layer_kinds", value=k, reason="not an attention kind")
        kind = pair[0]
        size = pair[1] if len(pair) == 2 else 0
        if kind not in ("full", "sliding", "chunked") or isinstance(size, bool) or (
                not isinstance(size, int)):
            raise InvalidConfigError(
                f"layer_kinds[{i}] = {k!r}: the kind must be 'full', 'sliding' or 'chunked' with "
                "an int size", field="layer_kinds", value=k, reason="unknown kind")
        if (kind == "full") != (size == 0) or not 0 <= size <= 2**32 - 1:
            raise InvalidConfigError(
                f"layer_kinds[{i}] = {k!r}: a full layer has size 0, a window or chunk is in "
                "[1, 2**32 - 1] tokens", field="layer_kinds", value=k, reason="size out of range")
        out.append((kind, size))
    return tuple(out)


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
    #: Each layer's attention kind, ``(kind, size)``; ``None``: every layer full.
    layer_kinds: Optional[Tuple[LayerKind, ...]] = None

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
        object.__setattr__(self, "layer_kinds",
                           normalize_layer_kinds(self.layer_kinds, self.num_layers))

    def kv_groups(self) -> List["KVCacheGroup"]:
        """Each layer's attention kind as a :class:`~pagedkv.groups.KVCacheGroup` (every layer
        full when :attr:`layer_kinds` is ``None``)."""
        from .groups import KVCacheGroup

        if self.layer_kinds is None:
            return [KVCacheGroup.full()] * self.num_layers
        return [KVCacheGroup(kind, size) for kind, size in self.layer_kinds]  # type: ignore[arg-type]

    @property
    def has_windowed_layers(self) -> bool:
        """Whether some layer is sliding or chunked (its KV cache groups can save memory)."""
        return self.layer_kinds is not None and any(k != "full" for k, _ in self.layer_kinds)

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
        ``q_lora_rank``. Each layer's attention kind: :func:`pagedkv.layer_groups.layer_kinds`
        (``layer_types``, ``sliding_window``, ``sliding_window_pattern``, ...). MoE (``n_routed_experts``, ``num_local_experts`` or ``num_experts``):
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
            model = cls(
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
            from .layer_groups import layer_kinds

            kinds = layer_kinds(cfg)
            if all(k.kind == "full" for k in kinds):
                return model
            return replace(model, layer_kinds=tuple(k.as_tuple() for k in kinds))
        except InvalidConfigError as exc:
            if str(exc).startswith(origin):
                raise
            raise InvalidConfigError(f"{origin}: {exc}") from None
