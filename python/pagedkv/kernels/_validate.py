"""Argument checks shared by the kernel entry points.

Owns the kernel error classes (subclasses of `pagedkv.errors.PagedKVError` and of `ValueError` or
`TypeError`) and the helpers that check a tensor's dtype, rank, shape, device and layout before
anything is launched. Invariant: every public kernel function calls these first, so a
bad argument raises here (naming the argument, the value found and the value expected) and no
kernel ever runs on it; nothing is written before the checks pass.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..errors import PagedKVError

__all__ = [
    "KernelArgumentError",
    "KernelShapeError",
    "KernelDTypeError",
    "KernelDeviceError",
    "KernelLayoutError",
    "KernelIndexError",
    "merge_config",
]

#: Cache dtypes the attention and scatter kernels accept. fp32 exists for tests; float8_e4m3fn
#: is the quantized cache (an entry holds x / scale, see `kv_scale`).
FP8 = torch.float8_e4m3fn
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8)
#: Activation (q, new K/V, out) dtypes an fp8 cache serves.
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Largest finite float8_e4m3fn value: quantization saturates there.
FP8_MAX = 448.0


def act_dtypes(cache_dtype: torch.dtype) -> tuple:
    """dtypes `q`/`key`/`value` may have for a cache of `cache_dtype`."""
    return ACT_DTYPES if cache_dtype == FP8 else (cache_dtype,)


def kv_scale(name: str, scale, kv_heads: int, device: torch.device, fp8: bool):
    """Checks a K or V scale; returns (float32 device tensor or None, stride per kv head).

    `scale` is None (1.0), a positive float (one scale for the tensor), or a float32 tensor of 1
    element or `kv_heads` elements (one per kv head) on the pool's device. An fp8 cache entry
    holds `x / scale` (saturated to +-448); reading multiplies by `scale`. A non-fp8 cache takes
    no scale (None only).
    """
    if not fp8:
        if scale is not None:
            raise KernelArgumentError(f"{name}: given for a non-fp8 cache, expected None")
        return None, 0
    if scale is None:
        scale = 1.0
    if isinstance(scale, torch.Tensor):
        if scale.dtype != torch.float32:
            raise KernelDTypeError(f"{name}: dtype is {scale.dtype}, expected torch.float32")
        if scale.numel() not in (1, kv_heads) or scale.dim() > 1:
            raise KernelShapeError(
                f"{name}: shape is {tuple(scale.shape)}, expected 1 or [{kv_heads}] (kv heads)"
            )
        check_same_device(device, **{name: scale})
        if scale.numel() > 1:
            check_contiguous(name, scale)
        return scale, (1 if scale.numel() > 1 else 0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise KernelDTypeError(f"{name}: expected a float or a tensor, got {type(scale).__name__}")
    s = float(scale)
    if not (s > 0.0 and s < float("inf")):
        raise KernelArgumentError(f"{name}: is {scale}, expected a finite positive number")
    return torch.full((1,), s, dtype=torch.float32, device=device), 0


def kv_scales(k_scale, v_scale, kv_heads: int, device: torch.device, fp8: bool):
    """Checks a K and V scale pair (each as `kv_scale`); returns (k tensor, v tensor, stride per
    kv head). On an fp8 cache both must be of one kind: per tensor or per kv head."""
    ks, k_stride = kv_scale("k_scale", k_scale, kv_heads, device, fp8)
    vs, v_stride = kv_scale("v_scale", v_scale, kv_heads, device, fp8)
    if fp8 and k_stride != v_stride:
        raise KernelShapeError(
            "v_scale: per-kv-head and per-tensor scales mixed, expected k_scale and v_scale "
            "of one kind"
        )
    return ks, vs, k_stride


def scale_key(scale):
    """The part of a call signature a scale contributes (a tensor's metadata, or the value)."""
    if isinstance(scale, torch.Tensor):
        return ("t", scale.shape, scale.stride(), scale.dtype, scale.get_device(),
                scale.data_ptr() & 15)
    return scale


class KernelArgumentError(PagedKVError, ValueError):
    """Base class: a kernel argument does not meet the function's contract."""


class KernelShapeError(KernelArgumentError):
    """Wrong rank, shape or size."""


class KernelDeviceError(KernelArgumentError):
    """Tensors on the wrong device, or on different devices."""


class KernelLayoutError(KernelArgumentError):
    """A stride/contiguity requirement is not met."""


class KernelIndexError(KernelArgumentError):
    """An index (slot, block id, sequence length) is out of range (only raised by debug checks)."""


class KernelDTypeError(PagedKVError, TypeError):
    """A tensor has a dtype the kernel does not accept."""


def _fmt_dtypes(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d) for d in dtypes)


def check_tensor(name: str, t, *, ndim: int, dtypes: Sequence[torch.dtype]) -> None:
    """Checks that `t` is a tensor of rank `ndim` with one of `dtypes`."""
    if not isinstance(t, torch.Tensor):
        raise KernelDTypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise KernelDTypeError(f"{name}: dtype is {t.dtype}, expected {_fmt_dtypes(dtypes)}")
    if t.dim() != ndim:
        raise KernelShapeError(
            f"{name}: has {t.dim()} dimensions (shape {tuple(t.shape)}), expected {ndim}"
        )


