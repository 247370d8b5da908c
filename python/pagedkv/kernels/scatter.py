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
def _scatter_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_tokens,
    num_slots,
    stride_kt,
    stride_vt,
    ROW: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    STREAM: tl.constexpr,
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
    if STREAM:
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
) -> None:
    """Writes `key[i]`/`value[i]` into slot `slot_mapping[i]` of `k_cache`/`v_cache`, in place.

    Negative slots are padding and skipped; slots past the pool are skipped too. With
    `check_indices=True` the slots are range-checked on the host first (this synchronizes, so it
    is for debugging, not for CUDA graphs) and a bad one raises `KernelIndexError`. The checks
    and the launch configuration are cached per call signature (shapes, strides, dtypes,
    devices, alignment; see `_launch.py`), so a repeated signature costs a few microseconds of
    host time. `config` overrides `SCATTER_CONFIG` (for tuning).
    """
    lkey = None
    if not check_indices:
        try:
            lkey = (L.tensor_key(key), L.tensor_key(value), L.tensor_key(k_cache),
                    L.tensor_key(v_cache), L.tensor_key(slot_mapping),
                    None if config is None else tuple(sorted(config.items())))
            call = _CACHE.get(lkey)
        except (AttributeError, TypeError):
            lkey = call = None
        if call is not None:
            if call[0] is not None:
                call[0](call[1], key, value, k_cache, v_cache, slot_mapping)
            return
    call = _prepare(key, value, k_cache, v_cache, slot_mapping, check_indices, config)
    if lkey is not None:
        _CACHE.put(lkey, call)
    if call[0] is not None:
        call[0](call[1], key, value, k_cache, v_cache, slot_mapping)


def _prepare(key, value, k_cache, v_cache, slot_mapping, check_indices, config):
    num_blocks, block_size, kv_heads, head_dim = v.check_cache_pair(k_cache, v_cache)
    dev = k_cache.device
    v.check_tensor("key", key, ndim=3, dtypes=(k_cache.dtype,))
    v.check_tensor("value", value, ndim=3, dtypes=(k_cache.dtype,))
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
    cfg = dict(SCATTER_CONFIG)
    if config is not None:
        unknown = set(config) - set(cfg)
        if unknown:
            raise v.KernelArgumentError(
                f"config: unknown keys {sorted(unknown)}, expected some of {sorted(cfg)}"
            )
        cfg.update(config)
    if num_tokens == 0:
        return (None, None)
    row = kv_heads * head_dim
    block_t, block_c = _tile(row, cfg["ELEMS"])
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(row, block_c))
    launch = L.Launch(
        _scatter_kernel,
        (num_tokens, num_slots, key.stride(0), value.stride(0)),
        dict(ROW=row, BLOCK_T=block_t, BLOCK_C=block_c, STREAM=bool(cfg["STREAM"]),
             num_warps=cfg["num_warps"]),
    )
    return (launch, grid)
