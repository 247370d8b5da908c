"""The runner's fused forward of a Llama-family model: fused projections and element-wise kernels.

Owns :func:`fuse_model` (prepares a loaded transformers model once), :func:`is_fused` and
:func:`fused_forward` (one runner step through the prepared model), which the runner calls in
place of the model's own ``forward`` unless ``EngineConfig.fused_model`` is off.

What is fused. Per decoder layer, transformers' eager forward issues about two dozen kernels
besides the GEMMs and the attention (RMSNorm's casts/pow/mean/rsqrt/muls, RoPE's slices/neg/cat
and four multiplies per tensor, the residual adds, SiLU and the gate multiply) and five GEMMs
for Q, K, V, gate and up. The fused forward runs per layer: one GEMM for Q|K|V, one RoPE launch
rotating Q and K in place in that GEMM's output, pagedkv's attention on views of it, the output
GEMM, one residual-add + RMSNorm launch, one GEMM for gate|up, one SiLU-times-up launch, the down
GEMM, and one residual-add + RMSNorm launch (:mod:`pagedkv.kernels.elementwise`). On the
kernels, a linear layer whose input has one row (every projection of a one-token step, and the
LM head of any step that keeps one row) runs through the weight-streaming GEMV
:func:`pagedkv.kernels.linear_small_m` instead of cuBLAS, and the down projection's GEMV computes
SiLU-times-up as it loads its input (no separate launch); measured on an H100, the GEMV wins at
one row and loses from two up, so larger inputs stay on cuBLAS (``docs/performance.md``). The
bound is :attr:`AttentionMetadata.gemv_rows` (the runner's ``gemv_rows``: 1 on the kernels,
0 on the CPU path).

The architecture still comes from transformers' classes: the embedding, the rotary embedding
module (cos/sin per position, every ``rope_type`` it implements), the norms' weights and
epsilons, the projections and the LM head are the loaded model's own modules. :func:`fuse_model`
concatenates the Q/K/V weights (and biases, Qwen2's) and the gate/up weights into one tensor each
and re-points the original ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/``up_proj`` weights at
views of it: no weight is stored twice and the model's own ``forward`` (``generate``, a dense
reference) still runs on the same object.

Sliding windows (Mistral, Qwen2's ``use_sliding_window``): :func:`fuse_model` records each layer's
window from :func:`pagedkv.layer_groups.layer_kinds` (what the engine's KV cache groups are cut
from, so the fused layer and its group agree), and each layer attends through its KV cache group's
tables (``AttentionMetadata.groups[layer_group[layer]]``) with its window, as the registered
attention function does for the model's own forward.

Invariants: the fused forward computes what the model's eager forward with pagedkv's attention
computes, rounding where it rounds (see :mod:`pagedkv.kernels.elementwise`); it is used only for
models :func:`fusable` accepts (Llama/Mistral/Qwen2 layout, SiLU MLP, full or sliding layers, no
tensor parallelism), and
the element-wise kernels run through Triton where the attention does (CUDA, or the runner's
``"triton"`` backend on the CPU under ``TRITON_INTERPRET=1``), through their PyTorch references
otherwise.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from . import attention as _attention
from .forward_context import AttentionMetadata

__all__ = ["fusable", "fuse_model", "is_fused", "fused_forward"]

_FUSED_ATTR = "_pagedkv_fused"
#: Per decoder layer, its sliding window in tokens (None: it attends to the whole context).
_WINDOWS_ATTR = "_pagedkv_windows"


def fusable(model: Any) -> Optional[str]:
    """``None`` when :func:`fuse_model` can prepare ``model``; else why not (a sentence)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in ("llama", "mistral", "qwen2"):
        return "not a Llama, Mistral or Qwen2 model"
    if getattr(model, "_pagedkv_tp", None) is not None:
        return "tensor-parallel shards run the model's own forward"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    from ..layer_groups import layer_kinds

    if any(k.kind == "chunked" for k in layer_kinds(cfg)):
        return "chunked attention layers run the model's own forward"
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not hasattr(base, "rotary_emb") or not hasattr(model, "lm_head"):
        return "unexpected module layout"
    for layer in layers:
        att, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if att is None or mlp is None or not all(
                isinstance(getattr(att, n, None), torch.nn.Linear) for n in names):
            return "unexpected attention layout"
        if not all(isinstance(getattr(mlp, n, None), torch.nn.Linear)
                   for n in ("gate_proj", "up_proj", "down_proj")):
            return "unexpected MLP layout"
    return None


