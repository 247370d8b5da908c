"""The model runner: one scheduler step through a transformers model and the paged KV pool.

Owns :class:`ModelRunner`: the :class:`~pagedkv.kv_pool.KVPool` (sized from ``num_blocks`` or a byte
budget through :class:`~pagedkv.config.CacheSpec`), the :class:`~pagedkv.buffers.StepBuffers` that
the engine core attaches to the :class:`~pagedkv.BlockManager` it builds around them
(:func:`~pagedkv.engine.core.build_block_manager`), the per-step attention metadata, and on CUDA
the captured decode graphs.

This module holds the class, its construction (pool sizing, :meth:`ModelRunner.enable_swap`)
and :func:`build_rank_runner`; the runner's other concerns are mixins, one module each, whose
names stay importable from here: :mod:`.runner_steps` (validating and running a step, its swaps
and copies), :mod:`.runner_graphs` (CUDA-graph capture and replay, :func:`graph_batch_sizes`),
:mod:`.runner_rates` (:meth:`ModelRunner.measure_rates` and its cache, :class:`Rates`).

One :meth:`ModelRunner.execute`:

1. applies the step's swap lists (with a host pool: :class:`~pagedkv.tiers.host.SwapEngine`, swap-outs
   then swap-ins, on side streams; the forward's stream waits for them only in a step that has
   swaps) and its copy list (copy-on-write pairs the manager emitted) to the pool, before any
   layer reads or writes it — a block a swap-out frees may be written by this very step;
2. moves the used part of the step buffers to their device mirrors (one or two non-blocking copies;
   nothing on the CPU, where the mirrors are the host tensors);
3. runs the model on the packed batch (``[1, T]`` ids and positions, ``use_cache=False``) with
   pagedkv's attention current (see :mod:`pagedkv.engine.attention`), or replays the CUDA graph
   captured for the smallest padded batch size that holds a pure-decode step (with the fused
   forward and ``cuda_graph_pieces > 1``: that many graphs of consecutive layers, in turn);
4. returns float32 logits for the requested rows only (``logits_to_keep`` with an index tensor, so
   the LM head runs on those rows alone in eager mode).

KV cache groups (a model whose full layers sit beside sliding or chunked ones: Gemma 3, gpt-oss,
Llama 4, Qwen with ``max_window_layers``): the runner cuts the layers into groups
(:func:`pagedkv.layer_groups.group_layers`, :attr:`ModelRunner.grouping`), the manager gets
``groups=`` (:attr:`ModelRunner.kv_groups`), the step buffers ``num_groups=``, and the pool one
page per block holding one group's ``slots`` layers (``KVPool(layer_slot=...)``); each step's
metadata carries every group's tables and each layer reads its group's. Swap moves every group's
blocks (a page is one block id across the pool's slots), the host tier keeps each group's blocks,
KV events name each block's group and tensor parallelism's step packet carries every group's
tables; the disk and remote tiers store each group's blocks under its key and group
(``pagedkv.tiers.cache``). A
model with one kind of layer runs exactly as before (one group). The fused forward takes full and
sliding layers (Mistral, Qwen2) through their groups' tables; chunked layers and the other
families run the model's own forward.

With tensor parallelism (``tensor_parallel=``, ``docs/tp.md``) the pool holds this rank's KV heads
only; rank 0's ``execute`` broadcasts each validated step (tables and batch, one packet) before
step 1, and the other ranks run it from :meth:`ModelRunner.serve`; under NCCL every rank's device
mirrors and device ids/positions are filled from the packet, device to device.

Invariants: the pool, the step buffers, the graphs' static inputs and outputs are allocated once
and keep their addresses (the graphs read the device mirrors in place); a step's host-side work
reads only host tensors and launches everything asynchronously. The copies to the mirrors read the
pinned host buffers asynchronously, so before returning, ``execute`` waits on an event recorded
right after those copies (not on the forward): the caller may then refill the host buffers with the
next ``manager.step`` at once, while the GPU is still running this step's model. Bad input raises
:mod:`pagedkv.errors` before the pool is touched.
"""


