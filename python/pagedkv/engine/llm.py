"""The engine: requests in, tokens out, every KV read and write through the paged cache.

Owns :class:`LLMEngine` (``add_request`` / ``step`` / ``has_unfinished_requests``, one scheduler step
per call) and :class:`LLM` (``generate``: a batch of prompts to completion, outputs in input order),
shaped like vLLM's offline API. The pieces it ties together, each owning its own invariants:

* :class:`pagedkv.scheduler.Scheduler` decides who runs each step (decodes first, then chunked
  prefill; preemption by recompute when appends would dip into the watermark);
* :class:`pagedkv.BlockManager` owns block tables, the prefix cache and copy-on-write, and fills the
  step buffers the model runner reads;
* :class:`pagedkv.engine.model_runner.ModelRunner` runs one step of the model through the pool;
* :mod:`pagedkv.engine.sampler` turns logits into tokens.

Invariants of this module:

* a request is validated completely (prompt, parameters, salt, fit) before anything is queued: bad
  input raises a :mod:`pagedkv.errors` class and leaves the engine unchanged;
* a request with ``n > 1`` is queued as one sequence; when its prompt's prefill completes, the same
  logits seed all ``n`` samples and the other ``n - 1`` sequences are forked from it, sharing its
  KV blocks copy-on-write (the prompt is computed once);
* a completion finishes with ``"stop"`` on an end-of-sequence token (unless ``ignore_eos``), a
  ``stop_token_ids`` entry or a stop string in its text (neither before ``min_tokens``), and with
  ``"length"`` at ``max_tokens`` or when the sequence fills the model's context;
* ``max_model_len`` is the model's context, or what the KV pool holds for one sequence when that
  is less (logged at start-up); a request whose prompt reaches it, or whose prompt plus
  ``max_tokens`` exceeds a pool-set limit, is refused at ``add_request``, never cut short;
* every generated token is fed once to its sample's output state (:mod:`.output_state`:
  incremental text, stop strings, logprobs), so a step's work per sample does not grow with the
  text; what a step reports follows the request's ``output_kind``;
* a preempted sequence keeps its tokens and is either swapped out to the host KV pool (its blocks
  copied back before it runs again) or recomputed, per the cost model (``preemption_mode``); since
  draws depend only on the sample's seed and position (:mod:`.sampler`), its output is what it
  would have been without preemption, whichever mode reclaimed it.
"""

from __future__ import annotations

import array
import itertools
import logging
import math
import os
import random
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union, overload

import numpy as np
import torch
from tqdm.auto import tqdm

from .._checks import DEFAULT_BLOCK_SIZE
from ..distributed.launch import build_worker, dist_rank, serve_until_end, start_tp
from ..distributed.step_broadcast import CMD_STOP
from ..errors import InvalidArgumentError, OutOfBlocksError
from ..manager import CostModel
from ..scheduler import Scheduler, SequenceStatus
from ..scheduler import Sequence as SchedulerSequence
from ..tiers.cache import build_tier_cache, manager_tier_args
from .config import EngineConfig
from .loader import LoadedModel, default_model_path, load_model
from .model_runner import ModelRunner, build_rank_runner
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampler import SamplerRow, sample_batch, sample_seed
from .sampling_params import RequestOutputKind, SamplingParams
from .summary import log_startup

__all__ = ["LLM", "LLMEngine", "EngineStats"]

logger = logging.getLogger("pagedkv")

Prompt = Union[str, Sequence[int], Dict[str, Any]]


def _bad(what: str, value: Any, reason: str) -> InvalidArgumentError:
    shown = value if not isinstance(value, (list, tuple)) or len(value) <= 8 else f"<{len(value)} items>"
    return InvalidArgumentError(
        f"invalid argument: {what} = {shown!r}: {reason}", what=what, value=shown, reason=reason
    )


_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _check_prompt_mapping(prompt: Any) -> None:
    """A mapping is a prompt only as a plain dict of ``prompt`` / ``prompt_token_ids``: iterating
    anything else (a ``BatchEncoding`` iterates its key names) would generate from key names."""
    keys = sorted(map(str, prompt.keys()))
    kind = type(prompt).__name__
    if not isinstance(prompt, dict):
        hint = (" (apply_chat_template returns one: pass the messages to LLM.chat(), or its "
                "['input_ids'] as the prompt)" if kind == "BatchEncoding" else "")
        raise _bad("prompt", f"<{kind} with keys {keys}>",
                   f"a {kind} is not a prompt{hint}; a prompt is a string, token ids or a dict "
                   f"with {list(_PROMPT_KEYS)}; conversations go to LLM.chat()")
    unknown = [k for k in keys if k not in _PROMPT_KEYS]
    if unknown or not keys:
        raise _bad("prompt", f"<dict with keys {keys}>",
                   f"a dict prompt has only the keys {list(_PROMPT_KEYS)} (unknown: {unknown}); "
                   f"a list of chat messages goes to LLM.chat()")


@dataclass
class EngineStats:
    """Counters of an engine since it was created (or since :meth:`LLMEngine.reset_stats`)."""

    #: Requests added / finished.
    num_requests: int
    num_finished_requests: int
    #: Prompt tokens of the requests added (each prompt once, whatever its ``n``).
    num_prompt_tokens: int
    #: Tokens generated, over all samples.
    num_generated_tokens: int
    #: Tokens the model computed in prefill chunks (prompt tokens not served by the prefix cache,
    #: plus whatever preemption made it recompute).
    num_prefill_tokens: int
    #: Scheduler steps run, and the seconds spent inside :meth:`LLMEngine.step`.
    num_steps: int
    busy_time_s: float
    #: ``num_generated_tokens / busy_time_s``.
    generation_tokens_per_s: float
    #: ``(prefill + generated tokens) / busy_time_s``.
    total_tokens_per_s: float
    #: Time to first token over finished requests: mean and max, seconds.
    mean_ttft_s: Optional[float]
    max_ttft_s: Optional[float]
    #: KV blocks in use after each step, as a fraction of the pool: peak and mean over steps.
    peak_kv_utilization: float
    mean_kv_utilization: float
    #: Most sequences running in one step.
    peak_running_seqs: int
    #: The manager's prefix cache: hit ratio and hit tokens (over every admission, recomputes too).
    prefix_hit_ratio: float
    prefix_hit_tokens: int
    #: Prompt tokens of the added requests served from the prefix cache at their first admission,
    #: over all their prompt tokens.
    request_prefix_hit_ratio: float
    #: Sequences preempted, copy-on-write block copies, cache evictions.
    num_preemptions: int
    cow_copies: int
    evictions: int
    #: The pool.
    num_blocks: int
    block_size: int
    #: Preempted sequences by how they were reclaimed (they add up to ``num_preemptions``).
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    #: KV blocks copied to the host pool and back (the swap engine's counts).
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    #: Prompt tokens served from each tier of the prefix cache (``"gpu"``, ``"host"``,
    #: ``"disk"``, ``"remote"``; they add up to ``prefix_hit_tokens``). A block fetched from a
    #: lower tier for a request counts for that tier, not the host tier it passed through.
    prefix_hits_by_tier: Dict[str, int] = field(default_factory=dict)
    #: Bytes each tier served (read from it: host → GPU loads, disk/remote → host fetches) and
    #: took (written to it: GPU → host offloads, host → disk/remote demotions).
    tier_bytes_read: Dict[str, int] = field(default_factory=dict)
    tier_bytes_written: Dict[str, int] = field(default_factory=dict)
    #: Bytes each tier holds now (``None`` where it cannot be known: a shared remote store).
    tier_usage_bytes: Dict[str, Optional[int]] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        """The counters as a plain dict (for JSON)."""
        return asdict(self)


