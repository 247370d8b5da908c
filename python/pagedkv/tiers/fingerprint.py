"""The identity of a KV layout: what namespaces every tier below the host.

Owns :func:`fingerprint`, a 16-byte digest of everything that decides what a block's bytes mean —
model id, dtype, block size, layout dimensions, tensor-parallel rank and size, and the record format
version. Two engines share blocks through a tier exactly when their fingerprints are equal; a
record carrying another fingerprint is foreign and never served.

Invariants: the digest is a pure function of its arguments (stable across processes, machines and
Python versions: fields are encoded explicitly, never through ``hash()`` or ``repr``); dtype
spellings are normalised (``"bf16"`` and ``"bfloat16"`` give one fingerprint).
"""

from __future__ import annotations

import struct
from typing import Any

import xxhash

from ..config import normalize_dtype
from ..errors import InvalidArgumentError, InvalidConfigError
from .record import FINGERPRINT_BYTES, FORMAT_VERSION

__all__ = ["fingerprint", "fingerprint_for_spec"]

_DOMAIN = b"pagedkv.tiers.fingerprint\x00"


def _positive(what: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(
            f"{what} must be an integer >= {minimum}, got {value!r}", what=what, value=value,
            reason=f"must be >= {minimum}",
        )
    return value


def _text(what: str, value: Any) -> bytes:
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(
            f"{what} must be a non-empty string, got {value!r}", what=what, value=value, reason="empty"
        )
    raw = value.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def fingerprint(
    model: str,
    dtype: str,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> bytes:
    """The 16-byte fingerprint (XXH3-128) of one engine's KV layout on one tensor-parallel rank.

    ``model`` should name the weights exactly (a hub id with its revision, or a path with a content
    digest): two different checkpoints under one name would read each other's blocks.
    """
    try:
        dtype_name = normalize_dtype(dtype)
    except InvalidConfigError:
        raise InvalidArgumentError(
            f"dtype {dtype!r} is not a KV dtype pagedkv knows", what="dtype", value=dtype,
            reason="unknown dtype",
        ) from None
    tp_size = _positive("tp_size", tp_size)
    tp_rank = _positive("tp_rank", tp_rank, 0)
    if tp_rank >= tp_size:
        raise InvalidArgumentError(
            f"tp_rank must be < tp_size ({tp_size}), got {tp_rank}", what="tp_rank", value=tp_rank,
            reason=f"must be < {tp_size}",
        )
    dims = struct.pack(
        "<IIIIIII",
        FORMAT_VERSION,
        _positive("block_size", block_size),
        _positive("num_layers", num_layers),
        _positive("num_kv_heads", num_kv_heads),
        _positive("head_dim", head_dim),
        tp_rank,
        tp_size,
    )
    digest = xxhash.xxh3_128_digest(_DOMAIN + _text("model", model) + _text("dtype", dtype_name) + dims)
    assert len(digest) == FINGERPRINT_BYTES
    return digest


def fingerprint_for_spec(model: str, spec: Any, tp_rank: int = 0, tp_size: int = 1) -> bytes:
    """:func:`fingerprint` of a :class:`pagedkv.config.CacheSpec` (its dtype, block size, dims).

    An MLA spec (one latent per token) is told apart from a K/V spec of the same dims.
    """
    fp = fingerprint(
        model, spec.dtype, spec.block_size, spec.num_layers, spec.num_kv_heads, spec.head_dim, tp_rank, tp_size
    )
    if getattr(spec, "mla", False):
        fp = xxhash.xxh3_128_digest(b"mla\x00" + fp)
    return fp
