"""Scatter: write new K/V tokens into the paged pool through the slot mapping.

Owns `scatter_kv`. Layouts: `key`/`value` are `[num_tokens, kv_heads, head_dim]` (the token stride
may be anything, e.g. a slice of a fused QKV output; heads and head_dim must be packed), the pool
tensors are `[num_blocks, block_size, kv_heads, head_dim]` contiguous, `slot_mapping` is int64
`[num_tokens]` with `slot = block * block_size + offset`.

Invariants: a token whose slot is negative (padding) or not below `num_blocks * block_size` is
skipped, so a padded or stale entry can never write outside the pool; every other token's row is
written exactly once (the slot mapping of one step has no duplicate valid slots). In the
contiguous pool a slot's `kv_heads * head_dim` elements are one packed row, so the kernel is a
row gather/scatter with wide vector loads and stores.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _launch as L
from . import _validate as v

__all__ = ["scatter_kv"]


@triton.jit
def _round_e4m3(x):
    """`x` (fp32) rounded to the nearest float8_e4m3fn value (ties to even), saturated to +-448.

    Done in fp32 so the final conversion is exact: the GPU's and the interpreter's fp32 -> fp8
    conversions then agree (the interpreter's truncates; the hardware's rounds to nearest).
    The spacing of e4m3 values around x is 2^(e - 3) for the exponent e of x (2^-9 below the
    normal range); adding and removing 1.5 * 2^23 rounds x / spacing to an integer."""
    a = tl.minimum(tl.abs(x), 448.0)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
    r = ((a * inv + 12582912.0) - 12582912.0) * ulp
    # The sign is put back last, so a value that rounds to zero keeps it (-0.0, as torch gives).
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _scatter_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    ksc_ptr,
    vsc_ptr,
    num_tokens,
    num_slots,
    stride_kt,
    stride_vt,
    scale_stride,
    ROW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    STREAM: tl.constexpr,
    QUANT: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = offs_t < num_tokens
    slot = tl.load(slot_ptr + offs_t, mask=t_ok, other=-1)
    ok = t_ok & (slot >= 0) & (slot < num_slots)
    c_ok = offs_c < ROW
    m = ok[:, None] & c_ok[None, :]
    src_t = offs_t.to(tl.int64)
    dst = slot.to(tl.int64)[:, None] * ROW + offs_c[None, :]
    if QUANT:
        # fp8 cache: store x / scale (the scale of the column's kv head), saturated to the
        # largest finite e4m3 value so an outlier clips instead of becoming NaN.
        hs = (offs_c // HEAD_DIM) * scale_stride
        inv_k = 1.0 / tl.load(ksc_ptr + hs, mask=c_ok, other=1.0)
        inv_v = 1.0 / tl.load(vsc_ptr + hs, mask=c_ok, other=1.0)
        k = tl.load(key_ptr + src_t[:, None] * stride_kt + offs_c[None, :], mask=m)
        val = tl.load(value_ptr + src_t[:, None] * stride_vt + offs_c[None, :], mask=m)
        k = _round_e4m3(k.to(tl.float32) * inv_k[None, :])
        val = _round_e4m3(val.to(tl.float32) * inv_v[None, :])
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=m)
        tl.store(v_cache_ptr + dst, val.to(v_cache_ptr.dtype.element_ty), mask=m)
    elif STREAM:
        # New K/V is read once and the pool row is not read again this step: keep neither in L2.
        k = tl.load(key_ptr + src_t[:, None] * stride_kt + offs_c[None, :], mask=m,
                    eviction_policy="evict_first")
        val = tl.load(value_ptr + src_t[:, None] * stride_vt + offs_c[None, :], mask=m,
                      eviction_policy="evict_first")
        tl.store(k_cache_ptr + dst, k, mask=m, cache_modifier=".cs")
        tl.store(v_cache_ptr + dst, val, mask=m, cache_modifier=".cs")
    else:
        k = tl.load(key_ptr + src_t[:, None] * stride_kt + offs_c[None, :], mask=m)
        val = tl.load(value_ptr + src_t[:, None] * stride_vt + offs_c[None, :], mask=m)
        tl.store(k_cache_ptr + dst, k, mask=m)
        tl.store(v_cache_ptr + dst, val, mask=m)


#: Launch parameters of the scatter kernel (`config=` overrides them; for tuning).
SCATTER_CONFIG = {"ELEMS": 4096, "num_warps": 4, "STREAM": False}


def _tile(row: int, elems: int = 4096) -> tuple:
    # About `elems` elements per tensor per program: large enough for 16-byte accesses across
    # all threads, small enough that 8192 tokens give thousands of programs to spread over SMs.
    block_c = min(triton.next_power_of_2(row), elems)
    block_t = max(1, elems // block_c)
    return block_t, block_c


_CACHE = L.LaunchCache()


def scatter_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_indices: bool = False,
    config: Optional[dict] = None,
    k_scale=None,
    v_scale=None,
) -> None:
    """Writes `key[i]`/`value[i]` into slot `slot_mapping[i]` of `k_cache`/`v_cache`, in place.

    Negative slots are padding and skipped; slots past the pool are skipped too. With
    `check_indices=True` the slots are range-checked on the host first (this synchronizes, so it
    is for debugging, not for CUDA graphs) and a bad one raises `KernelIndexError`. The checks
    and the launch configuration are cached per call signature (shapes, strides, dtypes,
    devices, alignment; see `_launch.py`), so a repeated signature costs a few microseconds of
    host time. `config` overrides `SCATTER_CONFIG` (for tuning).

    fp8 cache (`float8_e4m3fn` pool, `key`/`value` in bf16, fp16 or fp32): each value is stored
    as `x / scale` saturated to +-448, with `k_scale`/`v_scale` a float (per tensor) or a
    float32 tensor `[kv_heads]` (per kv head; per layer, as each layer has its own pool).
    """
    lkey = None
    if not check_indices:
        try:
            lkey = (L.tensor_key(key), L.tensor_key(value), L.tensor_key(k_cache),
                    L.tensor_key(v_cache), L.tensor_key(slot_mapping),
                    None if config is None else tuple(sorted(config.items())),
                    v.scale_key(k_scale), v.scale_key(v_scale))
            call = _CACHE.get(lkey)
        except (AttributeError, TypeError):
            lkey = call = None
        if call is not None:
            if call[0] is not None:
                # A float scale's tensor lives in the call; a tensor scale comes per call;
                # without fp8 the slot mapping stands in (never read).
                ks = call[2] if call[2] is not None else (
                    k_scale if k_scale is not None else slot_mapping)
                vs = call[3] if call[3] is not None else (
                    v_scale if v_scale is not None else slot_mapping)
                call[0](call[1], key, value, k_cache, v_cache, slot_mapping, ks, vs)
            return
    call = _prepare(key, value, k_cache, v_cache, slot_mapping, check_indices, config, k_scale,
                    v_scale)
    if lkey is not None:
        _CACHE.put(lkey, call)
    if call[0] is not None:
        call[0](call[1], key, value, k_cache, v_cache, slot_mapping, call[4], call[5])


def _prepare(key, value, k_cache, v_cache, slot_mapping, check_indices, config, k_scale,
             v_scale):
    num_blocks, block_size, kv_heads, head_dim = v.check_cache_pair(k_cache, v_cache)
    dev = k_cache.device
    fp8 = k_cache.dtype == v.FP8
    v.check_tensor("key", key, ndim=3, dtypes=v.act_dtypes(k_cache.dtype))
    v.check_tensor("value", value, ndim=3, dtypes=(key.dtype,))
    ks, vs, k_stride = v.kv_scales(k_scale, v_scale, kv_heads, dev, fp8)
    v.check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,))
    v.check_same_device(dev, key=key, value=value, slot_mapping=slot_mapping)
    v.ensure_launchable(dev)
    v.check_dim("key", key, 1, kv_heads, "kv_heads of the pool")
    v.check_dim("key", key, 2, head_dim, "head_dim of the pool")
    if tuple(value.shape) != tuple(key.shape):
        raise v.KernelShapeError(
            f"value: shape is {tuple(value.shape)}, expected {tuple(key.shape)} (as key)"
        )
    num_tokens = key.shape[0]
    v.check_dim("slot_mapping", slot_mapping, 0, num_tokens, "one slot per token of key")
    v.check_inner_contiguous("key", key, 2)
    v.check_inner_contiguous("value", value, 2)
    v.check_contiguous("slot_mapping", slot_mapping)
    num_slots = num_blocks * block_size
    if check_indices and num_tokens:
        bad = (slot_mapping >= num_slots).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise v.KernelIndexError(
                f"slot_mapping[{i}]: is {int(slot_mapping[i])}, expected < {num_slots} "
                f"(num_blocks * block_size) or negative for padding"
            )
    cfg = v.merge_config(dict(SCATTER_CONFIG), config)
    if num_tokens == 0:
        return (None, None, None, None, None, None)
    row = kv_heads * head_dim
    block_t, block_c = _tile(row, cfg["ELEMS"])
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(row, block_c))
    launch = L.Launch(
        _scatter_kernel,
        (num_tokens, num_slots, key.stride(0), value.stride(0), k_stride),
        dict(ROW=row, HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_C=block_c,
             STREAM=bool(cfg["STREAM"]), QUANT=fp8, num_warps=cfg["num_warps"]),
    )
    # Scales: a float's device tensor is kept with the call (its value is in the signature);
    # a tensor is passed per call. Without fp8 the slot mapping stands in (never read).
    own_k = ks if fp8 and not isinstance(k_scale, torch.Tensor) else None
    own_v = vs if fp8 and not isinstance(v_scale, torch.Tensor) else None
    return (launch, grid, own_k, own_v, ks if fp8 else slot_mapping, vs if fp8 else slot_mapping)
