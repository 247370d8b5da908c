"""The model runner: one scheduler step through a transformers model and the paged KV pool.

Owns :class:`ModelRunner`: the :class:`~pagedkv.kv_pool.KVPool` (sized from ``num_blocks`` or a byte
budget through :class:`~pagedkv.config.CacheSpec`), the :class:`~pagedkv.buffers.StepBuffers` that
the engine core attaches to the :class:`~pagedkv.BlockManager` it builds around them
(:func:`~pagedkv.engine.core.build_block_manager`), the per-step attention metadata, and on CUDA
the captured decode graphs.

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
import hashlib
import json
import logging
import math
import os
import time
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import torch

from ..buffers import StepBuffers
from ..distributed.step_broadcast import CMD_STEP, CMD_STOP, StepBroadcaster
from ..distributed.tp import TPGroup, shard_model
from ..config import CacheSpec, CapacityError
from ..errors import ConfigArgumentError, InvalidArgumentError, InvalidConfigError
from ..kv_pool import KVPool
from ..manager import BlockManager
from ..tiers.host import SwapEngine
from . import attention as _attention
from . import fused as _fused
from .config import EngineConfig
from .forward_context import AttentionMetadata, forward_context
from .loader import LoadedModel, default_model_path, load_model

__all__ = ["ModelRunner", "graph_batch_sizes", "build_rank_runner"]

_log = logging.getLogger(__name__)

#: KV budget when neither ``num_blocks`` nor ``kv_cache_memory`` is given, on the CPU.
DEFAULT_CPU_KV_BYTES = 256 * 2**20
#: On CUDA without a budget: this fraction of the memory free after loading the weights...
DEFAULT_GPU_FRACTION = 0.85
#: ...minus this reserve for activations, logits and graphs.
DEFAULT_GPU_RESERVE = 4 * 2**30


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded decode batch sizes to capture: 1, 2, 4, 8, then multiples of 16 up to 64, then of 32
    up to ``max_num_seqs`` (which is always included).

    Finer steps than powers of two above 16 keep padding waste under ~25% at large batches, where
    a decode step costs the most.
    """
    sizes = []
    for s in (1, 2, 4, 8):
        if s < max_num_seqs:
            sizes.append(s)
    s = 16
    while s < max_num_seqs:
        sizes.append(s)
        s += 16 if s < 64 else 32
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


def _head_dim(cfg: Any) -> int:
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else cfg.hidden_size // cfg.num_attention_heads


def _model_fingerprint(path: str) -> str:
    """A digest of the model on disk: a GGUF file's (:func:`pagedkv.cache_dir.file_digest`), or a
    directory's ``config.json`` bytes and the names, sizes and mtimes of its weight files."""
    from ..cache_dir import file_digest

    if os.path.isfile(path):
        return file_digest(path)
    h = hashlib.sha256()
    with open(os.path.join(path, "config.json"), "rb") as fh:
        h.update(fh.read())
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".bin", ".pt")):
            st = os.stat(os.path.join(path, name))
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:32]


def _rates_ok(r: Any, need_link: bool) -> bool:
    """Whether a cached rates record holds usable rates."""
    def pos(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) \
            and x > 0

    link = r["host_link_bytes_per_s"]
    floor = r["step_floor_s"]
    return (pos(r["prefill_tokens_per_s"]) and (pos(floor) or floor == 0)
            and (pos(link) if need_link else link is None or pos(link)))


def _fmt_rates(r: "Rates") -> str:
    link = ("n/a" if math.isnan(r.host_link_bytes_per_s)
            else f"{r.host_link_bytes_per_s / 1e9:.2f} GB/s")
    return (f"host link {link}, prefill {r.prefill_tokens_per_s:.0f} tok/s, step floor "
            f"{r.step_floor_s * 1e3:.2f} ms")


class Rates(NamedTuple):
    """What :meth:`ModelRunner.measure_rates` measured: the cost model's rates."""

    #: Host <-> device copy bandwidth, bytes per second, one direction (NaN without a host pool).
    host_link_bytes_per_s: float
    #: Prefill throughput once a step is past its floor, tokens per second.
    prefill_tokens_per_s: float
    #: Seconds a step costs however few tokens it carries (``max(floor, tokens / rate)``).
    step_floor_s: float


