"""The engine's settings: one object, validated once.

Owns :class:`EngineConfig`, every knob of :class:`~pagedkv.engine.llm.LLMEngine` (and so of
:class:`~pagedkv.engine.llm.LLM`), :class:`~pagedkv.engine.model_runner.ModelRunner` and the
tensor-parallel worker spec, each with its default. What model runs (a path or a loaded model),
on which device and in which dtype stay the constructors' own arguments: a config says how the
engine serves a model, not which one, and stays picklable for the ranks a tensor-parallel engine
spawns.

Invariants: a constructed config is valid and immutable (``__post_init__`` checks every field, in
one place, and raises :class:`~pagedkv.errors.ConfigArgumentError` naming the field, its value and
the rule; a dataclass ``replace`` validates again); byte sizes given as strings (``"4GiB"``) are
stored as ints; no field depends on the model, so what only the loaded model decides (the
context length, the pool's block count) is derived by the runner, not stored here. Importing it
imports neither torch nor the extension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from .._checks import DEFAULT_BLOCK_SIZE, check_block_size
from ..config import parse_bytes
from ..errors import ConfigArgumentError, InvalidConfigError

__all__ = ["EngineConfig", "PREEMPTION_MODES", "ATTENTION_BACKENDS"]

#: What :attr:`EngineConfig.preemption_mode` takes.
PREEMPTION_MODES = ("auto", "swap", "recompute")
#: What :attr:`EngineConfig.attention_backend` takes.
ATTENTION_BACKENDS = ("auto", "torch", "triton")


def _bad(name: str, value: Any, reason: str) -> ConfigArgumentError:
    return ConfigArgumentError(f"invalid config: {name} = {value!r}: {reason}", field=name,
                               value=value, reason=reason)


#: Most rows :func:`pagedkv.kernels.linear_small_m` serves (its ``MAX_M``; not imported here,
#: so that reading a config does not import Triton).
GEMV_MAX_ROWS = 16


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EngineConfig:
    """How an engine serves its model: KV pool, scheduler, preemption, tensor parallelism.

    The fields are :class:`~pagedkv.engine.llm.LLMEngine`'s keyword arguments of the same names
    (see there), plus the model runner's own:

    * ``attention_backend``: ``"auto"`` (the Triton kernels on CUDA, plain PyTorch on the CPU),
      ``"torch"`` or ``"triton"`` (on the CPU only under ``TRITON_INTERPRET=1``);
    * ``decode_planner``: plan each decode step's split-K work from the batch's real lengths
      (kernels only);
    * ``fused_model``: run Llama/Mistral/Qwen2 models through the fused forward
      (:mod:`pagedkv.engine.fused`: one Q|K|V and one gate|up GEMM, fused RMSNorm + residual,
      RoPE and SiLU-times-up kernels); ``False`` runs transformers' own module forwards;
    * ``cuda_graph_pieces``: with the fused forward, capture each decode step as this many CUDA
      graphs of consecutive layers, so the GPU starts on the first while the host launches the
      rest (:meth:`~pagedkv.engine.model_runner.ModelRunner.capture_graphs`); 1: one graph;
    * ``small_batch_gemv``: with the fused forward on the kernels, steps of at most this many
      rows run their linear layers through the weight-streaming GEMV
      (:func:`pagedkv.kernels.linear_small_m`, at most 16 rows) instead of cuBLAS; 0: never;
    * ``layerwise_loads``: a step's loads from the host pool (prefix hits of the host tier,
      swapped-in sequences) go layer by layer, and each layer of the step's forward waits only
      for its own slices (:meth:`pagedkv.tiers.host.SwapEngine.swap_in` with ``by_layer``): the forward
      overlaps the load. Eager steps only (a CUDA-graph decode step waits for the whole load).

    the tiers of the prefix cache below the GPU (``docs/tiers.md``; :class:`~pagedkv.engine.llm.
    LLMEngine` documents each): ``host_cache_memory``, ``host_cache_write_through``,
    ``disk_cache_dir``, ``disk_cache_memory``, ``remote_cache_url``, ``remote_cache_timeout_s``;
    and the KV-event and hash settings (``docs/kv-events.md``):

    * ``hash_seed``: the prefix hash's key (``None``: a fresh secret per engine); replicas behind
      one prefix-aware router share one, so the router computes the hashes they publish;
    * ``kv_events_endpoint``: publish the cache's block events there over ZeroMQ in vLLM's format
      (``tcp://*:5557`` binds, ``tcp://host:port`` connects); ``None``: no events;
    * ``kv_events_replay_endpoint``: where consumers ask for missed batches (bound);
    * ``kv_events_topic``: the first frame of every event message.

    Raises:
        ConfigArgumentError: A field is out of its domain, or two exclusive fields are both given
            (``num_blocks`` and ``kv_cache_memory``; ``swap_space`` and ``num_host_blocks``).
    """

    kv_cache_memory: Union[int, str, None] = None
    num_blocks: Optional[int] = None
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    watermark_blocks: Optional[int] = None
    cuda_graphs: bool = True
    progress: bool = False
    swap_space: Union[int, str, None] = None
    num_host_blocks: Optional[int] = None
    preemption_mode: str = "auto"
    host_link_bytes_per_s: Optional[float] = None
    prefill_tokens_per_s: Optional[float] = None
    step_floor_s: Optional[float] = None
    tensor_parallel_size: int = 1
    record_steps: bool = False
    tp_timeout_s: float = 600.0
    attention_backend: str = "auto"
    decode_planner: bool = True
    host_cache_memory: Union[int, str, None] = None
    host_cache_write_through: bool = False
    disk_cache_dir: Optional[str] = None
    disk_cache_memory: Union[int, str, None] = None
    remote_cache_url: Optional[str] = None
    remote_cache_timeout_s: float = 0.05
    hash_seed: Optional[int] = None
    kv_events_endpoint: Optional[str] = None
    kv_events_replay_endpoint: Optional[str] = None
    kv_events_topic: str = ""
    fused_model: bool = True
    cuda_graph_pieces: int = 1
    small_batch_gemv: int = 0
    layerwise_loads: bool = False

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "cuda_graph_pieces"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise _bad(name, value, "must be an int >= 1")
        if not _is_int(self.small_batch_gemv) or not 0 <= self.small_batch_gemv <= GEMV_MAX_ROWS:
            raise _bad("small_batch_gemv", self.small_batch_gemv,
                       f"must be an int in [0, {GEMV_MAX_ROWS}]")
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise _bad("num_blocks", self.num_blocks, "exclusive with kv_cache_memory")
        if self.num_blocks is not None and (not _is_int(self.num_blocks) or self.num_blocks < 1):
            raise _bad("num_blocks", self.num_blocks, "must be an int >= 1")
        if self.swap_space is not None and self.num_host_blocks is not None:
            raise _bad("num_host_blocks", self.num_host_blocks, "exclusive with swap_space")
        for name in ("watermark_blocks", "num_host_blocks"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise _bad(name, value, "must be an int >= 0")
        for name in ("kv_cache_memory", "swap_space", "host_cache_memory", "disk_cache_memory"):
            value = getattr(self, name)
            if value is not None:
                try:
                    nbytes = parse_bytes(value)
                except InvalidConfigError as exc:
                    raise _bad(name, value, str(exc)) from None
                # Frozen: normalising "4GiB" to its bytes needs object.__setattr__.
                object.__setattr__(self, name, nbytes)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise _bad("preemption_mode", self.preemption_mode,
                       f"must be one of {', '.join(map(repr, PREEMPTION_MODES))}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise _bad("attention_backend", self.attention_backend,
                       f"must be one of {', '.join(map(repr, ATTENTION_BACKENDS))}")
        for name in ("host_link_bytes_per_s", "prefill_tokens_per_s", "tp_timeout_s"):
            value = getattr(self, name)
            if value is None and name != "tp_timeout_s":
                continue
            if not (_is_number(value) and 0 < value < math.inf):
                raise _bad(name, value, "must be a positive number")
        if self.step_floor_s is not None and not (_is_number(self.step_floor_s)
                                                  and 0 <= self.step_floor_s < math.inf):
            raise _bad("step_floor_s", self.step_floor_s, "must be a number >= 0")
        self._check_tiers()
        if self.hash_seed is not None and not (_is_int(self.hash_seed)
                                               and 0 <= self.hash_seed < 1 << 64):
            raise _bad("hash_seed", self.hash_seed, "must be an int in [0, 2**64)")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and "://" in value):
                raise _bad(name, value, "must be a ZeroMQ endpoint such as 'tcp://*:5557'")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise _bad("kv_events_replay_endpoint", self.kv_events_replay_endpoint,
                       "needs kv_events_endpoint")
        if not isinstance(self.kv_events_topic, str):
            raise _bad("kv_events_topic", self.kv_events_topic, "must be a string")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "cuda_graphs", "progress",
                     "record_steps", "decode_planner", "host_cache_write_through", "fused_model",
                     "layerwise_loads"):
            value = getattr(self, name)
            if value is not True and value is not False:
                raise _bad(name, value, f"must be a bool, got {type(value).__name__}")

    def _check_tiers(self) -> None:
        """The prefix cache's lower tiers: each needs the one above it (a block reaches the disk
        or the remote tier only through the host tier) and prefix caching."""
        lower = [n for n in ("disk_cache_dir", "remote_cache_url") if getattr(self, n) is not None]
        if (self.host_cache_memory is not None or lower) and not self.enable_prefix_caching:
            name = "host_cache_memory" if self.host_cache_memory is not None else lower[0]
            raise _bad(name, getattr(self, name), "needs enable_prefix_caching=True")
        if lower and self.host_cache_memory is None:
            raise _bad(lower[0], getattr(self, lower[0]),
                       "needs host_cache_memory (lower tiers are filled from the host tier)")
        if self.host_cache_memory is not None and int(self.host_cache_memory) <= 0:
            raise _bad("host_cache_memory", self.host_cache_memory, "must be > 0 bytes")
        if self.disk_cache_dir is not None:
            if not isinstance(self.disk_cache_dir, str) or not self.disk_cache_dir:
                raise _bad("disk_cache_dir", self.disk_cache_dir, "must be a non-empty path string")
            if self.disk_cache_memory is None:
                raise _bad("disk_cache_memory", None, "needed with disk_cache_dir (the size cap)")
        elif self.disk_cache_memory is not None:
            raise _bad("disk_cache_memory", self.disk_cache_memory, "needs disk_cache_dir")
        if self.remote_cache_url is not None:
            url = self.remote_cache_url
            if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
                raise _bad("remote_cache_url", url,
                           "must be a redis://, rediss:// or unix:// URL")
        t = self.remote_cache_timeout_s
        if not (_is_number(t) and 0 < t <= 60):
            raise _bad("remote_cache_timeout_s", t, "must be a number in (0, 60]")

    def host_blocks(self, bytes_per_block: int) -> int:
        """Blocks of the host KV pool for blocks of ``bytes_per_block``: ``num_host_blocks``, or
        as many as ``swap_space`` bytes hold, plus as many as ``host_cache_memory`` holds (swap and
        the host tier share the pool: see :attr:`host_cache_blocks`); 0 (no host pool) without
        any of them."""
        if self.num_host_blocks is not None:
            base = self.num_host_blocks
        elif self.swap_space is None:
            base = 0
        else:
            base = int(self.swap_space) // bytes_per_block
        return base + self.host_cache_blocks(bytes_per_block)

    def host_cache_blocks(self, bytes_per_block: int) -> int:
        """Host blocks that ``host_cache_memory`` adds for the host tier of the prefix cache (at
        least one when it is set)."""
        if self.host_cache_memory is None:
            return 0
        return max(1, int(self.host_cache_memory) // bytes_per_block)

    @property
    def step_token_budget(self) -> int:
        """Most new tokens in one step's buffers: ``max_num_batched_tokens``, raised to
        ``max_num_seqs`` (a decode step carries one token per sequence)."""
        return max(self.max_num_batched_tokens, self.max_num_seqs)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