from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..buffers import StepBuffers
from ..distributed.step_broadcast import CMD_STEP, CMD_STOP, StepBroadcaster  # noqa: F401
from ..distributed.tp import TPGroup, shard_model
from ..config import CacheSpec, CapacityError
from ..errors import ConfigArgumentError, InvalidArgumentError, InvalidConfigError  # noqa: F401
from ..kv_pool import KVPool
from ..layer_groups import group_layers
from ..tiers.host import SwapEngine
from . import attention as _attention
from . import fused as _fused
from .config import EngineConfig
from .loader import LoadedModel, default_model_path, load_model
# The runner's concerns, one module each; their names stay importable from here.
from .runner_graphs import _GraphChain, _GraphMixin, graph_batch_sizes  # noqa: F401
from .runner_rates import (Rates, _fmt_rates, _model_fingerprint, _RatesMixin,  # noqa: F401
                           _rates_ok)
from .runner_steps import _as_int64, _StepMixin  # noqa: F401

__all__ = ["ModelRunner", "graph_batch_sizes", "build_rank_runner", "is_hybrid"]

#: KV budget when neither ``num_blocks`` nor ``kv_cache_memory`` is given, on the CPU.
DEFAULT_CPU_KV_BYTES = 256 * 2**20
#: On CUDA without a budget: this fraction of the memory free after loading the weights...
DEFAULT_GPU_FRACTION = 0.85
#: ...minus this reserve for activations, logits and graphs.
DEFAULT_GPU_RESERVE = 4 * 2**30
#: With speculation, the most rows (tokens) a verify step may have to be replayed by a decode graph
#: (``k + 1`` a sequence); larger verify steps run eagerly. Bounds the graphs' activations and
#: logits (512 rows of a 128K vocabulary: 128 MiB in bf16).
MAX_VERIFY_GRAPH_ROWS = 512


def _head_dim(cfg: Any) -> int:
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else cfg.hidden_size // cfg.num_attention_heads


