"""The KV cache's shape and element type: :class:`CacheSpec` and the dtypes it may be stored in.

Owns :data:`DTYPE_BYTES` (element sizes, by torch's names), :func:`normalize_dtype` (the spellings
seen in configs and on command lines mapped to those names), the integer check the configuration
classes share, and :class:`CacheSpec` (``bytes_per_token``, ``bytes_per_block``,
``blocks_for_tokens``). Re-exported by :mod:`pagedkv.config`.

**Invariants.** A :class:`CacheSpec` is immutable and validated on construction (its dtype
normalised); bad input raises :class:`pagedkv.errors.InvalidConfigError`. No torch import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Union

from ._checks import DEFAULT_BLOCK_SIZE, check_block_size
from .errors import InvalidConfigError


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
        from ._config_model import ModelConfig  # it builds CacheSpecs: imported when called

        return ModelConfig.from_hf_config(source, dtype=dtype).cache_spec(block_size=block_size)
