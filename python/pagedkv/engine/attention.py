"""pagedkv's attention, plugged into transformers' attention-function registry.

Owns :func:`pagedkv_attention` (registered as ``"pagedkv"`` in ``transformers.AttentionInterface``
by :func:`register`) and :func:`build_cpu_metadata`, the per-step index tensors of the CPU path.

How it plugs in. transformers' Llama-family attention modules project Q/K/V, apply RoPE, then call
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, scaling=..., ...)``
with ``q`` ``[1, Hq, T, D]`` and ``k``/``v`` ``[1, Hkv, T, D]``: the runner feeds the whole step
as one packed row (``[1, T]`` input ids, per-token ``position_ids``) with ``use_cache=False``.
``"pagedkv"`` is registered in the attention registry only, not in the mask registry, so
``create_causal_mask`` returns ``None`` without building a dense mask: causality comes from the
paged metadata instead. Per layer (``module.layer_idx``) the function

1. writes the new K/V into the layer's pool views through the slot mapping, then
2. attends each sequence's new tokens over its whole context through its block-table row:
   full over the cached prefix, causal within the new tokens.

It returns ``[1, T, Hq, D]``, the layout transformers' own functions return.

KV cache groups (a model whose full layers sit beside sliding or chunked ones): each layer reads
its group's slot mapping and block tables (``AttentionMetadata.groups[layer_group[layer]]``),
whose entries before the window are ``-1`` (released); neither path reads them: the CPU path
gathers slot 0 in their place and masks it, the kernels start at the window's first key.

Llama 4's NoPE layers scale their queries by a temperature of the token's position, which
transformers counts from the start of the call's row: on a packed step the runner's metadata
(``temperature``, ``positions``) lets the attention rescale each query to its true position's.

Local attention comes from the module's own call: ``sliding_window`` (Mistral, Qwen2, Gemma 3,
gpt-oss: a query at position p sees keys ``[p - W + 1, p]``), ``s_aux`` (gpt-oss's per-head sinks)
and, for a layer whose ``config.layer_types`` entry is ``"chunked_attention"`` (Llama 4),
``config.attention_chunk_size``. Both paths honour them (docs/kernels.md); the kernels skip the
keys before the window rather than masking them.

CPU path (plain PyTorch): ``index_copy_`` into the flattened pool, one gather of every sequence's
K/V padded to the batch's longest context (``gather_slots``), one batched SDPA call with GQA and a
boolean mask, and one gather back to packed rows. The index tensors are built once per step
(:func:`build_cpu_metadata`) and shared by every layer.

CUDA path: ``scatter_kv``, then ``paged_decode`` when every sequence has exactly one new token
(the CUDA-graph path) or ``paged_prefill`` otherwise (prefill and mixed batches in one launch).
Neither synchronizes with the host.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from .forward_context import AttentionMetadata, current_metadata

__all__ = ["pagedkv_attention", "register", "build_cpu_metadata", "ATTN_IMPLEMENTATION"]

#: The name under which the function is registered.
ATTN_IMPLEMENTATION = "pagedkv"

_REGISTERED = False


def register() -> None:
    """Registers :func:`pagedkv_attention` with transformers (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, pagedkv_attention)
    _REGISTERED = True


def pagedkv_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: write K/V to the pool, attend through the block tables."""
    meta = current_metadata()
    layer = module.layer_idx
    if meta.layer_group is not None:  # KV cache groups: the layer's group's tables
        meta = meta.groups[meta.layer_group[layer]]
    k_cache = meta.k_caches[layer]
    v_cache = meta.v_caches[layer]
    # [1, H, T, D] -> [T, H, D]. After RoPE transformers' tensors are [1, T, H, D] in memory, so
    # these transposes are already packed and `.contiguous()` copies nothing.
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    if meta.temperature is not None and not module.use_rope:
        q = _retemper(q, meta)
    window, chunk, sinks = _local(module, kwargs)
    if meta.mode == "cpu":
        out = _cpu_attention(q, k, v, k_cache, v_cache, meta, scaling, window, chunk, sinks)
    else:
        out = _cuda_attention(q, k, v, k_cache, v_cache, meta, scaling, window, chunk, sinks)
    return out.unsqueeze(0), None


def _retemper(q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Llama 4's NoPE layers scale each query by ``log1p(floor((p + 1) / floor_scale)) *
    attn_scale + 1`` with ``p`` counted from the start of the call's row (and a cache's length):
    on a packed step that is the token's index in the step, not its position. Rescales each
    query to its true position's temperature."""
    floor_scale, attn_scale = meta.temperature  # type: ignore[misc]
    pos = meta.positions
    t = q.shape[0]
    idx = torch.arange(t, device=q.device, dtype=torch.float32)

    def temp(x: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((x + 1.0) / floor_scale)) * attn_scale + 1.0

    ratio = temp(pos[:t].to(torch.float32)) / temp(idx)  # type: ignore[index]
    return (q.float() * ratio[:, None, None]).to(q.dtype)