def is_fused(model: Any) -> bool:
    """Whether :func:`fuse_model` prepared ``model`` and its projections still read the fused
    tensors (a ``model.to(...)`` or a cut to a tensor-parallel shard since then replaced them)."""
    if not getattr(model, _FUSED_ATTR, False):
        return False
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        for lins, (w, _b) in (((att.q_proj, att.k_proj, att.v_proj), att._pagedkv_qkv),
                              ((mlp.gate_proj, mlp.up_proj), mlp._pagedkv_gate_up)):
            off = 0
            for lin in lins:
                p = lin.weight
                if (p.dtype != w.dtype or p.device != w.device or
                        p.data_ptr() != w[off:].data_ptr() or p.shape[1] != w.shape[1]):
                    return False
                off += lin.out_features
            if off != w.shape[0]:
                return False
    return True


def _concat_linears(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One weight (and bias) for ``linears`` side by side; each module's weight (bias) becomes a
    view of it, so the model's own forward reads the same storage."""
    w = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    has_bias = [lin.bias is not None for lin in linears]
    b = None
    if any(has_bias):
        b = torch.cat([lin.bias.detach() if lin.bias is not None else
                       torch.zeros(lin.out_features, dtype=w.dtype, device=w.device)
                       for lin in linears])
    off = 0
    for lin in linears:
        n = lin.out_features
        lin.weight = torch.nn.Parameter(w[off:off + n], requires_grad=False)
        if lin.bias is not None:
            lin.bias = torch.nn.Parameter(b[off:off + n], requires_grad=False)
        off += n
    return w, b


@torch.no_grad()
def fuse_model(model: Any) -> bool:
    """Prepares ``model`` for :func:`fused_forward` in place (idempotent; a model whose weights
    were replaced since, e.g. by ``model.to(dtype)``, is prepared again); returns whether it did
    (``False``: :func:`fusable` refused it, the model is untouched)."""
    if fusable(model) is not None:
        return False
    if is_fused(model):
        return True
    windows = _layer_windows(model)
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        att._pagedkv_qkv = _concat_linears([att.q_proj, att.k_proj, att.v_proj])
        mlp._pagedkv_gate_up = _concat_linears([mlp.gate_proj, mlp.up_proj])
    setattr(model, _WINDOWS_ATTR, windows)
    setattr(model, _FUSED_ATTR, True)
    return True


def _layer_windows(model: Any) -> tuple[Optional[int], ...]:
    """Each decoder layer's sliding window (None where it attends fully), read as the engine
    cuts its KV cache groups (:func:`pagedkv.layer_groups.layer_kinds`)."""
    from ..layer_groups import layer_kinds

    return tuple(k.size if k.kind == "sliding" else None for k in layer_kinds(model.config))


def _ops(meta: AttentionMetadata):
    # The element-wise kernels go with the attention kernels: on CUDA, or on the CPU where the
    # runner was asked for its Triton backend (interpreted, for tests). A CPU engine otherwise
    # runs the PyTorch ops, whatever TRITON_INTERPRET says: interpreted kernels are for tests of
    # the kernels, and run a real model hundreds of times slower.
    if meta.mode != "cpu":
        from ..kernels import elementwise as ew

        return ew.rms_norm, ew.rope_, ew.silu_mul
    from ..kernels.elementwise import rms_norm_ref, rope_ref_, silu_mul_ref

    return rms_norm_ref, rope_ref_, silu_mul_ref


def _eps(norm: Any) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def fused_forward(model: Any, meta: AttentionMetadata, ids: torch.Tensor, pos: torch.Tensor,
                  keep: Any) -> torch.Tensor:
    """Logits ``[1, R, vocab]`` of one runner step (``ids``/``pos`` ``[1, T]``; ``keep`` as
    transformers' ``logits_to_keep``: ``0`` for every row, or an index tensor) through a model
    :func:`fuse_model` prepared, with ``meta`` the step's paged attention metadata."""
    h, cos, sin = fused_prologue(model, ids, pos)
    h, residual = fused_layers(model, meta, h, None, cos, sin, 0, model.config.num_hidden_layers)
    return fused_epilogue(model, meta, h, residual, keep)


def fused_prologue(model: Any, ids: torch.Tensor,
                   pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The embedded tokens ``[T, H]`` and RoPE's cos/sin ``[T, D]`` of ``ids``/``pos`` ``[1, T]``."""
    base = model.model
    h = base.embed_tokens(ids[0])  # [T, H]
    cos, sin = base.rotary_emb(h, pos)  # [1, T, D] each, h's dtype
    return h, cos[0], sin[0]


def fused_layers(model: Any, meta: AttentionMetadata, h: torch.Tensor,
                 residual: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder layers ``start .. stop - 1`` on the hidden state ``h`` (the last layer's MLP
    output) and the residual stream (``None`` before layer 0); returns both after ``stop - 1``."""
    rms_norm, rope_, silu_mul = _ops(meta)
    windows = getattr(model, _WINDOWS_ATTR, None) or ()
    t = h.shape[0]
    for i in range(start, stop):
        layer = model.model.layers[i]
        att, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        x, residual = rms_norm(h, norm.weight, _eps(norm), residual)
        if residual is None:
            residual = h
        hd = att.head_dim
        hq = att.q_proj.out_features // hd
        hkv = att.k_proj.out_features // hd
        w, b = att._pagedkv_qkv
        qkv = _linear(meta, x, w, b)  # [T, (hq + 2 hkv) * hd]
        rope_(qkv, cos, sin, hq + hkv, hd)
        q = qkv[:, : hq * hd].view(t, hq, hd)
        k = qkv[:, hq * hd:(hq + hkv) * hd].view(t, hkv, hd)
        v = qkv[:, (hq + hkv) * hd:].view(t, hkv, hd)
        idx = att.layer_idx if att.layer_idx is not None else i
        o = _attend(meta, idx, q, k, v, att.scaling, windows[idx] if windows else None)
        h = _linear(meta, o.reshape(t, hq * hd), att.o_proj.weight, att.o_proj.bias)
        norm = layer.post_attention_layernorm
        x, residual = rms_norm(h, norm.weight, _eps(norm), residual)
        w, b = mlp._pagedkv_gate_up
        gu = _linear(meta, x, w, b)
        if _small(meta, gu):
            # The GEMV applies SiLU-times-up as it loads its input: one launch fewer.
            from ..kernels.gemv import linear_small_m

            h = linear_small_m(gu, mlp.down_proj.weight, mlp.down_proj.bias, silu_mul_input=True)
        else:
            h = _linear(meta, silu_mul(gu), mlp.down_proj.weight, mlp.down_proj.bias)
    assert residual is not None
    return h, residual


def fused_epilogue(model: Any, meta: AttentionMetadata, h: torch.Tensor, residual: torch.Tensor,
                   keep: Any) -> torch.Tensor:
    """The final norm and the LM head over the rows ``keep`` selects (as :func:`fused_forward`),
    with the norm the layers' ``meta`` chose."""
    rms_norm = _ops(meta)[0]
    norm = model.model.norm
    h, _ = rms_norm(h, norm.weight, _eps(norm), residual)
    if isinstance(keep, int):
        h = h[-keep:] if keep else h
    else:
        h = h.index_select(0, keep.to(h.device))
    return _linear(meta, h, model.lm_head.weight, model.lm_head.bias)[None]


def _small(meta: AttentionMetadata, x: torch.Tensor) -> bool:
    """Whether a linear layer on ``x`` runs through the GEMV: on the kernels, ``x`` has at least
    one row and at most ``meta.gemv_rows`` (an LM head that keeps no row stays on cuBLAS)."""
    return meta.mode != "cpu" and 0 < x.shape[0] <= meta.gemv_rows


def _linear(meta: AttentionMetadata, x: torch.Tensor, w: torch.Tensor,
            b: Optional[torch.Tensor]) -> torch.Tensor:
    # A few rows read the whole weight for little arithmetic: there the weight-streaming GEMV
    # keeps more of it in flight than cuBLAS's tiles (docs/performance.md, bench_gemv.py).
    if _small(meta, x):
        from ..kernels.gemv import linear_small_m

        return linear_small_m(x, w, b)
    return F.linear(x, w, b)


def _attend(meta: AttentionMetadata, layer: int, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, scaling: float, window: Optional[int] = None) -> torch.Tensor:
    if meta.layer_group is not None:  # KV cache groups: the layer's group's tables
        meta = meta.groups[meta.layer_group[layer]]
    kc, vc = meta.k_caches[layer], meta.v_caches[layer]
    if meta.mode == "cpu":
        # The CPU path's index_copy_ and gathers want packed rows.
        return _attention._cpu_attention(q.contiguous(), k.contiguous(), v.contiguous(), kc, vc,
                                         meta, scaling, window)
    return _attention._cuda_attention(q, k, v, kc, vc, meta, scaling, window)
