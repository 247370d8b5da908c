"""Tensor parallelism: which heads a rank holds, the process group, and the sharded model.

Owns :func:`head_split` (the per-rank split of query and KV heads, replicating KV heads when there
are fewer than ranks), :class:`TPGroup` (one rank's view of the torch.distributed group: rank,
size, backend, communication device, the few collectives the engine uses), :func:`shard_model`
(cuts a loaded transformers model to one rank's shard in place) and :class:`RowParallelLinear`.

How the model is split. The layout is transformers' own: the config's ``base_model_tp_plan``
(``"layers.*.self_attn.q_proj": "colwise"``, ``"...o_proj": "rowwise"``, the MLP's gate/up
``colwise`` and down ``rowwise``; ``replicated_with_grad_allreduce``, Gemma 3's per-head q/k norms,
kept whole) names the modules and their style. The cut itself is done here,
on plain tensors, rather than with ``from_pretrained(tp_plan=...)`` and DTensors, because:

* transformers' colwise split of ``k_proj``/``v_proj`` cuts the output features evenly, which with
  fewer KV heads than ranks splits a head's ``head_dim`` across ranks (a model with 1 KV head at
  ``tp=2`` fails in the attention reshape); here a colwise attention projection is cut by whole
  heads, and a KV head is replicated on ``tp / kv_heads`` ranks when ``kv_heads < tp``;
* plain local tensors and one ``all_reduce`` per row-parallel layer behave the same under gloo on
  the CPU and NCCL on GPUs, add no DTensor dispatch to a decode step, and have fixed addresses for
  CUDA-graph capture.

Column-parallel layers keep ``nn.Linear`` with a cut weight (rows of the output features); a
row-parallel layer becomes :class:`RowParallelLinear`: the local matmul over its cut input
features, an ``all_reduce`` (sum) of the partial outputs, then the bias, once. Embeddings, norms
and the LM head stay replicated, so every rank computes the full logits and rank 0 samples them.
transformers' Llama-family attention reshapes with ``view(..., -1, head_dim)``, so a cut
projection simply yields the local heads; pagedkv's attention sees ``[1, Hq/tp, T, D]`` queries and
its rank's KV heads, and reads and writes its rank's pool shard.

Invariants: every rank of a group holds the same number of query heads and of KV heads
(so one block manager and one set of block tables serve every rank's pool); rank ``r``'s query
heads are ``[r·Hq/tp, (r+1)·Hq/tp)`` and the KV heads they attend to are exactly the rank's KV
heads; a bad split raises :class:`pagedkv.errors.InvalidConfigError` before any weight is touched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import InvalidConfigError
from ..capacity import kv_heads_per_rank

__all__ = ["HeadSplit", "head_split", "TPGroup", "shard_model", "RowParallelLinear",
           "init_group", "model_heads"]


@dataclass(frozen=True)
class HeadSplit:
    """One rank's share of the attention heads."""

    #: The model's query and KV heads, and the group's size and this rank.
    num_q_heads: int
    num_kv_heads: int
    tp_size: int
    rank: int
    #: Heads this rank computes and holds: ``q_heads`` query heads from ``q_start``, ``kv_heads``
    #: KV heads from ``kv_start`` (global head indices).
    q_heads: int
    q_start: int
    kv_heads: int
    kv_start: int
    #: Ranks that hold each KV head: 1, or ``tp / num_kv_heads`` when heads are replicated.
    kv_replicas: int


