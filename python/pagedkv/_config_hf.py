"""Reading a Hugging Face ``config.json`` for sizing: loading it and its latent-attention and expert fields.

Owns ``_load_config_dict`` (a path, a directory holding ``config.json``, or a mapping),
``_refuse_unsizable`` (state-space and linear-attention hybrids, whose cache this package cannot
size), ``_parse_mla`` and ``_parse_moe`` (:class:`~pagedkv.config.MLAConfig` /
:class:`~pagedkv.config.MoEConfig` from the config's fields), used by
:meth:`pagedkv.config.ModelConfig.from_hf_config`.

**Invariants.** Every failure (no file, unreadable, not JSON, nested too deeply, not an object, a
field missing or out of range, a model it cannot size) raises
:class:`pagedkv.errors.InvalidConfigError` naming the file or field; nothing is guessed.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional, Union

from ._config_layers import MLAConfig, MoEConfig
from ._config_spec import _check_int
from .errors import InvalidConfigError


# Keys whose presence means some layers keep no (or not only a) per-token KV cache: state-space and
# linear-attention hybrids. Sizing them as attention everywhere would overstate the cache.
_UNSIZABLE_KEYS = ("hybrid_override_pattern", "layers_block_type", "attn_layer_indices", "mamba_d_state",
                   "ssm_state_size", "linear_num_value_heads", "attn_type_list")
# Per-layer kinds in ``layer_types`` that keep a per-token KV cache (a sliding or chunked layer's
# blocks are released once no query reads them: ModelConfig.layer_kinds and the group sizing).
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