class ModelRunner(_RatesMixin, _StepMixin, _GraphMixin):
    """Runs scheduler steps of one model over a paged KV pool.

    Args:
        loaded: What :func:`pagedkv.engine.loader.load_model` returned.
        config: The engine's settings (:class:`~pagedkv.engine.config.EngineConfig`); the runner
            reads the pool's (``block_size``, ``num_blocks`` or ``kv_cache_memory``), the step
            shape's (``max_num_seqs``, ``max_num_batched_tokens``, raised to ``max_num_seqs`` if
            below), ``cuda_graphs``, ``cuda_graph_pieces``, ``attention_backend``,
            ``decode_planner``, ``fused_model`` and ``record_steps``. Neither ``num_blocks`` nor
            ``kv_cache_memory``: 256 MiB on the CPU; on CUDA 85% of the free memory minus a
            4 GiB reserve.
        tensor_parallel: A :class:`pagedkv.distributed.TPGroup`: cut the model to this rank's
            shard (:func:`pagedkv.distributed.shard_model`), hold only this rank's KV heads in the
            pool, agree on the block count with the other ranks (the smallest), and exchange each
            step through a :class:`~pagedkv.distributed.StepBroadcaster` — rank 0 sends from
            :meth:`execute`, the others run what it sends from :meth:`serve`. Every rank must
            construct its runner with the same config (the constructor runs collectives).
        extra_bytes_per_block: Bytes of one block of another pool indexed by the same block ids
            (a draft model's, :mod:`.spec_decode.draft`), counted when the pool is sized from a
            byte budget, so the budget holds both.
        **knobs: :class:`EngineConfig` fields, for a runner built without an engine
            (``ModelRunner(loaded, num_blocks=64, block_size=4)``); with ``config``, they replace
            its fields.

    Attributes:
        num_blocks, spec, pool, buffers (attach to the manager with
        ``manager.attach_buffers(runner.buffers)``), max_model_len (the model's context),
        layer_kinds, grouping and kv_groups (the KV cache groups, the manager's ``groups=``),
        max_blocks_per_seq, graph_sizes (captured batch sizes, empty without graphs),
        engine_config.

    Raises:
        ConfigArgumentError: A setting is out of range, or both budgets are given.
        CapacityError: The budget holds no block.
    """

    def __init__(self, loaded: LoadedModel, config: Optional[EngineConfig] = None, *,
                 tensor_parallel: Any = None, extra_bytes_per_block: int = 0,
                 **knobs: Any) -> None:
        if config is None:
            config = EngineConfig(**knobs)
        elif knobs:
            config = dataclasses.replace(config, **knobs)
        #: The settings this runner was built with.
        self.engine_config = config
        #: Bytes per block of a pool sharing this one's block ids, counted in the sizing.
        self.extra_bytes_per_block = int(extra_bytes_per_block)
        block_size = config.block_size
        max_num_seqs = config.max_num_seqs
        self.loaded = loaded
        self.model = loaded.model
        cfg = loaded.config
        self.config = cfg
        self.device = loaded.device
        self.dtype = loaded.dtype
        #: The tensor-parallel group (:class:`pagedkv.distributed.TPGroup`), or None.
        self.tp = tensor_parallel
        self.tp_rank = 0 if tensor_parallel is None else tensor_parallel.rank
        self.tp_size = 1 if tensor_parallel is None else tensor_parallel.world_size
        num_q = int(cfg.num_attention_heads)
        num_kv = int(getattr(cfg, "num_key_value_heads", None) or num_q)
        #: This rank's heads (:class:`pagedkv.distributed.HeadSplit`), or None without TP.
        self.head_split = None
        if tensor_parallel is not None:
            # Cuts the model to this rank's heads and features (a no-op if already cut).
            self.head_split = shard_model(self.model, tensor_parallel)
            if self.device.type == "cuda":
                # The full weights the cut replaced are free: return them before sizing the pool.
                torch.cuda.empty_cache()
            num_q, num_kv = self.head_split.q_heads, self.head_split.kv_heads
        self.max_model_len = int(loaded.max_model_len)
        #: Each layer's attention kind (full, sliding, chunked: :attr:`LoadedModel.layer_kinds`).
        self.layer_kinds = loaded.layer_kinds
        #: The layers cut into KV cache groups (:func:`pagedkv.layer_groups.group_layers`): one
        #: full group for a full-attention model; a model whose every layer is windowed gets a
        #: windowed group 0 (its sequences hold their windows only) unless a prefix-cache tier
        #: below the GPU is on (those follow group 0's leading run: one full group then).
        tiers = any(getattr(config, name, None) is not None
                    for name in ("host_cache_memory", "disk_cache_dir", "remote_cache_url"))
        self.grouping = group_layers(self.layer_kinds, self.max_model_len, block_size,
                                     windowed_group0=not tiers)
        #: The manager's ``groups=`` (one per KV cache group, group 0 full when some layer is).
        self.kv_groups = self.grouping.groups
        #: Whether some layer attends to a window or chunk only.
        self.windowed = any(k.kind != "full" for k in self.layer_kinds)
        #: Whether steps run through :func:`pagedkv.engine.fused.fused_forward` (``fused_model``
        #: and a model :func:`~pagedkv.engine.fused.fusable` accepts: full or sliding layers)
        #: rather than the model's own forward. Fused before the pool is sized: concatenating
        #: the weights frees the originals.
        self.fused = bool(config.fused_model) and _fused.fuse_model(self.model)
        if self.fused and self.device.type == "cuda":
            torch.cuda.empty_cache()
        groups = self.grouping.num_groups
        #: Llama 4's positional query temperature on its NoPE layers, ``(floor_scale,
        #: attn_scale)``, which each step's metadata carries (see :mod:`.attention`); else None.
        self.temperature: Optional[tuple] = None
        if getattr(cfg, "attn_temperature_tuning", False) and getattr(cfg, "no_rope_layers", None):
            self.temperature = (float(cfg.floor_scale), float(cfg.attn_scale))
        # With groups a page holds one group's layers (`slots` of them): the pool's unit.
        self.spec = CacheSpec(num_layers=self.grouping.slots if groups > 1
                              else int(cfg.num_hidden_layers), num_kv_heads=num_kv,
                              head_dim=_head_dim(cfg), dtype=str(self.dtype).rpartition(".")[2],
                              block_size=block_size)
        self.num_q_heads = num_q
        self.block_size = block_size
        self.max_blocks_per_seq = -(-self.max_model_len // block_size)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = config.step_token_budget
        #: Query tokens a sequence may have in a step replayed by a decode graph: 1, or with
        #: speculation ``k + 1`` (a verify step runs as one decode row per token).
        self.graph_query_len = 1
        #: Rows a decode graph and the buffers it reads hold: a row per sequence, or with
        #: speculation a row per token of a verify step (at most :data:`MAX_VERIFY_GRAPH_ROWS`).
        self.max_graph_rows = max_num_seqs
        spec_cfg = config.speculative
        if spec_cfg is not None:
            self.graph_query_len = int(spec_cfg.num_speculative_tokens) + 1
            self.max_graph_rows = max(max_num_seqs, min(
                max_num_seqs * self.graph_query_len, self.max_num_batched_tokens,
                MAX_VERIFY_GRAPH_ROWS))
        self.num_blocks = self._size_pool(config.num_blocks, config.kv_cache_memory,
                                          config.gpu_memory_utilization)
        if tensor_parallel is not None:
            # One manager serves every rank's pool: all pools get the smallest rank's block count.
            self.num_blocks = tensor_parallel.min_int(self.num_blocks)
        self.pool = KVPool(self.spec, self.num_blocks, self.device, zero=True,
                           layer_slot=self.grouping.layer_slot if groups > 1 else None)
        # Swap lists as long as the pool: a step may have to carry a swap for every device block
        # (a host-tier hit's loads for each admitted prompt, the write-backs of every block its
        # allocations evict), and each list names a device block once.
        self.buffers = StepBuffers(self.max_graph_rows, self.max_num_batched_tokens,
                                   self.max_blocks_per_seq, device=self.device, csr=False,
                                   max_swaps=max(2 * self.max_blocks_per_seq, self.num_blocks),
                                   num_groups=groups)
        self.is_cuda = self.device.type == "cuda"
        attention_backend = config.attention_backend
        if attention_backend == "auto":
            attention_backend = "triton" if self.is_cuda else "torch"
        self.attention_backend = attention_backend
        self.use_kernels = attention_backend == "triton"
        #: Internal: the fused forward runs a linear layer (projections, LM head) whose input has
        #: at most this many rows through :func:`pagedkv.kernels.linear_small_m`, larger ones
        #: through cuBLAS (``F.linear``). 1 when fused on the kernels (the GEMV won at one row and
        #: lost above, docs/performance.md), else 0 (never). Benches set it to 0 before capturing
        #: graphs to time the cuBLAS path; graphs keep the value they were captured with.
        self.gemv_rows = 1 if self.fused and self.use_kernels else 0
        _attention.register()
        t = self.max_num_batched_tokens
        if self.is_cuda:
            # Pinned staging for ids and positions: one asynchronous copy each per step.
            self._ids_host = torch.zeros(t, dtype=torch.int64, pin_memory=True)
            self._pos_host = torch.zeros(t, dtype=torch.int64, pin_memory=True)
            self._ids_dev = torch.zeros(t, dtype=torch.int64, device=self.device)
            self._pos_dev = torch.zeros(t, dtype=torch.int64, device=self.device)
            # Recorded after a step's host-to-device copies; `execute` waits on it before
            # returning, so the caller may refill the host buffers (manager.step) at once.
            self._inputs_copied = torch.cuda.Event()
            if self.graph_query_len > 1:
                # A verify step's rows (each token's sequence, then its length), staged as one.
                r = self.max_graph_rows
                self._rows_host = torch.zeros(2 * r, dtype=torch.int32, pin_memory=True)
                self._rows_dev = torch.zeros(2 * r, dtype=torch.int32, device=self.device)

        #: Rank 0 broadcasts each step's tables and batch through it; the others receive.
        self.broadcaster = None
        if tensor_parallel is not None:
            if tensor_parallel.device.type != self.device.type:
                raise InvalidConfigError(
                    f"a {tensor_parallel.backend} group moves data on {tensor_parallel.device}, "
                    f"the model is on {self.device} (gloo for the CPU, NCCL for GPUs)",
                    field="tensor_parallel_size", value=self.tp_size, reason="backend/device")
            self.broadcaster = StepBroadcaster(
                self.buffers, tensor_parallel,
                ids_dev=self._ids_dev if self.is_cuda else None,
                positions_dev=self._pos_dev if self.is_cuda else None)
        #: With ``record_steps``: one :func:`step_record` per step run, in order.
        self.step_records: Optional[list] = [] if config.record_steps else None

        self.workspace = None
        if self.use_kernels:
            from ..kernels import DecodeWorkspace

            self.workspace = DecodeWorkspace(self.max_graph_rows, self.num_q_heads,
                                             self.spec.num_kv_heads, self.spec.head_dim,
                                             device=self.device)
        #: The decode planner (kernels only, ``decode_planner``): updated from the host lengths
        #: before every decode step, read by every layer's ``paged_decode`` and by the graphs.
        self.decode_plan = None
        if self.use_kernels and config.decode_planner:
            from ..decode_plan import DecodePlan

            self.decode_plan = DecodePlan(self.max_graph_rows, self.num_q_heads,
                                          self.spec.num_kv_heads, self.spec.head_dim,
                                          device=self.device)
            # Padded lengths of a graph batch: the step's own, zeros past them.
            self._plan_lens = np.zeros(self.max_graph_rows, dtype=np.int32)
        #: The host tier (:meth:`enable_swap`); None: no swapping.
        self.swap = None
        self.graph_sizes: list[int] = []
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        #: Steps of several tokens a sequence (speculative verify steps) replayed by a graph.
        self.graph_verify_steps = 0
        if self.is_cuda and self.use_kernels and config.cuda_graphs:
            capture_or_refuse(self.capture_graphs, config.cuda_graph_pieces)

    # ------------------------------------------------------------------------------ set-up

    def _size_pool(self, num_blocks: Optional[int], kv_cache_memory: Any,
                   gpu_memory_utilization: Optional[float] = None) -> int:
        # The config validated all three (exclusive; the budget stored as bytes).
        per_block = self.spec.bytes_per_block + getattr(self, "extra_bytes_per_block", 0)
        if num_blocks is not None:
            return num_blocks
        if gpu_memory_utilization is not None and self.device.type != "cuda":
            raise ConfigArgumentError(
                f"invalid config: gpu_memory_utilization = {gpu_memory_utilization!r}: a share "
                f"of free CUDA memory, and the model is on {self.device}; size the pool with "
                f"kv_cache_memory or num_blocks", field="gpu_memory_utilization",
                value=gpu_memory_utilization, reason="CUDA only")
        if kv_cache_memory is not None:
            budget = int(kv_cache_memory)
        elif self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            fraction = (DEFAULT_GPU_FRACTION if gpu_memory_utilization is None
                        else gpu_memory_utilization)
            budget = int(free * fraction) - DEFAULT_GPU_RESERVE
        else:
            budget = DEFAULT_CPU_KV_BYTES
        blocks = budget // per_block if budget > 0 else 0
        if blocks < 1:
            raise CapacityError(f"a KV budget of {budget} bytes holds no block of {per_block} bytes")
        return int(blocks)

    def enable_swap(self, num_host_blocks: int, *, staging_blocks: Optional[int] = None):
        """Allocates the host KV pool (pinned on CUDA) and the swap engine; returns it.

        Raises:
            InvalidConfigError: ``num_host_blocks`` is not an int >= 1.
            AllocationFailedError: The host memory (or the device staging) cannot be allocated.
        """
        self.swap = SwapEngine(self.pool, num_host_blocks, staging_blocks=staging_blocks)
        return self.swap


def is_hybrid(kinds: Sequence[Any]) -> bool:
    """Whether layers of ``kinds`` form more than one KV cache group (full layers beside
    sliding or chunked ones; :func:`pagedkv.layer_groups.group_layers`)."""
    full = [k.kind == "full" for k in kinds]
    return any(full) and not all(full)


def capture_or_refuse(capture: Any, pieces: int) -> None:
    """Runs ``capture(pieces=pieces)``; a model whose forward cannot be captured in a CUDA graph
    (a ``RuntimeError`` from the capture: e.g. transformers' fp32 grouped-GEMM experts copy from
    host memory) is refused with a typed error that names the remedy, ``cuda_graphs=False``.

    Raises:
        InvalidConfigError: The capture failed (the original error chained).
    """
    try:
        capture(pieces=pieces)
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise InvalidConfigError(
            f"invalid config: cuda_graphs = True: this model's forward cannot be captured in a "
            f"CUDA graph ({type(exc).__name__}: {first}); build the engine with "
            f"cuda_graphs=False to run it eagerly", field="cuda_graphs", value=True,
            reason="the model's forward cannot be captured") from exc


def build_rank_runner(spec: Any, group: TPGroup, loaded: Optional[LoadedModel] = None) -> ModelRunner:
    """One tensor-parallel rank's runner from a :class:`pagedkv.distributed.launch.WorkerSpec`:
    loads the model unless given (on the group's device under NCCL, else on ``spec.device`` or the
    CPU), shards it, builds the runner with rank 0's config and its host pool. Every rank of a
    group runs it with the same spec (the runner's constructor runs collectives)."""
    if loaded is None:
        device = group.device if group.backend == "nccl" else (spec.device or "cpu")
        loaded = load_model(default_model_path() if spec.model is None else spec.model,
                            device=device, dtype=spec.dtype)
    runner = ModelRunner(loaded, spec.config, tensor_parallel=group)
    blocks = spec.config.host_blocks(runner.spec.bytes_per_block)
    if blocks:
        runner.enable_swap(blocks)
    return runner