class _Request:
    """Engine-side state of one request: its samples' sequences and how each ended."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "cache_salt", "seed", "seqs",
                 "finish", "num_finished", "metrics", "forked", "seq_seeds", "states", "banned",
                 "prompt_logprobs", "prompt_lp_next", "prompt_lp_sent")

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: List[int],
                 params: SamplingParams, cache_salt: Optional[bytes], seed: int,
                 arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.cache_salt = cache_salt
        self.seed = seed
        #: One slot per sample; samples 1.. are filled when sample 0's prefill completes.
        self.seqs: List[Any] = [None] * params.n
        #: (finish_reason, stop_reason) per sample, ``None`` while running.
        self.finish: List[Optional[Tuple[str, Union[int, str, None]]]] = [None] * params.n
        #: Entries of ``finish`` set (each is set once: a finished sample runs no more).
        self.num_finished = 0
        #: Per sample: text, stop strings, logprobs, what was reported (set by the engine).
        self.states: List[Any] = []
        #: Tokens that cannot be sampled before ``min_tokens`` (set by the engine).
        self.banned: frozenset = frozenset()
        #: Prompt logprobs collected so far (first entry None), and the next prompt position
        #: whose logits give one; whether a delta output has carried them yet.
        self.prompt_logprobs: Optional[List[Any]] = None
        self.prompt_lp_next = 0
        self.prompt_lp_sent = False
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.forked = params.n == 1
        self.seq_seeds = [sample_seed(seed, i) for i in range(params.n)]

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.finish)


class LLMEngine:
    """One model served through the paged KV cache, one scheduler step per :meth:`step` call.

    Args:
        model: A Hugging Face model directory (``config.json`` + safetensors [+ tokenizer]) or a
            ``.gguf`` file; ``None`` loads the embedded SmolLM2-135M-Instruct GGUF. Loaded offline.
            A :class:`~pagedkv.engine.loader.LoadedModel` is used as it is (``device`` and
            ``dtype`` are then its own).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``; ``None``: CUDA when available, else the CPU.
        dtype: Weights and KV dtype (``torch.dtype`` or its name); ``None``: the loader's default
            (float32 on the CPU, the checkpoint's dtype on a GPU).
        kv_cache_memory: Bytes of KV pool (the runner sizes the pool from it); exclusive with
            ``num_blocks``. Neither: the runner's default sizing.
        num_blocks: Blocks in the KV pool.
        block_size: Tokens per block.
        max_num_seqs: Most sequences in one step.
        max_num_batched_tokens: Token budget of one step (decodes plus prefill chunks); prompts
            longer than this are prefilled in chunks.
        enable_prefix_caching: Share and cache full KV blocks by prefix hash.
        enable_chunked_prefill: Split prompts over steps to fit ``max_num_batched_tokens``.
        watermark_blocks: Blocks kept back from admissions (``None``: the manager's default).
        cuda_graphs: Capture decode steps in CUDA graphs (CUDA only).
        progress: Show a progress bar while loading.
        swap_space: Bytes of host (pinned) memory for swapped-out KV blocks (int or ``"4GiB"``);
            exclusive with ``num_host_blocks``. Neither: no host pool, every preemption recomputes.
        num_host_blocks: Blocks in the host KV pool.
        preemption_mode: ``"auto"`` (the cost model picks swap or recompute per victim),
            ``"swap"`` (swap whenever the host pool has room) or ``"recompute"``.
        host_link_bytes_per_s: Host-link bandwidth for the cost model; ``None``: measured at
            start-up (with a host pool and ``preemption_mode="auto"``).
        prefill_tokens_per_s: Prefill throughput for the cost model; ``None``: measured likewise.
        step_floor_s: Seconds a step costs however few tokens it carries (the cost model's step
            floor: recompute tokens that fit under it ride along for free); ``None``: measured
            when the rates are, else 0 (a linear model).
        tensor_parallel_size: Ranks the model's heads are split over (``docs/tp.md``). Above 1,
            without a torch.distributed process group this process becomes rank 0 and spawns the
            others (rank ``r`` on ``cuda:r``, or the CPU with gloo); with one (``torchrun``), the
            group's size must match and this must be its rank 0 (the others construct
            :class:`LLM`). Call :meth:`shutdown` when done (also run at interpreter exit).
        record_steps: With tensor parallelism, every rank records what each step ran (its step
            tables and batch); :attr:`tp_step_records` has them, per rank, after :meth:`shutdown`.
        tp_timeout_s: Timeout of the tensor-parallel process group's collectives.
        host_cache_memory: Bytes of pinned host memory for the host tier of the prefix cache (int
            or ``"16GiB"``): cached blocks the GPU pool evicts are written back there and loaded
            again on a hit (``docs/tiers.md``). It shares the host pool with ``swap_space``;
            swapped blocks take precedence. ``None``: no host tier.
        host_cache_write_through: Copy each block to the host tier when it is first cached
            instead of when the GPU pool evicts it.
        disk_cache_dir: A directory for the disk tier (created owner-only): blocks the host
            tier drops are written there and found again, also by a restarted engine of the same
            model and configuration. Needs ``host_cache_memory`` and ``disk_cache_memory``.
        disk_cache_memory: The disk tier's size cap in bytes (int or ``"200GiB"``).
        remote_cache_url: A Redis or Valkey server (``redis://host:port/db``) shared by several
            engines as the remote tier (extra ``pagedkv[remote]``). Needs ``host_cache_memory``.
        remote_cache_timeout_s: Per-operation timeout of the remote tier; a slow or dead server
            is a miss, never a stalled step.
        hash_seed: The prefix-hash key (u64). ``None``: a random per-process key, or with a disk
            tier the key kept (owner-only) in ``disk_cache_dir``. Engines sharing a remote tier
            or a prefix-aware router must share it (``docs/prefix-hash.md`` says what that gives up;
            ``docs/router.md``). Treat it as a secret.
        kv_events_endpoint: Publish the KV cache's block events (stored, removed, cleared) on this
            ZeroMQ endpoint, one vLLM-format batch per step (``docs/kv-events.md``); ``None``: off.
        kv_events_replay_endpoint: The ZeroMQ endpoint (bound) consumers replay missed batches
            from; needs ``kv_events_endpoint``.
        kv_events_topic: The topic frame of every event message.
        gpu_memory_utilization: CUDA only: the KV pool's share of the device memory free after
            loading (default 0.85, less a 4 GiB reserve); exclusive with ``num_blocks`` and
            ``kv_cache_memory``.
        seed: Seeds the sampling seeds of requests that give none (``None``: random).
        tier_secret_file: A 0600 file of the engine's user holding the fleet's tier secret
            (authenticates disk and remote tier records; ``docs/tiers.md``, "Trust");
            ``None``: ``PAGEDKV_TIER_SECRET``. A remote tier without either refuses to start.

    Raises:
        ModelLoadError: ``model`` does not exist, is not a model directory or ``.gguf`` file, or is
            not a Llama-family architecture.
        ConfigArgumentError: A setting is out of range, or two exclusive ones are given (the
            keywords build an :class:`~pagedkv.engine.config.EngineConfig`, validated once;
            :meth:`from_config` takes one directly).
        InvalidConfigError: The tensor-parallel split does not fit the model or the machine.
        InvalidArgumentError: ``device`` or ``dtype`` is not understood.
    """

    def __init__(
        self,
        model: Union[str, LoadedModel, None] = None,
        *,
        device: Optional[str] = None,
        dtype: Any = None,
        kv_cache_memory: Union[int, str, None] = None,
        num_blocks: Optional[int] = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        watermark_blocks: Optional[int] = None,
        cuda_graphs: bool = True,
        progress: bool = False,
        swap_space: Union[int, str, None] = None,
        num_host_blocks: Optional[int] = None,
        preemption_mode: str = "auto",
        host_link_bytes_per_s: Optional[float] = None,
        prefill_tokens_per_s: Optional[float] = None,
        step_floor_s: Optional[float] = None,
        tensor_parallel_size: int = 1,
        record_steps: bool = False,
        tp_timeout_s: float = 600.0,
        host_cache_memory: Union[int, str, None] = None,
        host_cache_write_through: bool = False,
        disk_cache_dir: Optional[str] = None,
        disk_cache_memory: Union[int, str, None] = None,
        remote_cache_url: Optional[str] = None,
        remote_cache_timeout_s: float = 0.05,
        hash_seed: Optional[int] = None,
        kv_events_endpoint: Optional[str] = None,
        kv_events_replay_endpoint: Optional[str] = None,
        kv_events_topic: str = "",
        gpu_memory_utilization: Optional[float] = None,
        seed: Optional[int] = None,
        tier_secret_file: Optional[str] = None,
    ) -> None:
        config = EngineConfig(
            kv_cache_memory=kv_cache_memory, num_blocks=num_blocks, block_size=block_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill, watermark_blocks=watermark_blocks,
            cuda_graphs=cuda_graphs, progress=progress, swap_space=swap_space,
            num_host_blocks=num_host_blocks, preemption_mode=preemption_mode,
            host_link_bytes_per_s=host_link_bytes_per_s,
            prefill_tokens_per_s=prefill_tokens_per_s, step_floor_s=step_floor_s,
            tensor_parallel_size=tensor_parallel_size, record_steps=record_steps,
            tp_timeout_s=tp_timeout_s, host_cache_memory=host_cache_memory,
            host_cache_write_through=host_cache_write_through, disk_cache_dir=disk_cache_dir,
            disk_cache_memory=disk_cache_memory, remote_cache_url=remote_cache_url,
            remote_cache_timeout_s=remote_cache_timeout_s, hash_seed=hash_seed,
            kv_events_endpoint=kv_events_endpoint,
            kv_events_replay_endpoint=kv_events_replay_endpoint, kv_events_topic=kv_events_topic,
            gpu_memory_utilization=gpu_memory_utilization, seed=seed,
            tier_secret_file=tier_secret_file,
        )
        self._setup(model, device, dtype, config)

    @classmethod
    def from_config(cls, config: EngineConfig, model: Union[str, LoadedModel, None] = None, *,
                    device: Optional[str] = None, dtype: Any = None) -> "LLMEngine":
        """An engine with the settings of ``config`` (the constructor's keywords, validated once);
        ``model``, ``device`` and ``dtype`` as for the constructor."""
        if not isinstance(config, EngineConfig):
            raise _bad("config", type(config).__name__, "must be an EngineConfig")
        engine = cls.__new__(cls)
        engine._setup(model, device, dtype, config)
        return engine

    def _setup(self, model: Union[str, LoadedModel, None], device: Optional[str], dtype: Any,
               config: EngineConfig) -> None:
        #: The settings this engine runs with.
        self.config = config
        #: Rank 0's handle on the tensor-parallel group (None without TP).
        self._tp: Any = None
        #: After :meth:`shutdown` with ``record_steps``: each rank's step records, in rank order.
        self.tp_step_records: Optional[List[Any]] = None
        preloaded = model if isinstance(model, LoadedModel) else None
        if preloaded is not None:
            device = preloaded.device
            path = preloaded.path
        else:
            if device is None:
                device = "cuda" if torch.cuda.is_available() else "cpu"
            path = default_model_path() if model is None else model

        bar = _stage_bar(config.progress, total=3, desc="loading model")
        try:
            self.loaded = preloaded or load_model(path, device=device, dtype=dtype)
            bar.update(1)
            if config.tensor_parallel_size > 1:
                self._tp = start_tp(self.loaded, preloaded=preloaded is not None, path=str(path),
                                    config=config, build=build_rank_runner)
                self.runner = ModelRunner(self.loaded, config, tensor_parallel=self._tp.group)
                self._tp.runner = self.runner
            else:
                self.runner = ModelRunner(self.loaded, config)
            bar.update(1)
            host_blocks = config.host_blocks(self.runner.spec.bytes_per_block)
            extra: Dict[str, Any] = {}
            #: ``(host link bytes/s, prefill tokens/s, step floor s)`` of the cost model, or None.
            self.cost_rates: Optional[Tuple[float, float, float]] = None
            if host_blocks:
                self.runner.enable_swap(host_blocks)
                extra["num_host_blocks"] = host_blocks
                if config.preemption_mode == "auto":
                    link = config.host_link_bytes_per_s
                    tps, floor = config.prefill_tokens_per_s, config.step_floor_s
                    if link is None or tps is None:
                        measured = self.runner.measure_rates()
                        link = link if link is not None else measured.host_link_bytes_per_s
                        tps = tps if tps is not None else measured.prefill_tokens_per_s
                        floor = floor if floor is not None else measured.step_floor_s
                    self.cost_rates = (float(link), float(tps), float(floor or 0.0))
            extra.update(manager_tier_args(config))
            if config.kv_events_endpoint is not None:
                from ..events.engine import KV_EVENT_CAPACITY

                extra["kv_event_capacity"] = KV_EVENT_CAPACITY
            # The runner's pool and step buffers fix the manager's shape; it attaches the buffers.
            self.manager = self.runner.new_block_manager(
                watermark_blocks=config.watermark_blocks,
                enable_prefix_caching=config.enable_prefix_caching, **extra,
            )
            if self.cost_rates is not None:
                _set_cost_model(self.manager, self.cost_rates, self.runner.spec.bytes_per_token,
                                config.max_num_batched_tokens if config.enable_chunked_prefill
                                else 0)
            #: The step's KV-event publisher (None without ``kv_events_endpoint``); a lower tier
            #: adds its events to ``kv_events.sink``.
            self.kv_events: Any = None
            if config.kv_events_endpoint is not None:
                from ..events.engine import StepEventPublisher

                self.kv_events = StepEventPublisher(self.manager, config.kv_events_endpoint,
                                                    config.kv_events_replay_endpoint,
                                                    config.kv_events_topic)
            #: The tiers below the GPU (:mod:`pagedkv.tiers`); None without a host tier.
            self.tiers = build_tier_cache(
                config, self.runner, self.manager, str(path),
                self.cost_rates[1] if self.cost_rates else None,
                events=self.kv_events.sink if self.kv_events is not None else None)
            bpb = self.runner.spec.bytes_per_block
            self.scheduler = Scheduler(
                self.manager, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
                preemption_mode=config.preemption_mode, admission_gate=self.tiers,
                # A host pool that is the host tier's alone: preemption recomputes, as without it.
                can_swap=False if config.host_blocks(bpb) == config.host_cache_blocks(bpb) else None,
            )
            bar.update(1)
        except BaseException:
            if self._tp is not None:
                self._tp.close()
            raise
        finally:
            bar.close()

        self.device = torch.device(device)
        self.model_path = str(path)
        self.tokenizer = self.loaded.tokenizer
        self.block_size = block_size = config.block_size
        #: The model's own context (``max_position_embeddings``, capped at a sliding window).
        self.model_context_len = int(self.loaded.max_model_len)
        # What the pool can hold for one sequence above the watermark (so a preempted sequence can
        # always be re-admitted into an otherwise empty pool).
        room = (self.manager.num_blocks - self.manager.watermark_blocks) * block_size
        #: The longest sequence (prompt and completion) the engine serves: the model's context, or
        #: less when the KV pool cannot hold that much for one sequence.
        self.max_model_len = min(self.model_context_len, room,
                                 self.manager.max_blocks_per_seq * block_size)
        if self.max_model_len < self.model_context_len:
            logger.warning(
                "the KV pool holds at most %d tokens for one sequence (%d blocks of %d, %d held "
                "back): max_model_len is %d, below the model's context of %d; longer requests "
                "are refused", room, self.manager.num_blocks, block_size,
                self.manager.watermark_blocks, self.max_model_len, self.model_context_len)
        self.eos_token_ids = frozenset(int(t) for t in (self.loaded.eos_token_ids or ()))
        self.vocab_size = int(getattr(self.loaded.config, "vocab_size", 0) or 0)

        self._requests: Dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        # Seeds for requests that give none: drawn once per request, so even an unseeded request
        # resumes unchanged after a preemption.
        self._seed_rng = random.Random(config.seed)
        self._token_text: Dict[int, str] = {}
        self.reset_stats()
        log_startup(self)

    def shutdown(self) -> None:
        """Stops the tensor-parallel ranks (STOP to every rank, spawned processes joined) and
        collects :attr:`tp_step_records`; closes the KV-event publisher and the tiers below the
        host (pending fetches released, writes flushed). Idempotent. The engine cannot run
        steps afterwards."""
        tiers = getattr(self, "tiers", None)
        if tiers is not None:
            tiers.close()
            self.tiers = None
        if self.kv_events is not None:
            self.kv_events.close()
        if self._tp is not None and not self._tp.closed:
            self._tp.close()
            self.tp_step_records = self._tp.step_records

    # ------------------------------------------------------------------------------ requests

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (``None`` for a model directory without one)."""
        return self.tokenizer

    def tokenize(self, prompt: Prompt) -> Tuple[Optional[str], List[int]]:
        """``(text or None, token ids)`` of a prompt, validated against the model.

        A prompt is a string (encoded with the tokenizer, special tokens as the tokenizer adds
        them), a sequence of token ids, or a dict with ``"prompt"`` or ``"prompt_token_ids"`` (with
        both, the ids are used and the text is only reported). Any other mapping (a chat message,
        a tokenizer's ``BatchEncoding``) is refused, never iterated.

        Raises:
            InvalidArgumentError: The prompt is empty, of the wrong type, holds an id outside the
                vocabulary, is a string for a model without a tokenizer, or leaves no room in the
                model's context (or the KV pool) for a generated token.
        """
        given_text: Optional[str] = None
        if isinstance(prompt, Mapping):
            _check_prompt_mapping(prompt)
            if "prompt_token_ids" in prompt:
                if isinstance(prompt.get("prompt"), str):
                    given_text = prompt["prompt"]
                prompt = prompt["prompt_token_ids"]
            else:
                prompt = prompt["prompt"]
        elif prompt is None:
            raise _bad("prompt", None, "None is not a prompt (a string, token ids or "
                                       "{'prompt_token_ids': [...]}); conversations go to LLM.chat()")
        text: Optional[str] = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise _bad("prompt", prompt, "the model has no tokenizer: give token ids")
            text = prompt
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, (bytes, bytearray)) or not hasattr(prompt, "__len__"):
            raise _bad("prompt", prompt, "must be a string or a sequence of token ids")
        else:
            ids = self._check_ids(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
        if given_text is not None:
            text = given_text
        if not ids:
            raise _bad("prompt", text if text is not None else ids, "the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise _bad("prompt", ids, f"{len(ids)} tokens leave no room for a generated token "
                                      f"within max_model_len = {self.max_model_len} "
                                      f"({self._limit_name()})")
        return text, ids

    def _check_ids(self, seq: Any) -> List[int]:
        """``seq``'s token ids as a new list of ints, each checked against the vocabulary."""
        ids = list(seq)
        # The common case (a list of plain ints) is checked at C speed: the per-token loop
        # costs a 32K-token prompt ~4.7 ms of its time to first token; the type set and one
        # packing into int64s (whose min and max numpy then reads) ~1.1 ms.
        if ids and set(map(type, ids)) == {int}:
            try:
                packed = np.frombuffer(array.array("q", ids), dtype=np.int64)
            except OverflowError:  # beyond int64: outside any vocabulary, the loop says which
                packed = None
            if packed is not None and packed.min() >= 0 and not (
                    self.vocab_size and packed.max() >= self.vocab_size):
                return ids
        out = []
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise _bad("prompt", t, "token ids must be ints")
            if t < 0 or (self.vocab_size and t >= self.vocab_size):
                raise _bad("prompt", t, f"token id outside the vocabulary [0, {self.vocab_size})")
            out.append(int(t))
        return out

    def _limit_name(self) -> str:
        return ("the model's context" if self.max_model_len == self.model_context_len
                else "what the KV pool holds for one sequence")

    def add_request(
        self,
        request_id: Optional[str],
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        *,
        cache_salt: Union[str, bytes, None] = None,
        arrival_time: Optional[float] = None,
    ) -> str:
        """Queues a request; returns its id.

        Args:
            request_id: A new id (``None``: one is generated).
            prompt: A string, a sequence of token ids, or ``{"prompt": ...}`` /
                ``{"prompt_token_ids": ...}``.
            params: Sampling parameters (default ``SamplingParams()``).
            cache_salt: Per-tenant salt: requests with different salts never share KV blocks.
                ``None``: no salt; an empty one is refused.
            arrival_time: ``time.perf_counter()`` of arrival (default: now), for time to first token.

        Raises:
            InvalidArgumentError: Bad prompt, parameters, salt, a request id already in use, or a
                request longer than :attr:`max_model_len` allows (a prompt that reaches it; with a
                pool-set limit, a prompt plus ``max_tokens`` past it). Nothing is queued.
        """
        request_id, text, ids, params, salt = self._validate(request_id, prompt, params, cache_salt)
        self._enqueue(request_id, text, ids, params, salt, arrival_time)
        return request_id

    def _validate(self, request_id: Optional[str], prompt: Prompt, params: Optional[SamplingParams],
                  cache_salt: Union[str, bytes, None]
                  ) -> Tuple[str, Optional[str], List[int], SamplingParams, Optional[bytes]]:
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise _bad("params", type(params).__name__, "must be a SamplingParams")
        if params.n > self.scheduler.max_num_seqs:
            raise _bad("n", params.n, f"more samples than max_num_seqs "
                                      f"({self.scheduler.max_num_seqs}) can run together")
        if request_id is None:
            request_id = f"req-{next(self._request_ids)}"
            while request_id in self._requests:
                request_id = f"req-{next(self._request_ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise _bad("request_id", request_id, "must be a non-empty string")
        elif request_id in self._requests:
            raise _bad("request_id", request_id, "already in use by an unfinished request")
        if cache_salt is not None:
            if isinstance(cache_salt, str):
                cache_salt = cache_salt.encode()
            elif not isinstance(cache_salt, (bytes, bytearray)):
                raise _bad("cache_salt", cache_salt, "must be str or bytes")
            cache_salt = bytes(cache_salt)
            if not cache_salt:
                raise _bad("cache_salt", cache_salt, "must not be empty (an empty salt would "
                                                     "share the unsalted cache); pass None for no salt")
        self._check_options(params)
        text, ids = self.tokenize(prompt)
        if (self.max_model_len < self.model_context_len
                and len(ids) + params.max_tokens > self.max_model_len):
            # The pool, not the model, would end this request early: refuse it rather than cut
            # it short under finish_reason "length". (A request that runs into the model's own
            # context ends there with "length", as a model's context always ends generation.)
            raise _bad("max_tokens", params.max_tokens,
                       f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} = "
                       f"{len(ids) + params.max_tokens} exceeds max_model_len = "
                       f"{self.max_model_len} (what the KV pool holds for one sequence; the "
                       f"model's context is {self.model_context_len}): give the pool more "
                       f"blocks or ask for fewer tokens")
        return request_id, text, ids, params, cache_salt

    def _check_options(self, params: SamplingParams) -> None:
        """The sampling options that depend on the model (the rest :class:`SamplingParams`
        checked itself)."""
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and self.vocab_size and k > self.vocab_size:
                raise _bad(name, k, f"more than the vocabulary ({self.vocab_size} tokens)")
        if params.stop_strings and self.tokenizer is None:
            raise _bad("stop", list(params.stop_strings),
                       "stop strings are matched on text: the model has no tokenizer")
        if params.prompt_logprobs is not None and self._tp is not None:
            raise _bad("prompt_logprobs", params.prompt_logprobs,
                       "not supported with tensor_parallel_size > 1")

    def _enqueue(self, request_id: str, text: Optional[str], ids: List[int],
                 params: SamplingParams, salt: Optional[bytes],
                 arrival_time: Optional[float]) -> None:
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        if params.prompt_logprobs is not None:
            # Every prompt position's logits are needed, so no prefix-cache hit may skip one: a
            # private cache namespace (nor does any other request then hit these blocks).
            salt = (salt or b"") + b"\x00prompt-logprobs\x00" + os.urandom(16)
        req = _Request(request_id, text, ids, params, salt, seed,
                       time.perf_counter() if arrival_time is None else arrival_time)
        self._init_outputs(req)
        seq = self._new_sequence(req, 0, list(ids))
        # Admission keeps room under max_num_seqs for the samples forked from this sequence.
        seq.n = params.n
        self._requests[request_id] = req
        self.scheduler.add(seq)
        self._counters["num_requests"] += 1
        self._counters["num_prompt_tokens"] += len(ids)

    def _init_outputs(self, req: _Request) -> None:
        from .detokenizer import IncrementalDetokenizer
        from .output_state import SampleState

        params = req.params
        tok = self.tokenizer
        req.states = [SampleState(None if tok is None else IncrementalDetokenizer(
            tok, req.prompt_token_ids, params.skip_special_tokens), params)
            for _ in range(params.n)]
        if params.min_tokens:
            eos = frozenset() if params.ignore_eos else self.eos_token_ids
            req.banned = frozenset(params._stop_set) | eos
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]

    def _decode_token(self, token_id: int) -> Optional[str]:
        """One token's text on its own (for :class:`Logprob`), cached per id."""
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)
            self._token_text[token_id] = text
        return text

    def _new_sequence(self, req: _Request, index: int, token_ids: List[int]) -> Any:
        # `token_ids` is always a fresh copy of checked ids: the sequence takes it as is.
        seq = SchedulerSequence(next(self._seq_ids), token_ids, request_id=req.request_id,
                                cache_salt=req.cache_salt, arrival=req.metrics.arrival_time,
                                _own=True)
        seq.data = (req, index)
        req.seqs[index] = seq
        return seq

    def abort_request(self, request_id: str) -> None:
        """Drops a request: its sequences stop and their blocks are freed (cached ones stay cached).

        Raises:
            InvalidArgumentError: No unfinished request has this id.
        """
        req = self._requests.get(request_id)
        if req is None:
            raise _bad("request_id", request_id, "no unfinished request has this id")
        live = [seq for i, seq in enumerate(req.seqs) if seq is not None and req.finish[i] is None]
        self.scheduler.finish_many(live)
        del self._requests[request_id]

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still queued or running."""
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        """Requests still queued or running."""
        return len(self._requests)

    # ---------------------------------------------------------------------------------- step

    def step(self) -> List[RequestOutput]:
        """Runs one scheduler step: schedule, run the model, sample, advance, finish.

        Returns:
            A :class:`RequestOutput` for every request that produced a token or finished this step
            (finished ones for the last time: they are forgotten afterwards), as the request's
            ``output_kind`` asks: cumulative snapshots, deltas since its previous output, or only
            its final output.

        Raises:
            OutOfBlocksError: Nothing can run although requests are waiting (a prompt that cannot
                fit the pool even when it is empty; such a request is dropped first).
        """
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if self.tiers is not None:
            self.tiers.after_schedule()  # before the step's swap-outs overwrite demoted slots
        if batch.preempted:
            self._counters["num_preemptions"] += len(batch.preempted)
            for seq in batch.preempted:
                seq.data[0].metrics.num_preemptions += 1
                swapped = seq.status is SequenceStatus.SWAPPED
                self._counters["num_preemptions_swap" if swapped else "num_preemptions_recompute"] += 1
        if not batch.seqs:
            if self.kv_events is not None:
                self.kv_events.flush()
            if self.tiers is not None and self.tiers.num_fetching:
                # Only requests whose blocks are still coming from a lower tier are left.
                self.tiers.wait()
            elif self._requests:
                self._unschedulable()
            return []

        mask = batch.sample_mask()
        rows = [i for i, m in enumerate(mask) if m]
        # Positions: the runner reads the step's own from what the manager wrote.
        prompt_lp = self._prompt_logprob_rows(batch)
        if prompt_lp:
            extra = [t for _, lo, hi, at in prompt_lp for t in range(at, at + hi - lo)]
            logits = self.runner.execute(batch.input_ids(), None, batch.step, rows,
                                         extra_logit_indices=extra)
            self._record_prompt_logprobs(prompt_lp, logits[len(rows):])
            logits = logits[:len(rows)]
        else:
            logits = self.runner.execute(batch.input_ids(), None, batch.step, rows)
        for seq, n_new in zip(batch.seqs, batch.num_new_tokens):
            # A sequence that is not sampling (prefill chunks) or whose step covers more than the one
            # decode token is computing prompt (or recomputed) tokens.
            if n_new > 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
                self._counters["num_prefill_tokens"] += n_new

        # One draw per sampled row; a prompt whose n > 1 samples are not yet forked also draws its
        # other samples' first tokens from the same logits row (appended after the rows).
        sampler_rows: List[SamplerRow] = []
        forks: List[Tuple[_Request, int, Any]] = []
        fork_rows: List[int] = []
        for r, i in enumerate(rows):
            seq = batch.seqs[i]
            req, index = seq.data
            sampler_rows.append(SamplerRow(req.params, req.seq_seeds[index],
                                           len(seq.token_ids) - seq.num_prompt_tokens,
                                           seq.token_ids, seq.num_prompt_tokens, req.banned))
            if not req.forked:
                req.forked = True
                for child in range(1, req.params.n):
                    forks.append((req, child, seq))
                    fork_rows.append(r)
        for (req, child, parent) in forks:
            sampler_rows.append(SamplerRow(req.params, req.seq_seeds[child], 0, parent.token_ids,
                                           parent.num_prompt_tokens, req.banned))
        if forks:
            logits = logits[list(range(len(rows))) + fork_rows]
        result = sample_batch(logits, sampler_rows)
        tokens = result.token_ids
        row_logprobs = result.logprobs

        sampled: List[Optional[int]] = [None] * len(batch.seqs)
        for r, i in enumerate(rows):
            sampled[i] = tokens[r]
        self.scheduler.postprocess(batch, sampled)

        now = time.perf_counter()
        touched: Dict[str, _Request] = {}
        done: List[Any] = []
        # Forks first: a parent that finishes on its first token must still be running to be forked.
        for j, ((req, child, parent), tok) in enumerate(zip(forks, tokens[len(rows):])):
            child_seq = self._new_sequence(req, child, list(req.prompt_token_ids))
            self.scheduler.fork(parent, child_seq)
            child_seq.append_token(tok)
            self._after_token(req, child, child_seq, tok, now, touched, done,
                              row_logprobs[len(rows) + j])
        for r, i in enumerate(rows):
            seq = batch.seqs[i]
            req, index = seq.data
            self._after_token(req, index, seq, sampled[i], now, touched, done, row_logprobs[r])
        if done:
            self.scheduler.finish_many(done)

        outputs = []
        for req in touched.values():
            finished = req.finished
            if finished or req.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._output(req))
            if finished:
                req.metrics.finished_time = now
                self._finished_request(req)
        self._record_step(batch, time.perf_counter() - started)
        if self.kv_events is not None:
            self.kv_events.flush()  # one batch per step: what this step cached and evicted
        return outputs

    def _prompt_logprob_rows(self, batch: Any) -> List[Tuple[_Request, int, int, int]]:
        """``(request, first position, end position, packed index of the first)`` of every
        prompt stretch this step computes whose logits give prompt logprobs not yet collected.
        The logits at position ``j`` are the distribution of prompt token ``j + 1``."""
        out: List[Tuple[_Request, int, int, int]] = []
        at = 0
        for seq, n_new in zip(batch.seqs, batch.num_new_tokens):
            req = seq.data[0]
            if req.prompt_logprobs is not None and seq is req.seqs[0]:
                start = seq.num_computed_tokens
                lo = max(start, req.prompt_lp_next)
                hi = min(start + n_new, len(req.prompt_token_ids) - 1)
                if lo < hi:
                    out.append((req, lo, hi, at + lo - start))
            at += n_new
        return out

    def _record_prompt_logprobs(self, stretches: List[Tuple[_Request, int, int, int]],
                                logits: Any) -> None:
        import torch

        from .output_state import logprob_entry
        from .sampler import compute_logprobs

        row = 0
        for req, lo, hi, _ in stretches:
            targets = req.prompt_token_ids[lo + 1:hi + 1]
            chosen = torch.tensor(targets, dtype=torch.int64, device=logits.device)
            k = int(req.params.prompt_logprobs or 0)
            entries = compute_logprobs(logits[row:row + hi - lo], chosen, k)
            assert req.prompt_logprobs is not None
            req.prompt_logprobs.extend(logprob_entry(e, t, self._decode_token)
                                       for e, t in zip(entries, targets))
            req.prompt_lp_next = hi
            row += hi - lo

    def _after_token(self, req: _Request, index: int, seq: Any, token: int, now: float,
                     touched: Dict[str, _Request], done: List[Any],
                     logprobs: Any = None) -> None:
        touched[req.request_id] = req
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
            req.metrics.num_cached_tokens = int(getattr(req.seqs[0], "num_cached_tokens", 0) or 0)
            self._counters["request_hit_tokens"] += req.metrics.num_cached_tokens
            self._counters["request_prompt_tokens"] += len(req.prompt_token_ids)
        self._counters["num_generated_tokens"] += 1
        params = req.params
        state = req.states[index]
        if logprobs is not None:
            state.add_logprobs(logprobs, token, self._decode_token)
        eos = not params.ignore_eos and token in self.eos_token_ids
        stop_token = eos or token in params._stop_set
        matched = state.add_token(token, stop_token)
        reason: Optional[Tuple[str, Union[int, str, None]]] = None
        if stop_token:
            # An end-of-sequence token is no stop_reason (as in vLLM); a stop_token_ids entry is.
            reason = ("stop", None if eos else token)
        elif matched is not None:
            reason = ("stop", matched)
        elif len(seq.token_ids) - seq.num_prompt_tokens >= params.max_tokens:
            reason = ("length", None)
        elif len(seq.token_ids) >= self.max_model_len:
            reason = ("length", None)
        if reason is not None:
            if req.finish[index] is None:
                req.num_finished += 1
            req.finish[index] = reason
            done.append(seq)

    def _finished_request(self, req: _Request) -> None:
        self._requests.pop(req.request_id, None)
        self._counters["num_finished_requests"] += 1
        ttft = req.metrics.time_to_first_token
        if ttft is not None:
            self._ttfts.append(ttft)

    def _unschedulable(self) -> None:
        # Nothing runs and nothing will free blocks: the head of the queue can never be admitted.
        stuck = next(iter(self._requests.values()))
        needed = math.ceil(len(stuck.seqs[0].token_ids) / self.block_size)
        self.abort_request(stuck.request_id)
        raise OutOfBlocksError(
            f"request {stuck.request_id!r} needs {needed} KV blocks and cannot be scheduled in a pool "
            f"of {self.manager.num_blocks} blocks ({self.manager.watermark_blocks} held back); "
            f"it was dropped",
            needed=needed, available=self.manager.num_blocks - self.manager.watermark_blocks,
        )

    def _output(self, req: _Request) -> RequestOutput:
        delta = req.params.output_kind is RequestOutputKind.DELTA
        completions = []
        for i, seq in enumerate(req.seqs):
            state = req.states[i]
            if seq is None:
                completions.append(CompletionOutput(i, "", [], None, None))
                continue
            fin = req.finish[i]
            reason, stop = (fin if fin is not None else (None, None))
            text, start, lps = state.take(fin is not None, delta)
            ids = list(seq.token_ids[seq.num_prompt_tokens + start:])
            completions.append(CompletionOutput(i, text, ids, reason, stop, lps,
                                                state.cumulative_logprob))
        prompt_lps = req.prompt_logprobs
        if prompt_lps is not None:
            if delta and req.prompt_lp_sent:
                prompt_lps = None
            else:
                req.prompt_lp_sent = True
                prompt_lps = list(prompt_lps)
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), completions,
                             finished=req.finished, metrics=req.metrics,
                             prompt_logprobs=prompt_lps)

    # --------------------------------------------------------------------------------- stats

    def reset_stats(self) -> None:
        """Zeroes the engine's own counters (the manager's cumulative counters are snapshotted, so
        :meth:`stats` reports what happened since)."""
        self._counters = dict.fromkeys(
            ("num_requests", "num_finished_requests", "num_prompt_tokens", "num_generated_tokens",
             "num_prefill_tokens", "num_steps", "num_preemptions", "peak_running_seqs",
             "num_preemptions_swap", "num_preemptions_recompute",
             "request_hit_tokens", "request_prompt_tokens"), 0)
        self._busy = 0.0
        self._util_sum = 0.0
        self._util_peak = 0.0
        self._ttfts: List[float] = []
        s = self.manager.stats()
        self._base = (s.prefix_query_tokens, s.prefix_hit_tokens, s.cow_copies, s.evictions)
        swap = self.runner.swap
        self._swap_base = (swap.num_swapped_out, swap.num_swapped_in) if swap else (0, 0)
        tiers = getattr(self, "tiers", None)
        self._tier_base = tiers.totals(self.runner.spec.bytes_per_block) if tiers else {}

    def _record_step(self, batch: Any, elapsed: float) -> None:
        c = self._counters
        c["num_steps"] += 1
        c["peak_running_seqs"] = max(c["peak_running_seqs"], len(batch.seqs))
        self._busy += elapsed
        s = self.manager.stats()
        util = s.used_blocks / s.num_blocks
        self._util_sum += util
        self._util_peak = max(self._util_peak, util)

    def stats(self) -> EngineStats:
        """What the engine has done since it was created (or :meth:`reset_stats`)."""
        c = self._counters
        s = self.manager.stats()
        swap = self.runner.swap
        query = s.prefix_query_tokens - self._base[0]
        hits = s.prefix_hit_tokens - self._base[1]
        busy = self._busy
        gen = c["num_generated_tokens"]
        return EngineStats(
            num_requests=c["num_requests"],
            num_finished_requests=c["num_finished_requests"],
            num_prompt_tokens=c["num_prompt_tokens"],
            num_generated_tokens=gen,
            num_prefill_tokens=c["num_prefill_tokens"],
            num_steps=c["num_steps"],
            busy_time_s=busy,
            generation_tokens_per_s=gen / busy if busy > 0 else 0.0,
            total_tokens_per_s=(gen + c["num_prefill_tokens"]) / busy if busy > 0 else 0.0,
            mean_ttft_s=sum(self._ttfts) / len(self._ttfts) if self._ttfts else None,
            max_ttft_s=max(self._ttfts) if self._ttfts else None,
            peak_kv_utilization=self._util_peak,
            mean_kv_utilization=self._util_sum / c["num_steps"] if c["num_steps"] else 0.0,
            peak_running_seqs=c["peak_running_seqs"],
            prefix_hit_ratio=hits / query if query else 0.0,
            prefix_hit_tokens=hits,
            request_prefix_hit_ratio=(c["request_hit_tokens"] / c["request_prompt_tokens"]
                                      if c["request_prompt_tokens"] else 0.0),
            num_preemptions=c["num_preemptions"],
            num_preemptions_swap=c["num_preemptions_swap"],
            num_preemptions_recompute=c["num_preemptions_recompute"],
            swapped_out_blocks=(swap.num_swapped_out - self._swap_base[0]) if swap else 0,
            swapped_in_blocks=(swap.num_swapped_in - self._swap_base[1]) if swap else 0,
            cow_copies=s.cow_copies - self._base[2],
            evictions=s.evictions - self._base[3],
            num_blocks=s.num_blocks,
            block_size=s.block_size,
            **self._tier_stats(s, hits),
        )

    def _tier_stats(self, s: Any, hits: int) -> Dict[str, Any]:
        """The per-tier fields of :class:`EngineStats` (the GPU's hits alone without a host tier):
        the tier cache's totals less those at :meth:`reset_stats`."""
        if self.tiers is None:
            return {"prefix_hits_by_tier": {"gpu": hits}}
        now = self.tiers.totals(self.runner.spec.bytes_per_block)
        base = self._tier_base

        def since(key: str) -> Dict[str, int]:
            return {k: v - base[key].get(k, 0) for k, v in now[key].items()}

        return {"prefix_hits_by_tier": since("hits"), "tier_bytes_read": since("bytes_read"),
                "tier_bytes_written": since("bytes_written"), "tier_usage_bytes": now["usage"]}


def _set_cost_model(manager: Any, rates: Tuple[float, float, float], kv_bytes_per_token: int,
                    max_step_tokens: int) -> None:
    """Gives the manager's cost model its rates: ``(host link bytes/s, prefill tokens/s, step
    floor s)``, and the scheduler's token budget (a recompute is prefilled in chunks of it)."""
    manager.cost_model = CostModel(host_link_bytes_per_s=rates[0], prefill_tokens_per_s=rates[1],
                                   kv_bytes_per_token=float(kv_bytes_per_token),
                                   step_floor_s=rates[2], max_step_tokens=max_step_tokens)


def _stage_bar(enabled: bool, total: int, desc: str) -> Any:
    return tqdm(total=total, desc=desc, disable=not enabled or None, leave=False,
                bar_format="{desc}: {n}/{total} stages [{elapsed}]")


class LLM:
    """Offline batch generation through the paged KV cache, shaped like ``vllm.LLM``.

    ``LLM(model, ...)`` takes :class:`LLMEngine`'s arguments (``model=None`` loads the embedded
    SmolLM2-135M-Instruct; further keywords such as ``watermark_blocks``, ``cuda_graphs`` or
    ``enable_chunked_prefill`` are :class:`~pagedkv.engine.config.EngineConfig` fields too);
    :meth:`from_config` takes a config directly. :meth:`generate` runs prompts to completion with
    continuous batching. ``progress`` shows a bar while loading.

    Example::

        llm = pagedkv.LLM("path/to/model", num_blocks=512)
        outs = llm.generate(["Hello", [1, 2, 3]], pagedkv.SamplingParams(temperature=0, max_tokens=8))
        print(outs[0].outputs[0].text)
    """

    def __init__(
        self,
        model: Union[str, LoadedModel, None] = None,
        *,
        device: Optional[str] = None,
        dtype: Any = None,
        kv_cache_memory: Union[int, str, None] = None,
        num_blocks: Optional[int] = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        progress: bool = True,
        **engine_args: Any,
    ) -> None:
        config = EngineConfig(
            kv_cache_memory=kv_cache_memory, num_blocks=num_blocks, block_size=block_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, progress=progress, **engine_args,
        )
        self._setup(model, device, dtype, config)

    @classmethod
    def from_config(cls, config: EngineConfig, model: Union[str, LoadedModel, None] = None, *,
                    device: Optional[str] = None, dtype: Any = None) -> "LLM":
        """An LLM with the settings of ``config``; ``model``, ``device`` and ``dtype`` as for the
        constructor."""
        if not isinstance(config, EngineConfig):
            raise _bad("config", type(config).__name__, "must be an EngineConfig")
        llm = cls.__new__(cls)
        llm._setup(model, device, dtype, config)
        return llm

    def _setup(self, model: Union[str, LoadedModel, None], device: Optional[str], dtype: Any,
               config: EngineConfig) -> None:
        #: On a tensor-parallel rank other than 0 (one script on every rank): the runner that
        #: runs rank 0's steps; ``llm_engine`` is then None.
        self._worker: Any = None
        self._worker_stopped = False
        if config.tensor_parallel_size > 1 and dist_rank() > 0:
            self.llm_engine = None  # type: ignore[assignment]
            self._worker = build_worker(model, device=device, dtype=dtype, config=config,
                                        build=build_rank_runner)
            return
        self.llm_engine = LLMEngine.from_config(config, model, device=device, dtype=dtype)

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (``None`` if it has none)."""
        return self.llm_engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt and completion) served: the model's context, or what the
        KV pool holds for one sequence when that is less (:attr:`LLMEngine.max_model_len`)."""
        if self._worker is not None:
            return int(self._worker.max_model_len)  # a rank other than 0 only runs steps
        return self.llm_engine.max_model_len

    def shutdown(self) -> None:
        """Ends tensor parallelism (see :meth:`LLMEngine.shutdown`); with one script on every
        rank, every rank calls it. Idempotent."""
        if self._worker is not None:
            if not self._worker_stopped:
                self._worker.serve()  # rank 0's remaining steps, then its STOP
                self._worker_stopped = True
                self._worker.tp.gather_objects(self._worker.step_records)
            return
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def stats(self) -> EngineStats:
        """The engine's counters (:class:`EngineStats`)."""
        return self.llm_engine.stats()

    # The overloads exist for type checkers: with the union alone, mypy infers a mixed list literal
    # (`["text", [1, 2]]`) as `list[Sequence[object]]` and rejects the README's own call.
    @overload
    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: bool = True,
        cache_salt: Union[str, bytes, None, Sequence[Union[str, bytes, None]]] = None,
    ) -> List[RequestOutput]: ...

    @overload
    def generate(
        self,
        prompts: Prompt,
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: bool = True,
        cache_salt: Union[str, bytes, None, Sequence[Union[str, bytes, None]]] = None,
    ) -> List[RequestOutput]: ...

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: bool = True,
        cache_salt: Union[str, bytes, None, Sequence[Union[str, bytes, None]]] = None,
    ) -> List[RequestOutput]:
        """Generates completions for every prompt; returns one :class:`RequestOutput` each, in input
        order.

        Args:
            prompts: One prompt or a list of them; a prompt is a string, a list of token ids, or a
                dict with ``"prompt"`` / ``"prompt_token_ids"``. (A flat list of ints is one prompt.)
            sampling_params: One for all prompts, or one per prompt (default ``SamplingParams()``).
            use_tqdm: Show a progress bar (requests done, tokens/s).
            cache_salt: One salt for all prompts, or one per prompt.

        Raises:
            InvalidArgumentError: A prompt, parameter or salt is bad (nothing was queued), or the
                lists' lengths differ from the prompts'.
            OutOfBlocksError: A prompt cannot fit the KV pool (the batch is dropped).
        """
        if self._worker is not None:
            # A rank other than 0: run rank 0's steps until its generate ends.
            if not self._worker_stopped and serve_until_end(self._worker) == CMD_STOP:
                self._worker_stopped = True
                self._worker.tp.gather_objects(self._worker.step_records)
            return []
        engine = self.llm_engine
        if prompts is None:
            raise _bad("prompts", None, "None is not a prompt; conversations go to LLM.chat()")
        if isinstance(prompts, Mapping):
            _check_prompt_mapping(prompts)
        if getattr(prompts, "ndim", None) == 1:
            prompts = [prompts]  # one prompt as a 1-D array or tensor of token ids
        elif isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompts)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        n = len(prompts)
        params_list = [_final_only(p) for p in
                       self._per_prompt("sampling_params", sampling_params, n, SamplingParams)]
        salts = self._per_prompt("cache_salt", cache_salt, n, (str, bytes))
        # Validate everything before queuing anything: a bad prompt leaves the engine unchanged.
        validated = [engine._validate(None, p, sp, s) for p, sp, s in zip(prompts, params_list, salts)]
        ids = []
        start = time.perf_counter()
        for request_id, text, tokens, params, salt in validated:
            engine._enqueue(request_id, text, tokens, params, salt, start)
            ids.append(request_id)

        results: Dict[str, RequestOutput] = {}
        pending = set(ids)
        bar = tqdm(total=n, desc="generating", unit="req", disable=not use_tqdm or None,
                   dynamic_ncols=True)
        gen_before = engine._counters["num_generated_tokens"]
        try:
            while pending:
                for out in engine.step():
                    if out.request_id in pending and out.finished:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
                if use_tqdm:
                    done = engine._counters["num_generated_tokens"] - gen_before
                    rate = done / max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
                if pending and not engine.has_unfinished_requests():
                    raise RuntimeError(  # pragma: no cover - aborted from elsewhere mid-generate
                        f"requests {sorted(pending)} were aborted before they finished")
        except BaseException:
            for request_id in pending:
                if request_id in engine._requests:
                    engine.abort_request(request_id)
            raise
        finally:
            bar.close()
            if engine._tp is not None:
                engine._tp.end_generate()
        return [results[r] for r in ids]

    def chat(
        self,
        messages: Union[Sequence[Mapping[str, Any]], Sequence[Sequence[Mapping[str, Any]]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: bool = True,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
        cache_salt: Union[str, bytes, None, Sequence[Union[str, bytes, None]]] = None,
    ) -> List[RequestOutput]:
        """Generates replies to conversations through the tokenizer's chat template.

        Each conversation is rendered with the chat template (``chat_template`` if given, else
        the tokenizer's), tokenized without adding special tokens again (the template places
        them), and generated like a :meth:`generate` prompt; ``RequestOutput.prompt`` is the
        rendered text.

        Args:
            messages: One conversation (a list of ``{"role": ..., "content": ...}`` dicts) or a
                list of them.
            sampling_params: One for all conversations, or one per conversation.
            use_tqdm: Show a progress bar.
            chat_template: A Jinja template overriding the tokenizer's.
            add_generation_prompt: End the rendered prompt with the assistant turn's opening.
            continue_final_message: Leave the last message open so the reply continues it
                (exclusive with ``add_generation_prompt``).
            chat_template_kwargs: Extra variables for the template.
            cache_salt: One salt for all conversations, or one per conversation.

        Returns:
            One :class:`RequestOutput` per conversation, in order.

        Raises:
            InvalidArgumentError: A conversation or message is malformed, the model has no
                tokenizer or no chat template, the template fails, or a :meth:`generate` check
                fails (nothing was queued).
        """
        from .chat import render_conversations

        tok = self.get_tokenizer()
        prompts = render_conversations(tok, messages, chat_template=chat_template,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message,
                                       chat_template_kwargs=chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, cache_salt=cache_salt)

    @staticmethod
    def _per_prompt(what: str, value: Any, n: int, kind: Any) -> List[Any]:
        if value is None or isinstance(value, kind):
            return [value] * n
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise _bad(what, f"<{len(value)} items>", f"needs one entry per prompt ({n})")
            return list(value)
        raise _bad(what, type(value).__name__, "must be one value or one per prompt")


def _final_only(params: Any) -> Any:
    """``generate`` waits for final outputs: intermediate snapshots would only cost time."""
    if params is None:
        return SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)
    if isinstance(params, SamplingParams) and params.output_kind is not RequestOutputKind.FINAL_ONLY:
        return replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    return params

