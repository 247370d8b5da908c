"""The engine's settings: one object, validated once.

Owns :class:`EngineConfig`, every knob of :class:`~pagedkv.engine.llm_engine.LLMEngine` (and so
of :class:`~pagedkv.engine.llm.LLM`), :class:`~pagedkv.engine.model_runner.ModelRunner` and the
tensor-parallel worker spec, each with its default and its help text. What model runs (a path
or a loaded model), on which device and in which dtype stay the constructors' own arguments: a
config says how the engine serves a model, not which one, and stays picklable for the ranks a
tensor-parallel engine spawns.

Invariants: a constructed config is valid and immutable (``__post_init__`` checks every field, in
one place, and raises :class:`~pagedkv.errors.ConfigArgumentError` naming the field, its value and
the rule; a dataclass ``replace`` validates again); byte sizes given as strings (``"4GiB"``) are
stored as ints; no field depends on the model, so what only the loaded model decides (the
context length, the pool's block count) is derived by the runner, not stored here. Importing it
imports neither torch nor the extension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
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

    This is the one list of the engine's knobs: :class:`~pagedkv.engine.llm_engine.LLMEngine`
    and :class:`~pagedkv.engine.llm.LLM` take each field as a keyword of the same name (their
    signatures are generated from these fields), and each field's ``metadata["help"]`` is its
    one-paragraph description (plain text, for generated documentation and command-line help).
    The groups: the KV pool and the step (``kv_cache_memory`` .. ``progress``), preemption and
    its cost model (``swap_space`` .. ``step_floor_s``), tensor parallelism (``docs/tp.md``), the
    model runner's own (``attention_backend``, ``decode_planner``, ``fused_model``,
    ``cuda_graph_pieces``, ``small_batch_gemv``, ``layerwise_loads``), the tiers of the prefix
    cache below the GPU (``host_cache_*``, ``disk_cache_*``, ``remote_cache_*``;
    ``docs/tiers.md``), and the hash and KV-event settings (``docs/kv-events.md``).

    Raises:
        ConfigArgumentError: A field is out of its domain, or two exclusive fields are both given
            (``num_blocks`` and ``kv_cache_memory``; ``swap_space`` and ``num_host_blocks``).
    """

    kv_cache_memory: Union[int, str, None] = field(default=None, metadata={"help": (
        "Bytes of KV pool (int or '4GiB'; the runner sizes the pool from it); exclusive with "
        "num_blocks. Neither: the runner's default sizing.")})
    num_blocks: Optional[int] = field(default=None, metadata={"help": (
        "Blocks in the KV pool; exclusive with kv_cache_memory.")})
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={"help": (
        "Tokens per KV block (a power of two).")})
    max_num_seqs: int = field(default=256, metadata={"help": "Most sequences in one step."})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": (
        "Token budget of one step (decodes plus prefill chunks); longer prompts are prefilled in "
        "chunks.")})
    enable_prefix_caching: bool = field(default=True, metadata={"help": (
        "Share and cache full KV blocks by prefix hash.")})
    enable_chunked_prefill: bool = field(default=True, metadata={"help": (
        "Split prompts over steps to fit max_num_batched_tokens.")})
    watermark_blocks: Optional[int] = field(default=None, metadata={"help": (
        "Blocks kept back from admissions (None: the manager's default).")})
    cuda_graphs: bool = field(default=True, metadata={"help": (
        "Capture decode steps in CUDA graphs (CUDA only).")})
    progress: bool = field(default=False, metadata={"help": "Show a progress bar while loading."})
    swap_space: Union[int, str, None] = field(default=None, metadata={"help": (
        "Bytes of pinned host memory for swapped-out KV blocks (int or '4GiB'); exclusive with "
        "num_host_blocks. Neither: no host pool, every preemption recomputes.")})
    num_host_blocks: Optional[int] = field(default=None, metadata={"help": (
        "Blocks in the host KV pool; exclusive with swap_space.")})
    preemption_mode: str = field(default="auto", metadata={"help": (
        "'auto' (the cost model picks swap or recompute per victim), 'swap' (swap whenever the "
        "host pool has room) or 'recompute'.")})
    host_link_bytes_per_s: Optional[float] = field(default=None, metadata={"help": (
        "Host-link bandwidth for the cost model; None: measured at start-up (with a host pool and "
        "preemption_mode 'auto').")})
    prefill_tokens_per_s: Optional[float] = field(default=None, metadata={"help": (
        "Prefill throughput for the cost model; None: measured likewise.")})
    step_floor_s: Optional[float] = field(default=None, metadata={"help": (
        "Seconds a step costs however few tokens it carries (the cost model's step floor: "
        "recompute tokens that fit under it ride along for free); None: measured when the rates "
        "are, else 0.")})
    tensor_parallel_size: int = field(default=1, metadata={"help": (
        "Ranks the model's heads are split over (docs/tp.md). Above 1, without a "
        "torch.distributed process group this process becomes rank 0 and spawns the others; with "
        "one (torchrun), the group's size must match.")})
    record_steps: bool = field(default=False, metadata={"help": (
        "With tensor parallelism, every rank records what each step ran "
        "(LLMEngine.tp_step_records after shutdown).")})
    tp_timeout_s: float = field(default=600.0, metadata={"help": (
        "Timeout of the tensor-parallel process group's collectives, seconds.")})
    attention_backend: str = field(default="auto", metadata={"help": (
        "'auto' (the Triton kernels on CUDA, plain PyTorch on the CPU), 'torch' or 'triton' (on "
        "the CPU only under TRITON_INTERPRET=1).")})
    decode_planner: bool = field(default=True, metadata={"help": (
        "Plan each decode step's split-K work from the batch's real lengths (kernels only).")})
    host_cache_memory: Union[int, str, None] = field(default=None, metadata={"help": (
        "Bytes of pinned host memory for the host tier of the prefix cache (int or '16GiB'): "
        "blocks the GPU pool evicts are kept there and loaded again on a hit (docs/tiers.md); "
        "shares the host pool with swap_space. None: no host tier.")})
    host_cache_write_through: bool = field(default=False, metadata={"help": (
        "Copy each block to the host tier when it is first cached instead of when the GPU pool "
        "evicts it.")})
    disk_cache_dir: Optional[str] = field(default=None, metadata={"help": (
        "A directory (created owner-only) for the disk tier: blocks the host tier drops are "
        "written there and found again, also by a restarted engine of the same model and "
        "configuration. Needs host_cache_memory and disk_cache_memory.")})
    disk_cache_memory: Union[int, str, None] = field(default=None, metadata={"help": (
        "The disk tier's size cap in bytes (int or '200GiB').")})
    remote_cache_url: Optional[str] = field(default=None, metadata={"help": (
        "A Redis or Valkey server (redis://host:port/db) shared by several engines as the remote "
        "tier (extra pagedkv[remote]). Needs host_cache_memory.")})
    remote_cache_timeout_s: float = field(default=0.05, metadata={"help": (
        "Per-operation timeout of the remote tier, seconds: a slow or dead server is a miss, "
        "never a stalled step.")})
    hash_seed: Optional[int] = field(default=None, metadata={"help": (
        "The prefix-hash key (u64). None: a random per-process key, or with a disk tier the key "
        "kept (owner-only) in disk_cache_dir. Engines sharing a remote tier or a prefix-aware "
        "router must share it (docs/prefix-hash.md, docs/router.md). Treat it as a secret.")})
    kv_events_endpoint: Optional[str] = field(default=None, metadata={"help": (
        "Publish the KV cache's block events (stored, removed, cleared) on this ZeroMQ endpoint, "
        "one vLLM-format batch per step ('tcp://*:5557' binds, 'tcp://host:port' connects; "
        "docs/kv-events.md). None: off.")})
    kv_events_replay_endpoint: Optional[str] = field(default=None, metadata={"help": (
        "The ZeroMQ endpoint (bound) consumers replay missed event batches from; needs "
        "kv_events_endpoint.")})
    kv_events_topic: str = field(default="", metadata={"help": (
        "The topic frame of every KV-event message.")})
    fused_model: bool = field(default=True, metadata={"help": (
        "Run Llama/Mistral/Qwen2 models through the fused forward (one Q|K|V and one gate|up "
        "GEMM, fused RMSNorm + residual, RoPE and SiLU-times-up kernels); False runs "
        "transformers' own module forwards.")})
    cuda_graph_pieces: int = field(default=1, metadata={"help": (
        "With the fused forward, capture each decode step as this many CUDA graphs of consecutive "
        "layers, so the GPU starts on the first while the host launches the rest; 1: one graph.")})
    small_batch_gemv: int = field(default=0, metadata={"help": (
        "With the fused forward on the kernels, steps of at most this many rows (at most 16) run "
        "their linear layers through the weight-streaming GEMV instead of cuBLAS; 0: never.")})
    layerwise_loads: bool = field(default=False, metadata={"help": (
        "Loads from the host pool (host-tier prefix hits, swapped-in sequences) go layer by layer "
        "and each layer of the step's forward waits only for its own slices, so the forward "
        "overlaps the load. Eager steps only.")})

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