def _local(module: Any, kwargs: dict) -> tuple:
    """(window, chunk, sinks) of this layer's call: None where it attends fully / has none."""
    window = kwargs.get("sliding_window") or None
    sinks = kwargs.get("s_aux")
    chunk = None
    cfg = getattr(module, "config", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None and types[module.layer_idx] == "chunked_attention":
        chunk = getattr(cfg, "attention_chunk_size", None) or None
    if sinks is not None:
        sinks = sinks.detach()
    return window, chunk, sinks


def _local_mask(meta: AttentionMetadata, window, chunk):
    """The CPU mask with the window / chunk bound applied (padding rows keep key 0)."""
    mask = meta.attn_mask  # [n, 1, Q, L]
    n, _, max_q, length = mask.shape
    qsl = meta.query_start_loc.to(torch.int64)
    q_lens = qsl[1 : n + 1] - qsl[:n]
    j = torch.arange(max_q)
    q_pos = (meta.seq_lens[:n].to(torch.int64) - q_lens)[:, None] + j[None, :]  # [n, Q]
    key_pos = torch.arange(length)
    keep = torch.ones(n, max_q, length, dtype=torch.bool)
    if window:
        keep &= key_pos[None, None, :] > q_pos[:, :, None] - window
    if chunk:
        keep &= key_pos[None, None, :] >= (q_pos // chunk * chunk)[:, :, None]
    mask = mask & keep[:, None]
    mask[:, 0, :, 0] |= ~(j[None, :] < q_lens[:, None])
    return mask


def _cpu_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scaling, window=None,
                   chunk=None, sinks=None):
    nb, bs, hkv, d = k_cache.shape
    flat_k = k_cache.view(nb * bs, hkv, d)
    flat_v = v_cache.view(nb * bs, hkv, d)
    flat_k.index_copy_(0, meta.slot_mapping, k)
    flat_v.index_copy_(0, meta.slot_mapping, v)
    n, length = meta.gather_slots.shape
    # [n, L, Hkv, D] -> [n, Hkv, L, D]
    keys = flat_k[meta.gather_slots].transpose(1, 2)
    values = flat_v[meta.gather_slots].transpose(1, 2)
    qp = q[meta.q_index].transpose(1, 2)  # [n, Hq, Q, D]
    mask = meta.attn_mask if not (window or chunk) else _local_mask(meta, window, chunk)
    if sinks is None:
        o = F.scaled_dot_product_attention(
            qp, keys, values, attn_mask=mask, scale=scaling,
            enable_gqa=qp.shape[1] != keys.shape[1],
        )
    else:
        # SDPA has no sinks: one more logit column per head (no value), dropped after softmax.
        g = qp.shape[1] // keys.shape[1]
        kk = keys.repeat_interleave(g, dim=1).float()
        vv = values.repeat_interleave(g, dim=1).float()
        sc = scaling if scaling is not None else d ** -0.5
        s = (qp.float() @ kk.transpose(-1, -2)) * sc
        s = s.masked_fill(~mask, float("-inf"))
        sk = sinks.float().view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        p = torch.softmax(torch.cat([s, sk], dim=-1), dim=-1)[..., :-1]
        o = (p @ vv).to(qp.dtype)
    hq = q.shape[1]
    # [n, Hq, Q, D] -> [n * Q, Hq, D] -> the packed rows
    return o.transpose(1, 2).reshape(-1, hq, d)[meta.out_index]


def _cuda_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scaling, window=None,
                    chunk=None, sinks=None):
    from ..kernels import paged_decode, paged_prefill, scatter_kv

    scatter_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    local = dict(window=window, chunk=chunk, sinks=sinks)
    if meta.mode == "decode":
        if meta.plan is not None:
            return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                scale=scaling, plan=meta.plan, **local)
        return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale=scaling,
                            workspace=meta.workspace, max_seq_len=meta.max_seq_len, **local)
    # The context bound lets a step of few new tokens over a long context split the keys
    # across programs (a prefix hit's last block, a chat turn after a long history).
    return paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                         meta.query_start_loc, meta.max_q_len, scale=scaling,
                         max_seq_len=meta.max_seq_len or None, **local)


def build_cpu_metadata(meta: AttentionMetadata, block_size: int, q_lens: torch.Tensor,
                       seq_lens: torch.Tensor) -> AttentionMetadata:
    """Fills the CPU path's index tensors of ``meta`` from the step's host-side lengths.

    ``q_lens``/``seq_lens`` are int64 CPU tensors ``[n]`` (new tokens and total tokens per
    sequence). Sequence ``i``'s ``j``-th new token sits at position ``seq_lens[i] - q_lens[i] + j``
    and may see keys at positions ``<=`` its own; padding query rows see key 0 only (their output
    is dropped; a row with no allowed key would make SDPA produce NaN).
    """
    n = int(seq_lens.shape[0])
    max_len = int(seq_lens.max())
    max_q = int(q_lens.max())
    width = -(-max_len // block_size)
    tables = meta.block_tables[:, :width].to(torch.int64)
    key_pos = torch.arange(max_len)
    col = tables[:, key_pos // block_size]
    slots = col * block_size + key_pos % block_size
    # Released blocks (-1, before a sliding window) are never gathered: slot 0 stands in, masked.
    valid_key = (key_pos[None, :] < seq_lens[:, None]) & (col >= 0)
    meta.gather_slots = torch.where(valid_key, slots, torch.zeros((), dtype=torch.int64))
    qsl = meta.query_start_loc.to(torch.int64)
    j = torch.arange(max_q)
    valid_q = j[None, :] < q_lens[:, None]
    meta.q_index = torch.where(valid_q, qsl[:n, None] + j[None, :], torch.zeros((), dtype=torch.int64))
    q_pos = (seq_lens - q_lens)[:, None] + j[None, :]  # [n, Q]
    mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [n, Q, L]
    mask &= valid_key[:, None, :]
    mask[:, :, 0] |= ~valid_q
    meta.attn_mask = mask.unsqueeze(1)
    rows = (torch.arange(n)[:, None] * max_q + j[None, :])
    meta.out_index = rows[valid_q]
    return meta
