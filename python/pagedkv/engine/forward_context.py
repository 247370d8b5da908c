"""The per-step attention metadata, and the context that hands it to every layer.

Owns :class:`AttentionMetadata` (what the paged attention of one step needs besides Q/K/V: the
pool's per-layer views, the slot mapping, block tables, sequence lengths, query offsets, and the
path-specific extras) and :func:`forward_context`, which makes one metadata object current while
the model runs.

Why a context rather than an argument: transformers calls the registered attention function with
``(module, query, key, value, attention_mask, **kwargs)`` from inside its own model code; the step's
paged metadata has no slot in that call. The runner sets it here for the duration of one forward
(or one CUDA-graph capture), and each layer reads it. Invariants: exactly one metadata object is
current during a runner forward, none outside one (an attention call with none raises, rather than
silently attending without the cache), per thread: two engines stepping in two threads (an
``AsyncLLM``'s engine thread beside another engine) never see each other's; the tensors it refers to are built once per step (CPU) or
live at fixed addresses (CUDA), never per layer.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

__all__ = ["AttentionMetadata", "forward_context", "current_metadata"]


@dataclass
class AttentionMetadata:
    """Everything a layer's paged attention needs for one step (all on the pool's device).

    Common fields: ``k_caches``/``v_caches`` (the pool's per-layer views), ``slot_mapping`` int64
    ``[T]`` (negative = padding, skipped), ``block_tables`` int32 ``[n, W]``, ``seq_lens`` int32
    ``[n]``, ``query_start_loc`` int32 ``[n + 1]``.

    ``mode``: ``"cpu"`` (plain PyTorch), ``"decode"`` (CUDA, one new token per sequence:
    ``paged_decode``), ``"prefill"`` (CUDA, any mix: ``paged_prefill``).

    CPU extras (built once per step, shared by all layers): ``gather_slots`` int64 ``[n, L]`` pool
    slot of each sequence's key position (0 past its end), ``q_index`` int64 ``[n, Q]`` new-token
    row of each padded query (0 for padding), ``attn_mask`` bool ``[n, 1, Q, L]``, ``out_index``
    int64 ``[T]`` position of each new token in the flattened ``[n * Q]`` padded output.

    KV cache groups (a model whose full layers sit beside sliding or chunked ones): ``groups``
    holds one metadata object per group (index 0: group 0's, this object's own tables), each
    with its group's ``slot_mapping`` and ``block_tables`` (``-1`` where the group released a
    block) and, on the CPU, its own ``gather_slots`` / ``attn_mask``; everything else is shared.
    ``layer_group[l]`` is model layer ``l``'s group: the attention of layer ``l`` reads
    ``groups[layer_group[l]]``. Both ``None`` with one group (the attention reads this object).

    CUDA extras: ``max_q_len`` (host bound for the prefill grid), ``max_seq_len`` (host bound on
    the context, for the decode and prefill split-K choices), ``workspace`` (the split-K scratch), ``plan`` (a
    :class:`pagedkv.decode_plan.DecodePlan` updated for this decode step; replaces the workspace).
    """

    mode: str
    k_caches: list
    v_caches: list
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    gather_slots: Optional[torch.Tensor] = None
    q_index: Optional[torch.Tensor] = None
    attn_mask: Optional[torch.Tensor] = None
    out_index: Optional[torch.Tensor] = None
    max_q_len: int = 0
    max_seq_len: int = 0
    workspace: Any = None
    plan: Any = None
    #: The fused forward runs a linear layer whose input has at most this many rows (and at
    #: least one) through :func:`pagedkv.kernels.linear_small_m`, larger ones through cuBLAS: the
    #: runner's ``gemv_rows`` (1 on the kernels; 0: never).
    gemv_rows: int = 0
    #: Llama 4's query temperature on its NoPE layers, ``(floor_scale, attn_scale)``, with
    #: ``positions`` (int64 ``[T]``, each new token's position); None for other models.
    temperature: Optional[tuple] = None
    positions: Optional[torch.Tensor] = None
    #: Per KV cache group metadata (see above); None with one group.
    groups: Optional[list] = None
    #: Each model layer's group (``LayerGrouping.layer_group``); None with one group.
    layer_group: Optional[tuple] = None


class _Current(threading.local):
    meta: Optional[AttentionMetadata] = None


_CURRENT = _Current()


def current_metadata() -> AttentionMetadata:
    """The metadata of the step this thread is running; :class:`RuntimeError` outside a runner
    forward."""
    meta = _CURRENT.meta
    if meta is None:
        raise RuntimeError(
            "pagedkv attention called outside a ModelRunner step: no paged metadata is current "
            "(run the model through ModelRunner.execute, or use another attn_implementation)"
        )
    return meta


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata, model: Any) -> Iterator[None]:
    """Makes ``meta`` current and routes ``model``'s attention to pagedkv for the block's duration.

    The model's attention implementation is switched to ``"pagedkv"`` on entry and restored on
    exit, so the same model object still runs transformers' own attention (e.g. ``generate``)
    outside a runner step. The internal attribute is set directly: the public setter re-validates
    the name and walks sub-configs on every call, which is per-step overhead for nothing.
    """
    cfg = model.config
    prev_impl = cfg._attn_implementation_internal
    prev_meta = _CURRENT.meta
    _CURRENT.meta = meta
    cfg._attn_implementation_internal = "pagedkv"
    try:
        yield
    finally:
        cfg._attn_implementation_internal = prev_impl
        _CURRENT.meta = prev_meta