def head_split(num_q_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadSplit:
    """The heads rank ``rank`` of ``tp_size`` holds.

    Raises:
        InvalidConfigError: ``tp_size`` does not divide the query heads, the KV heads and ranks do
            not divide one another (:func:`pagedkv.capacity.kv_heads_per_rank`), the query heads are
            not a multiple of the KV heads, or ``rank`` is outside ``[0, tp_size)``.
    """
    for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidConfigError(f"{name} must be an integer >= 1, got {v!r}", field=name,
                                     value=v, reason="must be >= 1")
    kv_local = kv_heads_per_rank(num_kv_heads, tp_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp_size:
        raise InvalidConfigError(f"rank must be in [0, {tp_size}), got {rank!r}", field="rank",
                                 value=rank, reason=f"must be in [0, {tp_size})")
    if num_q_heads % num_kv_heads:
        raise InvalidConfigError(
            f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads",
            field="num_kv_heads", value=num_kv_heads, reason="must divide num_q_heads")
    if num_q_heads % tp_size:
        raise InvalidConfigError(
            f"tensor_parallel_size {tp_size} does not divide the {num_q_heads} attention heads",
            field="tensor_parallel_size", value=tp_size, reason="must divide num_attention_heads")
    q_local = num_q_heads // tp_size
    if num_kv_heads >= tp_size:
        kv_start, replicas = rank * kv_local, 1
    else:
        replicas = tp_size // num_kv_heads
        kv_start = rank // replicas
    return HeadSplit(num_q_heads, num_kv_heads, tp_size, rank, q_local, rank * q_local, kv_local,
                     kv_start, replicas)


def model_heads(cfg: Any) -> tuple[int, int, int]:
    """``(query heads, KV heads, head_dim)`` of a transformers config."""
    hq = int(cfg.num_attention_heads)
    hkv = int(getattr(cfg, "num_key_value_heads", None) or hq)
    hd = getattr(cfg, "head_dim", None)
    return hq, hkv, int(hd) if hd else int(cfg.hidden_size) // hq


class TPGroup:
    """One rank's view of a tensor-parallel group (the default torch.distributed group or one made
    with ``new_group``).

    Attributes:
        rank, world_size: This rank and the group's size (rank 0 holds the block manager).
        backend: ``"gloo"`` or ``"nccl"``.
        device: Where collectives move data: the rank's GPU under NCCL, the CPU under gloo.
        group: The ``ProcessGroup`` (``None``: the default group).
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise InvalidConfigError(
                "tensor parallelism needs an initialized torch.distributed process group",
                field="tensor_parallel_size", value=0, reason="no process group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group)).lower()
        # Collectives address group members by global rank; rank 0 of the group is the source.
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        if self.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")

    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` into every rank's ``t``, in place (the same address on every call)."""
        import torch.distributed as dist

        dist.broadcast(t, src=self.src, group=self.group)
        return t

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over the ranks, in place."""
        import torch.distributed as dist

        dist.all_reduce(t, group=self.group)
        return t

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (every rank gets it)."""
        import torch.distributed as dist

        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def gather_objects(self, obj: Any) -> Optional[list]:
        """Every rank's ``obj`` on rank 0 (in rank order); ``None`` on the other ranks."""
        import torch.distributed as dist

        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self.src, group=self.group)
        return out

    def __repr__(self) -> str:
        return (f"TPGroup(rank={self.rank}, world_size={self.world_size}, "
                f"backend={self.backend!r}, device={str(self.device)!r})")


def init_group(backend: str, init_method: str, rank: int, world_size: int, *,
               timeout_s: float = 600.0) -> TPGroup:
    """Initializes the default process group and returns its :class:`TPGroup`.

    Under NCCL rank ``r`` uses ``cuda:r`` (set as the current device first, so NCCL binds to it).
    """
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    return TPGroup()


class RowParallelLinear(nn.Module):
    """A row-parallel linear layer: this rank's input features, the partial outputs summed over
    the group, then the bias (added once, after the sum).

    ``weight`` is ``[out_features, in_features / tp]``: the columns ``[start, start + n)`` of the
    full weight, matching the features the column-parallel layer before it produced on this rank.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        self.tp_group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        self.tp_group.all_reduce_(y)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp={self.tp_group.world_size}")


def _plan_regex(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\*", r"\d+"))


def _cut_rows(lin: nn.Linear, start: int, n: int) -> None:
    w = lin.weight.data[start:start + n].clone()
    lin.weight = nn.Parameter(w, requires_grad=False)
    if lin.bias is not None:
        lin.bias = nn.Parameter(lin.bias.data[start:start + n].clone(), requires_grad=False)
    lin.out_features = n


#: Plan styles that keep a module whole on every rank: at inference they only say "do not cut"
#: (the gradient all-reduce they also name concerns training).
_REPLICATED_STYLES = ("replicated_with_grad_allreduce",)


def shard_model(model: Any, group: TPGroup) -> HeadSplit:
    """Cuts ``model`` (a transformers Llama-family causal LM) to rank ``group.rank``'s shard, in
    place; returns the rank's :class:`HeadSplit`. Idempotent for the same group.

    Works on meta tensors too (shard first, materialize after), so a large model need not exist
    whole before it is cut.

    Raises:
        InvalidConfigError: The config has no ``base_model_tp_plan``, the plan uses a style other
            than ``colwise``/``rowwise`` (or ``replicated_with_grad_allreduce``, which keeps the
            module whole: Gemma 3's per-head query and key norms), the heads do not split
            (:func:`head_split`), or a module's features are not divisible by the group's size.
            Raised before any weight is cut.
    """
    done = getattr(model, "_pagedkv_tp", None)
    cfg = model.config
    hq, hkv, hd = model_heads(cfg)
    split = head_split(hq, hkv, group.world_size, group.rank)
    if done is not None:
        if done != (group.world_size, group.rank):
            raise InvalidConfigError(
                f"the model is already sharded for tp={done[0]} rank {done[1]}",
                field="tensor_parallel_size", value=group.world_size, reason="already sharded")
        return split
    plan = getattr(cfg, "base_model_tp_plan", None) or getattr(type(cfg), "base_model_tp_plan",
                                                                None)
    if not plan:
        raise InvalidConfigError(
            f"{type(cfg).__name__} has no base_model_tp_plan: no tensor-parallel layout",
            field="tensor_parallel_size", value=group.world_size, reason="no tp plan")
    base = model.base_model
    tp, r = group.world_size, group.rank
    jobs = []
    for pattern, style in plan.items():
        if style in _REPLICATED_STYLES:
            continue  # kept whole on every rank (Gemma 3's per-head q/k norms)
        if style not in ("colwise", "rowwise"):
            raise InvalidConfigError(
                f"tp plan style {style!r} for {pattern!r} is not supported (colwise, rowwise)",
                field="tensor_parallel_size", value=tp, reason="unsupported tp style")
        rx = _plan_regex(pattern)
        for name, mod in base.named_modules():
            if not rx.fullmatch(name):
                continue
            if not isinstance(mod, nn.Linear):
                raise InvalidConfigError(f"{name}: tp plan names a {type(mod).__name__}, "
                                         f"not a Linear", field="tensor_parallel_size", value=tp,
                                         reason="unsupported module")
            attn = ".self_attn." in f".{name}"
            if style == "colwise":
                feats = mod.out_features
            else:
                feats = mod.in_features
            if attn and feats == hq * hd:
                start, n = split.q_start * hd, split.q_heads * hd
            elif attn and style == "colwise" and feats == hkv * hd:
                start, n = split.kv_start * hd, split.kv_heads * hd
            elif attn:
                raise InvalidConfigError(
                    f"{name}: {feats} features match neither the query nor the KV heads",
                    field="tensor_parallel_size", value=tp, reason="unknown attention projection")
            else:
                if feats % tp:
                    raise InvalidConfigError(
                        f"{name}: tensor_parallel_size {tp} does not divide its {feats} features",
                        field="tensor_parallel_size", value=tp, reason="must divide the features")
                n = feats // tp
                start = r * n
            jobs.append((name, mod, style, start, n))
    if not jobs:
        raise InvalidConfigError("the tp plan matched no module of the model",
                                 field="tensor_parallel_size", value=tp, reason="empty tp plan")
    for name, mod, style, start, n in jobs:
        if style == "colwise":
            _cut_rows(mod, start, n)
        else:
            w = mod.weight.data[:, start:start + n].clone()
            b = None if mod.bias is None else mod.bias.data.clone()
            parent_name, _, attr = name.rpartition(".")
            parent = base.get_submodule(parent_name) if parent_name else base
            setattr(parent, attr, RowParallelLinear(w, b, group))
    model._pagedkv_tp = (tp, r)
    return split
