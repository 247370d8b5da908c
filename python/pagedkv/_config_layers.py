"""The parts of a model config that change its cache and weights: latent attention and experts.

Owns :class:`MLAConfig` (DeepSeek's multi-head latent attention: the latent a token caches and the
projections around it) and :class:`MoEConfig` (a mixture of experts, every expert's weights
counted). Re-exported by :mod:`pagedkv.config`.

**Invariants.** Both are immutable and validated on construction; bad input raises
:class:`pagedkv.errors.InvalidConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ._config_spec import _check_int


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
