"""Fused element-wise kernels of a Llama-family decoder layer, with plain PyTorch references.

Owns :func:`rms_norm` (optionally fused with the residual add), :func:`rope_` (rotary embedding
applied in place to the Q and K columns of a fused QKV projection's output) and
:func:`silu_mul` (SiLU of the gate half times the up half of a fused gate-up projection's output),
and their references (``*_ref``). One launch each replaces the several eager kernels transformers'
modules issue (casts, pow, mean, rsqrt, muls, adds, cat, neg, slices).

Rounding invariant: every kernel rounds to the activation dtype exactly where transformers' eager
modules do (the residual sum, the normalized row before the weight multiply, each RoPE product,
the SiLU output), computing in fp32 in between; so in bf16 a fused layer differs from the eager
one only by the order of fp32 reductions, and in fp32 by nothing visible. The references spell
out the same rounding in PyTorch and are what the CPU path runs.

Shapes: rows are the packed tokens ``[T, features]`` with a unit inner stride; the row stride may
be larger (a view into a wider buffer). All kernels launch on the tensors' device without
synchronizing, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm", "rms_norm_ref", "rope_", "rope_ref_", "silu_mul", "silu_mul_ref"]


# ---------------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o,
                     stride_ro, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # The residual stream is rounded to the activation dtype, as an eager add does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    rstd = tl.rsqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``weight * normalize(x)`` per row; with ``residual``, first ``s = x + residual``.

    Returns ``(normed, s)`` (``s`` is ``None`` without ``residual``): ``s`` is the new residual
    stream, written to a fresh tensor. ``x`` and ``residual`` are ``[T, H]`` of one dtype.
    """
    t, h = x.shape
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else None
    if t == 0:
        return out, res_out
    block = triton.next_power_of_2(h)
    r = residual if residual is not None else x
    ro = res_out if res_out is not None else out
    _rms_norm_kernel[(t,)](x, r, weight, out, ro, x.stride(0), r.stride(0), out.stride(0),
                           ro.stride(0), h, float(eps), HAS_RES=residual is not None, BLOCK=block,
                           num_warps=max(1, min(16, block // 256)))
    return out, res_out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`rms_norm` in PyTorch, rounding as transformers' ``LlamaRMSNorm`` does."""
    s = None
    if residual is not None:
        s = x + residual
        x = s
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    y = weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)
    return y, s


# ---------------------------------------------------------------------------------- RoPE


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, stride_x, stride_c, n_heads,
                 HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    hmask = heads < n_heads
    c1 = tl.load(cos_ptr + tok * stride_c + d).to(tl.float32)
    c2 = tl.load(cos_ptr + tok * stride_c + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + tok * stride_c + d).to(tl.float32)
    s2 = tl.load(sin_ptr + tok * stride_c + HALF + d).to(tl.float32)
    base = x_ptr + tok * stride_x + heads[:, None] * HEAD_DIM + d[None, :]
    x1 = tl.load(base, mask=hmask[:, None], other=0.0)
    x2 = tl.load(base + HALF, mask=hmask[:, None], other=0.0)
    dt = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # q * cos + rotate_half(q) * sin, each product rounded like the eager ops.
    o1 = (x1f * c1[None, :]).to(dt).to(tl.float32) + (-x2f * s1[None, :]).to(dt).to(tl.float32)
    o2 = (x2f * c2[None, :]).to(dt).to(tl.float32) + (x1f * s2[None, :]).to(dt).to(tl.float32)
    tl.store(base, o1.to(dt), mask=hmask[:, None])
    tl.store(base + HALF, o2.to(dt), mask=hmask[:, None])


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
          head_dim: int) -> None:
    """Rotates, in place, the first ``num_heads`` heads of each row of ``x`` ``[T, >= num_heads *
    head_dim]`` (the Q and K columns of a fused QKV output, side by side) by ``cos``/``sin``
    ``[T, head_dim]`` (transformers' rotary embedding output for the rows' positions, in ``x``'s
    dtype): ``x * cos + rotate_half(x) * sin`` per head. A ``head_dim`` that is not a power of
    two runs :func:`rope_ref_`."""
    t = x.shape[0]
    if t == 0 or num_heads == 0:
        return
    if head_dim % 2:
        raise ValueError(f"rope_: head_dim = {head_dim}, expected an even number")
    if head_dim & (head_dim - 1):
        # The kernel's tiles are powers of two; other head sizes take the eager ops.
        rope_ref_(x, cos, sin, num_heads, head_dim)
        return
    block_h = min(triton.next_power_of_2(num_heads), 16)
    grid = (t, triton.cdiv(num_heads, block_h))
    _rope_kernel[grid](x, cos, sin, x.stride(0), cos.stride(0), num_heads, HEAD_DIM=head_dim,
                       HALF=head_dim // 2, BLOCK_H=block_h, num_warps=4)


def rope_ref_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
              head_dim: int) -> None:
    """:func:`rope_` in PyTorch (transformers' ``apply_rotary_pos_emb`` arithmetic)."""
    t = x.shape[0]
    v = x[:, : num_heads * head_dim].view(t, num_heads, head_dim)
    c, s = cos[:, None, :], sin[:, None, :]
    half = head_dim // 2
    rot = torch.cat((-v[..., half:], v[..., :half]), dim=-1)
    v.copy_(v * c + rot * s)


# ---------------------------------------------------------------------------------- SiLU * up


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (a * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` ``[T, 2I]`` (a fused gate-up output); ``[T, I]``."""
    t, two_i = x.shape
    n = two_i // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(t, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n,
                                                  BLOCK=block, num_warps=4)
    return out


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul` in PyTorch."""
    n = x.shape[1] // 2
    return torch.nn.functional.silu(x[:, :n]) * x[:, n:]