def check_dim(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if t.shape[dim] != expected:
        raise KernelShapeError(
            f"{name}: size of dim {dim} is {t.shape[dim]}, expected {expected} ({what})"
        )


def check_min_dim(name: str, t: torch.Tensor, dim: int, minimum: int, what: str) -> None:
    if t.shape[dim] < minimum:
        raise KernelShapeError(
            f"{name}: size of dim {dim} is {t.shape[dim]}, expected at least {minimum} ({what})"
        )


def check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise KernelDeviceError(f"{name}: is on {t.device}, expected {device}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise KernelLayoutError(
            f"{name}: strides {t.stride()} are not contiguous for shape {tuple(t.shape)}"
        )


def check_inner_contiguous(name: str, t: torch.Tensor, ninner: int) -> None:
    """The last `ninner` dims must be packed row-major (outer dims may have any stride)."""
    expected = 1
    for d in range(t.dim() - 1, t.dim() - 1 - ninner, -1):
        if t.shape[d] != 1 and t.stride(d) != expected:
            want = []
            e = 1
            for dd in range(t.dim() - 1, t.dim() - 1 - ninner, -1):
                want.append(e)
                e *= t.shape[dd]
            raise KernelLayoutError(
                f"{name}: the last {ninner} dims must be contiguous; strides are {t.stride()}, "
                f"expected the last {ninner} to be {tuple(reversed(want))}"
            )
        expected *= t.shape[d]


def check_pow2(name: str, value: int, lo: int, hi: int) -> None:
    if value < lo or value > hi or value & (value - 1):
        raise KernelShapeError(f"{name}: is {value}, expected a power of two in [{lo}, {hi}]")


def check_cache_pair(
    k_cache, v_cache, *, names: tuple = ("k_cache", "v_cache")
) -> tuple:
    """Checks one layer's K and V pool tensors; returns (num_blocks, block_size, kv_heads, head_dim)."""
    kn, vn = names
    check_tensor(kn, k_cache, ndim=4, dtypes=CACHE_DTYPES)
    check_tensor(vn, v_cache, ndim=4, dtypes=CACHE_DTYPES)
    if v_cache.dtype != k_cache.dtype:
        raise KernelDTypeError(f"{vn}: dtype is {v_cache.dtype}, expected {k_cache.dtype} (as {kn})")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise KernelShapeError(
            f"{vn}: shape is {tuple(v_cache.shape)}, expected {tuple(k_cache.shape)} (as {kn})"
        )
    check_same_device(k_cache.device, **{vn: v_cache})
    # The kernels address a token as block * stride(0) + offset * stride(1) + head * stride(2):
    # only head_dim has to be packed, but every pool we know of is fully contiguous, so the
    # simple rule is enforced and the strides are still passed explicitly.
    check_contiguous(kn, k_cache)
    check_contiguous(vn, v_cache)
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    check_pow2(f"{kn} block_size (dim 1)", block_size, 1, 1 << 16)
    check_pow2(f"{kn} head_dim (dim 3)", head_dim, 16, 512)
    if num_blocks < 1:
        raise KernelShapeError(f"{kn}: has {num_blocks} blocks, expected at least 1")
    if kv_heads < 1:
        raise KernelShapeError(f"{kn}: has {kv_heads} kv heads, expected at least 1")
    return num_blocks, block_size, kv_heads, head_dim


def check_scale(scale: Optional[float], head_dim: int) -> float:
    if scale is None:
        return 1.0 / float(head_dim) ** 0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise KernelDTypeError(f"scale: expected a float, got {type(scale).__name__}")
    s = float(scale)
    if not (s > 0.0 and s < float("inf")):
        raise KernelArgumentError(f"scale: is {scale}, expected a finite positive number")
    return s


def check_local(window, chunk) -> tuple:
    """Checks the local-attention bounds `window` and `chunk` (None, or an int >= 1); returns
    them as ints, 0 for None (the kernels' "unused")."""
    win = 0 if window is None else check_int("window", window, 1, 1 << 30)
    chk = 0 if chunk is None else check_int("chunk", chunk, 1, 1 << 30)
    return win, chk


def check_sinks(sinks, q_heads: int, device: torch.device) -> None:
    """Checks attention sinks: None, or a contiguous float tensor `[q_heads]` on `device`."""
    if sinks is None:
        return
    check_tensor("sinks", sinks, ndim=1, dtypes=ACT_DTYPES)
    check_dim("sinks", sinks, 0, q_heads, "one logit per query head")
    check_same_device(device, sinks=sinks)
    check_contiguous("sinks", sinks)


def check_int(name: str, value, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KernelDTypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise KernelArgumentError(f"{name}: is {value}, expected {rng}")
    return value


def ensure_launchable(device: torch.device) -> None:
    """Compiled Triton needs CUDA tensors; the interpreter (TRITON_INTERPRET=1) takes CPU ones."""
    import os

    if device.type == "cuda":
        return
    if os.environ.get("TRITON_INTERPRET", "0") == "1" and device.type == "cpu":
        return
    raise KernelDeviceError(
        f"tensors are on {device}, expected a CUDA device (or CPU with TRITON_INTERPRET=1)"
    )


def merge_config(defaults: dict, config: Optional[dict]) -> dict:
    """A kernel's launch ``defaults`` with the caller's ``config`` overrides (for tuning and
    tests); a key the kernel does not have is a :class:`KernelArgumentError`."""
    if config is None:
        return defaults
    unknown = set(config) - set(defaults)
    if unknown:
        raise KernelArgumentError(
            f"config: unknown keys {sorted(unknown)}, expected some of {sorted(defaults)}"
        )
    return {**defaults, **config}