class ModelRunner:
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
        **knobs: :class:`EngineConfig` fields, for a runner built without an engine
            (``ModelRunner(loaded, num_blocks=64, block_size=4)``); with ``config``, they replace
            its fields.

    Attributes:
        num_blocks, spec, pool, buffers (attach to the manager with
        ``manager.attach_buffers(runner.buffers)``), max_model_len (the model's context),
        max_blocks_per_seq, graph_sizes (captured batch sizes, empty without graphs),
        engine_config.

    Raises:
        ConfigArgumentError: A setting is out of range, or both budgets are given.
        CapacityError: The budget holds no block.
    """

    def __init__(self, loaded: LoadedModel, config: Optional[EngineConfig] = None, *,
                 tensor_parallel: Any = None, **knobs: Any) -> None:
        if config is None:
            config = EngineConfig(**knobs)
        elif knobs:
            config = dataclasses.replace(config, **knobs)
        #: The settings this runner was built with.
        self.engine_config = config
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
        #: Whether steps run through :func:`pagedkv.engine.fused.fused_forward` (``fused_model``
        #: and a model :func:`~pagedkv.engine.fused.fusable` accepts) rather than the model's own
        #: forward. Fused before the pool is sized: concatenating the weights frees the originals.
        self.fused = bool(config.fused_model) and _fused.fuse_model(self.model)
        if self.fused and self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.spec = CacheSpec(num_layers=int(cfg.num_hidden_layers), num_kv_heads=num_kv,
                              head_dim=_head_dim(cfg), dtype=str(self.dtype).rpartition(".")[2],
                              block_size=block_size)
        self.num_q_heads = num_q
        self.block_size = block_size
        self.max_model_len = int(loaded.max_model_len)
        self.max_blocks_per_seq = -(-self.max_model_len // block_size)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = config.step_token_budget
        self.num_blocks = self._size_pool(config.num_blocks, config.kv_cache_memory,
                                          config.gpu_memory_utilization)
        if tensor_parallel is not None:
            # One manager serves every rank's pool: all pools get the smallest rank's block count.
            self.num_blocks = tensor_parallel.min_int(self.num_blocks)
        self.pool = KVPool(self.spec, self.num_blocks, self.device, zero=True)
        # Swap lists as long as the pool: a step may have to carry a swap for every device block
        # (a host-tier hit's loads for each admitted prompt, the write-backs of every block its
        # allocations evict), and each list names a device block once.
        self.buffers = StepBuffers(max_num_seqs, self.max_num_batched_tokens,
                                   self.max_blocks_per_seq, device=self.device, csr=False,
                                   max_swaps=max(2 * self.max_blocks_per_seq, self.num_blocks))
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

            self.workspace = DecodeWorkspace(max_num_seqs, self.num_q_heads, self.spec.num_kv_heads,
                                             self.spec.head_dim, device=self.device)
        #: The decode planner (kernels only, ``decode_planner``): updated from the host lengths
        #: before every decode step, read by every layer's ``paged_decode`` and by the graphs.
        self.decode_plan = None
        if self.use_kernels and config.decode_planner:
            from ..decode_plan import DecodePlan

            self.decode_plan = DecodePlan(max_num_seqs, self.num_q_heads, self.spec.num_kv_heads,
                                          self.spec.head_dim, device=self.device)
            # Padded lengths of a graph batch: the step's own, zeros past them.
            self._plan_lens = np.zeros(max_num_seqs, dtype=np.int32)
        #: The host tier (:meth:`enable_swap`); None: no swapping.
        self.swap = None
        self.graph_sizes: list[int] = []
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        if self.is_cuda and self.use_kernels and config.cuda_graphs:
            self.capture_graphs(pieces=config.cuda_graph_pieces)

    # ------------------------------------------------------------------------------ set-up

    def _size_pool(self, num_blocks: Optional[int], kv_cache_memory: Any,
                   gpu_memory_utilization: Optional[float] = None) -> int:
        # The config validated all three (exclusive; the budget stored as bytes).
        per_block = self.spec.bytes_per_block
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

    def measure_rates(self, *, tokens: Optional[int] = None, cache: bool = True) -> "Rates":
        """The cost model's rates on this device (:class:`Rates`): read from the cache directory
        (:mod:`pagedkv.cache_dir`, ``rates/<key>.json``) when this model file, device, dtype,
        pool, step shape, host pool and forward were measured before, else measured
        (:meth:`measure_rates_now`) and recorded there. ``cache=False`` always measures, and
        records nothing. A model without a path on disk (built in memory) is always measured.
        A record is used only if its key equals this runner's (:meth:`rates_key`) and its rates
        are finite and positive; anything else is deleted and measured again.
        """
        key = self.rates_key(tokens) if cache else None
        if key is None:
            return self.measure_rates_now(tokens=tokens)
        from .. import cache_dir

        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        record = cache_dir.read_json("rates", name, lambda d: d["key"] == key
                                     and _rates_ok(d["rates"], self.swap is not None))
        if record is not None:
            r = record["rates"]
            link = r["host_link_bytes_per_s"]
            rates = Rates(float("nan") if link is None else float(link),
                          float(r["prefill_tokens_per_s"]), float(r["step_floor_s"]))
            _log.info("cost-model rates from the cache (%s): %s", name, _fmt_rates(rates))
            return rates
        t0 = time.perf_counter()
        rates = self.measure_rates_now(tokens=tokens)
        _log.info("cost-model rates measured in %.1f s: %s", time.perf_counter() - t0,
                  _fmt_rates(rates))
        link = rates.host_link_bytes_per_s
        cache_dir.write_json("rates", name, {"key": key, "rates": {
            "host_link_bytes_per_s": None if math.isnan(link) else link,
            "prefill_tokens_per_s": rates.prefill_tokens_per_s,
            "step_floor_s": rates.step_floor_s}})
        return rates

    def rates_key(self, tokens: Optional[int] = None) -> Optional[dict]:
        """What the measured rates depend on, as a JSON-able dict; ``None`` when the model has no
        file to fingerprint (then rates are not cached)."""
        path = getattr(self.loaded, "path", "") or ""
        try:
            fingerprint = _model_fingerprint(path) if path else None
        except OSError:
            fingerprint = None
        if fingerprint is None:
            return None
        import platform

        if self.is_cuda:
            device = torch.cuda.get_device_name(self.device)
        else:
            device = (f"cpu {platform.machine()} {platform.processor()} "
                      f"{torch.get_num_threads()} threads")
        cfg = self.engine_config
        return {
            "version": 1, "model": fingerprint, "device": device, "torch": torch.__version__,
            "dtype": self.spec.dtype, "block_size": self.block_size, "num_blocks": self.num_blocks,
            "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens":
            self.max_num_batched_tokens, "max_model_len": self.max_model_len, "tokens": tokens,
            "host_blocks": None if self.swap is None else int(self.swap.host.num_blocks),
            "staging_blocks": None if self.swap is None else int(self.swap.staging_blocks),
            "attention_backend": self.attention_backend, "fused": bool(self.fused),
            "cuda_graphs": bool(cfg.cuda_graphs and self.graph_sizes),
            "small_batch_gemv": self.gemv_rows, "tp_size": self.tp_size,
        }

    def measure_rates_now(self, *, tokens: Optional[int] = None) -> "Rates":
        """The cost model's rates measured on this device (:class:`Rates`).

        The link rate is a swap-out plus swap-in round trip of as many blocks as the staging holds
        (at most 32 MiB each way after one warm-up; NaN without a host pool).

        The step model ``max(floor, tokens / rate)`` is fitted where a recompute runs: beside a
        batch of up to 32 decoding sequences, as the scheduler re-admits a recomputed sequence.
        A decode-only step, then the same step carrying a prefill chunk of half and of all the
        room the token budget leaves (``tokens``, default ``min(max_num_batched_tokens,
        max_model_len - 1)``): the two chunks' added times give the rate, and the tokens a step
        absorbs for free give the floor. When even the full chunk adds nothing measurable, the
        rate is the chunk alone over its time. Each time is the best of two after a warm-up,
        through a scratch manager on this runner's buffers. Run it before the engine's manager
        attaches the buffers: it overwrites pool and host blocks (all free at start-up).
        """
        sync = torch.cuda.synchronize if self.is_cuda else (lambda *a: None)
        link = float("nan")
        if self.swap is not None:
            n = max(1, min(self.swap.staging_blocks, self.num_blocks, self.swap.host.num_blocks,
                           (32 << 20) // self.spec.bytes_per_block))
            pairs = np.stack([np.arange(n), np.arange(n)], axis=1)
            best = float("inf")
            for _ in range(3):  # the first is a warm-up
                sync()
                t0 = time.perf_counter()
                self.swap.swap_out(pairs)
                self.swap.swap_in(pairs)
                self.swap.synchronize()
                best = min(best, time.perf_counter() - t0)
            link = 2 * n * self.spec.bytes_per_block / best
        bs = self.block_size
        t = tokens or min(self.max_num_batched_tokens, self.max_model_len - 1)
        t = max(1, min(t, (self.num_blocks - 1) * bs))
        # The decode batch: as many 16-token sequences (up to 32) as the pool, the batch size
        # and the budget leave room for beside the full chunk.
        ctx, steps = 16, 10  # 9 measured steps append one token each
        room_blocks = self.num_blocks - 1 - -(-t // bs)
        per_seq = -(-(ctx + steps) // bs)
        b = max(0, min(32, self.max_num_seqs - 1, t - 1, room_blocks // per_seq))
        chunk = t - b
        mgr = BlockManager(self.num_blocks, bs, watermark_blocks=0,
                           max_blocks_per_seq=self.max_blocks_per_seq, enable_prefix_caching=False)
        mgr.attach_buffers(self.buffers)
        vocab = int(self.config.vocab_size)
        dec = list(range(1, b + 1))

        def timed(ids: list, news: list, inp: np.ndarray) -> float:
            step = mgr.step(ids, news)
            sync()
            t0 = time.perf_counter()
            self.execute(inp, None, step, [len(ids) - 1])
            sync()
            return time.perf_counter() - t0

        def run(n: int) -> float:
            """Best time of a step of the decode batch plus an ``n``-token prefill (0: none)."""
            ids = (np.arange(n, dtype=np.int64) * 7919) % vocab
            best = float("inf")
            for i in range(3):  # the first is a warm-up
                if dec:
                    mgr.append_batch(dec, [7] * b)
                if n:
                    mgr.admit(0, ids.tolist())
                tok = np.concatenate([np.full(b, 7, dtype=np.int64), ids])
                took = timed(dec + [0] * (n > 0), [1] * b + [n] * (n > 0), tok)
                if n:
                    mgr.free(0)
                if i:
                    best = min(best, took)
            return best

        try:
            for sid in dec:
                prompt = ((np.arange(ctx, dtype=np.int64) + sid) * 31) % vocab
                mgr.admit(sid, prompt.tolist())
                timed([sid], [ctx], prompt)
            if b == 0:
                full = run(chunk)
                rate, floor = chunk / full, min(run(min(16, chunk)), full)
            else:
                base = run(0)
                half, full = max(1, chunk // 2), chunk
                m_half, m_full = run(half) - base, run(full) - base
                if m_full - m_half > 0.02 * base and m_full > 0:
                    rate = (full - half) / (m_full - m_half)
                    absorbed = max(0.0, full - m_full * rate)
                else:  # the whole chunk rides along for free: a floor above the full step
                    rate = (full + b) / max(base + max(m_full, 0.0), 1e-9)
                    absorbed = float(full)
                floor = (absorbed + b) / rate
        finally:
            mgr.detach_buffers()
        return Rates(link, rate, floor)

    # ------------------------------------------------------------------------------ steps

    def execute(self, input_ids: Any, positions: Optional[Any], step: Any,
                sample_rows: Sequence[int], *,
                extra_logit_indices: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Runs one step; returns float32 logits ``[len(sample_rows) + len(extra), vocab]``.

        Args:
            input_ids: The step's new tokens, concatenated in batch order (``step.num_tokens``
                ints: numpy array, list or CPU tensor).
            positions: ``None``: the step's own (:meth:`pagedkv.StepBuffers.positions`, read
                from what the manager wrote: the one source). Given, they must equal those.
            step: The :class:`pagedkv.StepInfo` that ``manager.step`` returned for this batch
                (the manager filled :attr:`buffers`).
            sample_rows: Batch rows ``k`` whose last new token (index
                ``query_start_loc[k + 1] - 1``) gets logits, in the order wanted.
            extra_logit_indices: Packed token indices (``0 .. num_tokens - 1``) whose logits are
                appended after the sampled rows' (prompt logprobs). Not with tensor parallelism.

        With tensor parallelism (rank 0 only), the validated step — its tables and batch — is
        broadcast first, and every other rank runs it from :meth:`serve`.

        Raises:
            InvalidArgumentError: Lengths disagree with ``step``, given positions are not the
                step's, a sequence is longer than the model's context, a row is out of range, or
                the step exceeds the buffers.
            InvalidConfigError: Called on a tensor-parallel rank other than 0.
        """
        if self.tp_rank != 0:
            raise InvalidConfigError(
                f"tensor-parallel rank {self.tp_rank} runs the steps rank 0 sends (serve()), "
                f"not its own", field="tensor_parallel_size", value=self.tp_size,
                reason="execute on rank 0 only")
        n, t = int(step.num_seqs), int(step.num_tokens)
        ids = _as_int64(input_ids, "input_ids")
        given = None if positions is None else _as_int64(positions, "positions")
        if ids.shape[0] != t:
            raise InvalidArgumentError(
                f"invalid argument: input_ids has {ids.shape[0]} tokens, the step has {t}",
                what="input_ids", value=int(ids.shape[0]),
                reason=f"must have step.num_tokens = {t} entries")
        if t == 0 or n == 0:
            raise InvalidArgumentError("invalid argument: step: an empty step", what="step",
                                       value=0, reason="needs at least one token")
        if t > self.max_num_batched_tokens or n > self.max_num_seqs:
            raise InvalidArgumentError(
                f"invalid argument: step: {n} sequences / {t} tokens exceed the runner's "
                f"{self.max_num_seqs} / {self.max_num_batched_tokens}", what="step", value=t,
                reason="exceeds max_num_seqs / max_num_batched_tokens")
        rows = np.asarray(sample_rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= n):
            raise InvalidArgumentError(
                f"invalid argument: sample_rows: row {int(rows.max() if rows.max() >= n else rows.min())}"
                f" outside the batch of {n}", what="sample_rows", value=int(rows.size),
                reason=f"rows must be in [0, {n})")
        vocab = int(self.config.vocab_size)
        if int(ids.max()) >= vocab or int(ids.min()) < 0:
            raise InvalidArgumentError(
                f"invalid argument: input_ids: token ids must be in [0, {vocab})",
                what="input_ids", value=int(ids.max()), reason="outside the vocabulary")
        if int(step.max_seq_len) > self.max_model_len:
            raise InvalidArgumentError(
                f"invalid argument: step: a sequence of {int(step.max_seq_len)} tokens exceeds the "
                f"model's context of {self.max_model_len}", what="step",
                value=int(step.max_seq_len), reason=f"must be <= {self.max_model_len}")
        pos = self.buffers.positions(step)
        if given is not None and not np.array_equal(given, pos):
            bad = int(np.flatnonzero(given != pos)[0]) if given.shape == pos.shape else -1
            raise InvalidArgumentError(
                f"invalid argument: positions: {given.shape[0]} positions differ from the step's "
                f"(first at index {bad}): the step's are read from its tables",
                what="positions", value=bad, reason="must equal buffers.positions(step)")
        extra = np.asarray(extra_logit_indices if extra_logit_indices is not None else (),
                           dtype=np.int64).reshape(-1)
        if extra.size and (self.broadcaster is not None or extra.min() < 0 or extra.max() >= t):
            raise InvalidArgumentError(
                f"invalid argument: extra_logit_indices: must be in [0, {t}), without tensor "
                f"parallelism", what="extra_logit_indices", value=int(extra.size),
                reason=f"indices must be in [0, {t})")
        if self.broadcaster is not None:
            # Every rank runs this step: send it (validated, so no rank sees a bad one).
            self.broadcaster.send_step(step, ids, pos, rows)
        return self._run(ids, pos, step, rows,
                         inputs_on_device=self.is_cuda and self.tp is not None, extra=extra)

    def serve(self, *, until: Sequence[int] = ()) -> int:
        """A rank other than 0: runs the steps rank 0 broadcasts until a command; returns it.

        Returns on STOP, and on any command in ``until`` (``CMD_END``: the driver's ``generate``
        finished). Each step is run exactly as rank 0 runs it (same tables, same batch), its logits
        dropped: rank 0 samples.
        """
        if self.broadcaster is None or self.tp_rank == 0:
            raise InvalidConfigError("serve() runs on a tensor-parallel rank other than 0",
                                     field="tensor_parallel_size", value=self.tp_size,
                                     reason="not a receiving rank")
        while True:
            got = self.broadcaster.recv()
            if got.cmd == CMD_STEP:
                self._run(got.input_ids, got.positions, got.info, got.sample_rows,
                          inputs_on_device=self.is_cuda)
            elif got.cmd == CMD_STOP or got.cmd in until:
                return got.cmd

    def _run(self, ids: Optional[np.ndarray], pos: Optional[np.ndarray], step: Any,
             rows: np.ndarray, *, inputs_on_device: bool,
             extra: Optional[np.ndarray] = None) -> torch.Tensor:
        """The step itself (arguments validated). ``inputs_on_device``: the step buffers' device
        mirrors and the device ids/positions already hold this step (filled from the TP packet),
        so nothing is copied from the host; ``ids``/``pos`` may then be None."""
        n, t = int(step.num_seqs), int(step.num_tokens)
        host = self.buffers.host
        qsl = host.query_start_loc[: n + 1].numpy()
        last = qsl[1:][rows] - 1 if rows.size else np.zeros(0, dtype=np.int64)
        if extra is not None and extra.size:
            last = np.concatenate([last, extra])

        n_out = getattr(step, "num_swap_out", 0)
        n_in = getattr(step, "num_swap_in", 0)
        # A step with extra logits rows is never replayed: a graph keeps one row per sequence.
        decode = t == n and not (extra is not None and extra.size)
        graph_bs = self._graph_size(n) if decode else None
        if n_out or n_in:
            self._apply_swaps(host, n_out, n_in)
        if step.num_copies:
            # Copy-on-write before any layer writes: the copies carry the shared prefix of a block
            # into its private copy, and this step's new tokens land in the copy.
            self.pool.copy_blocks(host.copies[: step.num_copies])
        if inputs_on_device:
            dev = self.buffers.views(step, on_device=True)
        else:
            dev = self.buffers.to_device(step)
        if self.step_records is not None:
            self.step_records.append(self.step_record(step, ids, pos, rows))

        if not self.use_kernels:
            if ids is None:  # the step's batch arrived on the device (TP over NCCL)
                ids, pos = self._ids_dev[:t].cpu().numpy(), self._pos_dev[:t].cpu().numpy()
            return self._run_cpu(ids, pos, dev, n, qsl, last)
        if inputs_on_device:
            ids_d, pos_d = self._ids_dev[:t], self._pos_dev[:t]
        elif self.is_cuda:
            ids_d, pos_d = self._stage(ids, pos, t)
        else:
            ids_d, pos_d = torch.from_numpy(ids), torch.from_numpy(pos)
        if decode and self.decode_plan is not None:
            self._update_plan(host, n, graph_bs or n)
        if graph_bs is not None:
            out = self._replay(graph_bs, n, ids_d, pos_d, last)
            self._inputs_copied.synchronize()
            return out
        if decode:
            meta = self._cuda_meta("decode", dev.slot_mapping, dev.block_tables, dev.seq_lens,
                                   dev.query_start_loc, max_seq_len=int(step.max_seq_len))
        else:
            meta = self._cuda_meta("prefill", dev.slot_mapping, dev.block_tables, dev.seq_lens,
                                   dev.query_start_loc, max_seq_len=int(step.max_seq_len),
                                   max_q_len=int(step.max_query_len) or int(np.diff(qsl).max()))
        last_d = torch.from_numpy(last).to(self.device, non_blocking=True)
        out = self._forward(meta, ids_d[None], pos_d[None], last_d)[0].float()
        if self.is_cuda:
            self._inputs_copied.synchronize()
        return out

    def step_record(self, step: Any, ids: Optional[np.ndarray], pos: Optional[np.ndarray],
                    rows: np.ndarray) -> dict:
        """What this rank is about to run: the step's extent, the bytes of every step table in
        its extent as the model will read them (the device mirrors), the batch, and the addresses
        of the step buffers' device tensors. For checking ranks against each other (tests)."""
        dev = self.buffers.views(step, on_device=True)
        rec: dict = {"info": tuple(int(x) for x in step)}
        for name, tns in dev.items():
            rec[name] = tns.cpu().numpy().tobytes()
        t = int(step.num_tokens)
        if ids is None:
            ids, pos = self._ids_dev[:t].cpu().numpy(), self._pos_dev[:t].cpu().numpy()
        rec["input_ids"] = np.asarray(ids, dtype=np.int64).tobytes()
        rec["positions"] = np.asarray(pos, dtype=np.int64).tobytes()
        rec["sample_rows"] = np.asarray(rows, dtype=np.int64).tobytes()
        rec["addresses"] = tuple(tns.data_ptr() for _, tns in self.buffers.device.items())
        return rec

    def _apply_swaps(self, host: Any, n_out: int, n_in: int) -> None:
        """Queues the step's swaps and makes the forward's stream wait for them."""
        if self.swap is None:
            raise InvalidConfigError(
                "the step carries swaps but the runner has no host pool (call enable_swap with the "
                "manager's num_host_blocks)", field="num_host_blocks", value=0,
                reason="no host pool")
        # Swap-outs first: a device block a swap-out frees may be a swap-in's destination.
        if n_out:
            self.swap.swap_out(host.swap_out[:n_out])
        if n_in:
            self.swap.swap_in(host.swap_in[:n_in])
        # Only this step's forward waits (on the GPU) for the device side of its swaps.
        self.swap.wait()

    def _run_cpu(self, ids, pos, dev, n, qsl, last) -> torch.Tensor:
        q_lens = torch.from_numpy(np.diff(qsl).astype(np.int64))
        seq_lens = dev.seq_lens.to(torch.int64)
        meta = AttentionMetadata("cpu", self.pool.k_caches, self.pool.v_caches, dev.slot_mapping,
                                 dev.block_tables, dev.seq_lens, dev.query_start_loc)
        _attention.build_cpu_metadata(meta, self.block_size, q_lens, seq_lens)
        ids_t = torch.from_numpy(ids)[None]
        pos_t = torch.from_numpy(pos)[None]
        return self._forward(meta, ids_t, pos_t, torch.from_numpy(last))[0].float()

    @torch.inference_mode()
    def _forward(self, meta: AttentionMetadata, ids: torch.Tensor, pos: torch.Tensor,
                 keep: Any) -> torch.Tensor:
        if self.fused:
            return _fused.fused_forward(self.model, meta, ids, pos, keep)
        with forward_context(meta, self.model):
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False,
                             logits_to_keep=keep)
        return out.logits

    # ------------------------------------------------------------------------------ CUDA

    def _stage(self, ids: np.ndarray, pos: np.ndarray, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._ids_host[:t].numpy()[:] = ids
        self._pos_host[:t].numpy()[:] = pos
        self._ids_dev[:t].copy_(self._ids_host[:t], non_blocking=True)
        self._pos_dev[:t].copy_(self._pos_host[:t], non_blocking=True)
        self._inputs_copied.record()
        return self._ids_dev[:t], self._pos_dev[:t]

    def _cuda_meta(self, mode, slot_mapping, block_tables, seq_lens, qsl, *, max_q_len=0,
                   max_seq_len=0) -> AttentionMetadata:
        return AttentionMetadata(mode, self.pool.k_caches, self.pool.v_caches, slot_mapping,
                                 block_tables, seq_lens, qsl, max_q_len=max_q_len,
                                 max_seq_len=max_seq_len, workspace=self.workspace,
                                 gemv_rows=self.gemv_rows,
                                 plan=self.decode_plan if mode == "decode" else None)

    def _update_plan(self, host: Any, n: int, bs: int) -> None:
        """Plans a decode step of ``n`` sequences run as a batch of ``bs >= n`` rows (a graph's
        padding rows have length 0). The plan only balances the work: the kernels read the
        lengths from the device mirrors, so a plan from stale host lengths (a TP rank whose host
        tables are not refreshed) costs speed, never correctness."""
        lens = self._plan_lens
        lens[:n] = host.seq_lens[:n].numpy()
        lens[n:bs] = 0
        self.decode_plan.update(lens[:bs])

    def _graph_size(self, n: int) -> Optional[int]:
        for s in self.graph_sizes:
            if s >= n:
                return s
        return None

    def capture_graphs(self, sizes: Optional[Sequence[int]] = None, *, pieces: int = 1) -> None:
        """Captures one decode CUDA graph per padded batch size (default :func:`graph_batch_sizes`).

        ``pieces > 1`` (fused forward only): each batch size's step is captured as that many
        graphs of consecutive layers, replayed in turn, so the GPU starts on the first while the
        host still launches the later ones (the same kernels on the same buffers: equal logits).

        Each graph runs the whole model on ``bs`` tokens: static ids/positions (the runner's device
        staging buffers), and the step buffers' device mirrors ``slot_mapping[:bs]``,
        ``block_tables[:bs]``, ``seq_lens[:bs]`` in place. With the decode planner, each graph
        launches the plan's fixed grid and reads the plan updated before each replay; without it,
        the split count is fixed at capture from ``max_model_len`` (each sequence's own split
        length is computed in the kernel). Graphs share one memory pool, captured largest first.
        """
        if not (self.is_cuda and self.use_kernels):
            return
        sizes = sorted(set(sizes or graph_batch_sizes(self.max_num_seqs)), reverse=True)
        dev = self.buffers.device
        mempool = torch.cuda.graph_pool_handle()
        for bs in sizes:
            if bs > self.max_num_seqs:
                continue
            # Padding: no slot written, no key read. Warm-up and capture see the same state.
            dev.slot_mapping[:bs].fill_(-1)
            dev.seq_lens[:bs].fill_(0)
            if self.decode_plan is not None:
                # A graph captured with a plan launches its fixed grid and reads the plan's
                # buffers in place: each replay runs the plan updated just before it.
                self._plan_lens[:bs] = 0
                self.decode_plan.update(self._plan_lens[:bs])
            meta = self._cuda_meta("decode", dev.slot_mapping[:bs], dev.block_tables[:bs],
                                   dev.seq_lens[:bs], dev.query_start_loc[: bs + 1],
                                   max_seq_len=self.max_model_len)
            ids = self._ids_dev[:bs][None]
            pos = self._pos_dev[:bs][None]
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles the Triton kernels, settles lazy allocations
                    self._forward(meta, ids, pos, 0)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if pieces > 1 and self.fused:
                chain = _GraphChain(self.model, meta, ids, pos, pieces, mempool)
                self._graphs[bs] = (chain, chain.logits)
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                logits = self._forward(meta, ids, pos, 0)
            self._graphs[bs] = (graph, logits)
        torch.cuda.synchronize(self.device)
        self.graph_sizes = sorted(self._graphs)

    def _replay(self, bs: int, n: int, ids_d, pos_d, last: np.ndarray) -> torch.Tensor:
        graph, logits = self._graphs[bs]
        if n < bs:
            dev = self.buffers.device
            # The mirrors past the step hold stale rows: make the padding rows inert.
            dev.slot_mapping[n:bs].fill_(-1)
            dev.seq_lens[n:bs].fill_(0)
        graph.replay()
        # Decode: batch row k's token is packed row k.
        if last.size == n and np.array_equal(last, np.arange(n)):
            return logits[0, :n].float()
        idx = torch.from_numpy(last).to(self.device, non_blocking=True)
        return logits[0].index_select(0, idx).float()


class _GraphChain:
    """One decode step captured as several CUDA graphs of consecutive layers (the first with the
    embedding, the last with the final norm and LM head) in one memory pool; :meth:`replay` runs
    them in order on the current stream. The hidden state and residual handed from one graph to
    the next are tensors of the pool this object keeps alive, so no later capture reuses them."""

    def __init__(self, model: Any, meta: AttentionMetadata, ids: torch.Tensor, pos: torch.Tensor,
                 pieces: int, mempool: Any) -> None:
        n_layers = int(model.config.num_hidden_layers)
        pieces = max(1, min(pieces, n_layers))
        cuts = [round(n_layers * k / pieces) for k in range(pieces + 1)]
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self._keep: list[torch.Tensor] = []
        h = cos = sin = logits = torch.empty(0)
        residual: Optional[torch.Tensor] = None
        with torch.inference_mode():
            for k in range(pieces):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=mempool):
                    if k == 0:
                        h, cos, sin = _fused.fused_prologue(model, ids, pos)
                    h, residual = _fused.fused_layers(model, meta, h, residual, cos, sin,
                                                      cuts[k], cuts[k + 1])
                    if k == pieces - 1:
                        logits = _fused.fused_epilogue(model, meta, h, residual, 0)
                self.graphs.append(g)
                self._keep += [h, residual, cos, sin]
        self.logits = logits

    def replay(self) -> None:
        for g in self.graphs:
            g.replay()


def _as_int64(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            x = x.cpu()
        x = x.numpy()
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"invalid argument: {name}: {exc}", what=name, value=-1,
                                   reason="not an integer array") from None
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise InvalidArgumentError(f"invalid argument: {name}: expected a 1-D integer array",
                                   what=name, value=int(a.size), reason="not a 1-D integer array")
    return np.ascontiguousarray(a, dtype=np.int64)


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
