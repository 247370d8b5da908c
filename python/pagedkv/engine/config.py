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
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Union

from .._checks import DEFAULT_BLOCK_SIZE, check_block_size
from ..config import parse_bytes
from ..errors import ConfigArgumentError, InvalidConfigError
from .spec_decode.config import SpeculativeConfig, parse_speculative_config

__all__ = ["EngineConfig", "PREEMPTION_MODES", "ATTENTION_BACKENDS"]

#: What :attr:`EngineConfig.preemption_mode` takes.
PREEMPTION_MODES = ("auto", "swap", "recompute")
#: What :attr:`EngineConfig.attention_backend` takes.
ATTENTION_BACKENDS = ("auto", "torch", "triton")


def _bad(name: str, value: Any, reason: str) -> ConfigArgumentError:
    value = _redacted(name, value)
    return ConfigArgumentError(f"invalid config: {name} = {value!r}: {reason}", field=name,
                               value=value, reason=reason)


def _redacted(name: str, value: Any) -> Any:
    """A secret field's value as an error may show it: the hash key not at all, a URL without its
    password."""
    if name == "hash_seed" and value is not None:
        return "<secret>"
    if name == "remote_cache_url" and isinstance(value, str):
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(value)
            if parts.password is None:
                return value
            netloc = parts.netloc.rpartition("@")
            user = netloc[0].partition(":")[0]
            return parts._replace(netloc=f"{user}:***@{netloc[2]}").geturl()
        except ValueError:
            return "<secret>"
    return value


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
      RoPE and SiLU-times-up kernels; on the kernels, a linear layer of one row through the
      weight-streaming GEMV :func:`pagedkv.kernels.linear_small_m`, larger ones through cuBLAS,
      with no setting); ``False`` runs transformers' own module forwards;
    * ``cuda_graph_pieces``: with the fused forward, capture each decode step as this many CUDA
      graphs of consecutive layers, so the GPU starts on the first while the host launches the
      rest (:meth:`~pagedkv.engine.model_runner.ModelRunner.capture_graphs`); 1: one graph;

    the tiers of the prefix cache below the GPU (``docs/tiers.md``; :class:`~pagedkv.engine.llm.
    LLMEngine` documents each): ``host_cache_memory``, ``host_cache_write_through``,
    ``disk_cache_dir``, ``disk_cache_memory``, ``remote_cache_url``, ``remote_cache_timeout_s``;
    and the KV-event and hash settings (``docs/kv-events.md``):

    * ``hash_seed``: the prefix hash's key (``None``: a fresh secret per engine); replicas behind
      one prefix-aware router share one, so the router computes the hashes they publish;
    * ``kv_events_endpoint``: publish the cache's block events there over ZeroMQ in vLLM's format
      (``tcp://*:5557`` binds, ``tcp://host:port`` connects); ``None``: no events;
    * ``kv_events_replay_endpoint``: where consumers ask for missed batches (bound);
    * ``kv_events_topic``: the first frame of every event message;

    and ``speculative_config`` (vLLM's dict, its JSON text, or a
    :class:`~pagedkv.engine.spec_decode.SpeculativeConfig`; stored as the latter, see
    ``docs/spec-decode.md``), and ``gpu_memory_utilization`` (CUDA: the pool's share of the memory free after loading;
    exclusive with ``num_blocks`` and ``kv_cache_memory``) and ``seed`` (seeds the per-request
    seeds of requests that give none; ``None``: random).

    Each field's ``metadata["help"]`` is its one-line description: ``pagedkv serve`` builds its
    engine flags from the fields (``--block-size`` for ``block_size``), so a new knob is one field
    here (``metadata["cli"] = False`` keeps it off the command line; ``"choices"`` lists the
    values; ``"secret_env"`` names the environment variable a secret is read from).

    Raises:
        ConfigArgumentError: A field is out of its domain, or two exclusive fields are both given
            (``num_blocks``, ``kv_cache_memory`` and ``gpu_memory_utilization``; ``swap_space``
            and ``num_host_blocks``).
    """

    kv_cache_memory: Union[int, str, None] = field(default=None, metadata={
        "help": "KV pool size in bytes, e.g. 4GiB (exclusive with num_blocks and "
                "gpu_memory_utilization)"})
    num_blocks: Optional[int] = field(default=None, metadata={
        "help": "KV pool size in blocks (default: sized from memory)"})
    gpu_memory_utilization: Optional[float] = field(default=None, metadata={
        "help": "CUDA only: the KV pool takes this fraction of the device memory free once the "
                "model is loaded, less a 4 GiB reserve, in (0, 1] (default: 0.85; the CPU pool "
                "is 256 MiB unless kv_cache_memory or num_blocks says otherwise)"})
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={"help": "tokens per block"})
    max_num_seqs: int = field(default=256, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "token budget of one step (decodes plus prefill chunks)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV blocks of prompts that share a prefix"})
    enable_chunked_prefill: bool = field(default=True, metadata={
        "help": "split long prompts into chunks across steps (off: one step per prompt)"})
    watermark_blocks: Optional[int] = field(default=None, metadata={
        "help": "blocks kept back from admissions (default: the manager's)"})
    cuda_graphs: bool = field(default=True, metadata={
        "help": "run decode steps through CUDA graphs (off: eagerly)"})
    progress: bool = field(default=False, metadata={
        "help": "progress bars while loading and generating", "cli": False})
    swap_space: Union[int, str, None] = field(default=None, metadata={
        "help": "host memory for swapped-out KV blocks, e.g. 4GiB (default: none; preemption "
                "recomputes)"})
    num_host_blocks: Optional[int] = field(default=None, metadata={
        "help": "host KV blocks for swapped-out sequences (exclusive with swap_space)"})
    preemption_mode: str = field(default="auto", metadata={
        "help": "reclaim preempted sequences by the cost model (auto), swap or recompute",
        "choices": PREEMPTION_MODES})
    host_link_bytes_per_s: Optional[float] = field(default=None, metadata={
        "help": "cost model: host-link bandwidth in bytes/s (default: measured at start-up)"})
    prefill_tokens_per_s: Optional[float] = field(default=None, metadata={
        "help": "cost model: prefill throughput in tokens/s (default: measured at start-up)"})
    step_floor_s: Optional[float] = field(default=None, metadata={
        "help": "cost model: what a step costs however few tokens it carries, in seconds "
                "(default: measured at start-up)"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "ranks the model's heads are split over"})
    record_steps: bool = field(default=False, metadata={
        "help": "keep every step's inputs (tests of tensor parallelism)", "cli": False})
    tp_timeout_s: float = field(default=600.0, metadata={
        "help": "seconds a tensor-parallel rank waits for the others"})
    attention_backend: str = field(default="auto", metadata={
        "help": "auto (Triton kernels on CUDA, plain PyTorch on the CPU), torch or triton",
        "choices": ATTENTION_BACKENDS})
    decode_planner: bool = field(default=True, metadata={
        "help": "plan each decode step's split-K work from the batch's lengths (kernels only)"})
    host_cache_memory: Union[int, str, None] = field(default=None, metadata={
        "help": "pinned host memory for the host tier of the prefix cache, e.g. 16GiB "
                "(default: none)"})
    host_cache_write_through: bool = field(default=False, metadata={
        "help": "copy blocks to the host tier when cached, not when evicted"})
    disk_cache_dir: Optional[str] = field(default=None, metadata={
        "help": "directory of the disk tier (needs host_cache_memory and disk_cache_memory)"})
    disk_cache_memory: Union[int, str, None] = field(default=None, metadata={
        "help": "size cap of the disk tier, e.g. 200GiB"})
    remote_cache_url: Optional[str] = field(default=None, repr=False, metadata={
        "help": "a Redis/Valkey server shared by replicas, e.g. redis://127.0.0.1:6379/0 (needs "
                "host_cache_memory and a shared hash_seed)",
        "secret_env": "PAGEDKV_REMOTE_CACHE_URL"})
    remote_cache_timeout_s: float = field(default=0.05, metadata={
        "help": "seconds one remote-tier request may take before it counts as a miss"})
    hash_seed: Optional[int] = field(default=None, repr=False, metadata={
        "help": "key of the prefix hash, an int in [0, 2**64); replicas behind one router share "
                "it; keep it secret (default: a fresh random key)",
        "secret_env": "PAGEDKV_HASH_SEED", "secret_file": True})
    kv_events_endpoint: Optional[str] = field(default=None, metadata={
        "help": "publish KV-cache block events over ZeroMQ in vLLM's format, e.g. tcp://*:5557 "
                "(binds) or tcp://host:5557 (connects) (default: off)"})
    kv_events_replay_endpoint: Optional[str] = field(default=None, metadata={
        "help": "bind a replay socket for missed event batches, e.g. tcp://*:5558"})
    kv_events_topic: str = field(default="", metadata={
        "help": "topic frame of every event message"})
    fused_model: bool = field(default=True, metadata={
        "help": "run Llama/Mistral/Qwen2 through the fused forward (off: transformers' modules)"})
    cuda_graph_pieces: int = field(default=1, metadata={
        "help": "with the fused forward, capture each decode step as this many CUDA graphs"})
    seed: Optional[int] = field(default=None, metadata={
        "help": "seed of the seeds drawn for requests that give none, so a rerun samples the "
                "same (default: random)"})
    kv_events_bind: Optional[str] = field(default=None, metadata={
        "help": "bind the KV-event PUB socket here whatever its host, e.g. tcp://127.0.0.1:5557 "
                "(loopback only; kv_events_endpoint connects a non-wildcard host)"})
    tier_secret_file: Optional[str] = field(default=None, metadata={
        "help": "a file of the engine's user (mode 0600) holding the fleet's tier secret, which "
                "authenticates disk and remote tier records (default: PAGEDKV_TIER_SECRET; a "
                "remote tier needs one)"})
    speculative_config: Union[str, Dict[str, Any], SpeculativeConfig, None] = field(
        default=None, metadata={
            "help": "speculative decoding, vLLM's JSON: e.g. {\"method\": \"ngram\", "
                    "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 3}, or a draft "
                    "model: {\"model\": \"path/to/draft\", \"num_speculative_tokens\": 3} "
                    "(default: off)"})

    async_scheduling: bool = field(default=False, metadata={
        "help": "schedule each step while the previous one runs on the device, hiding the "
                "host's work between steps (not with speculative_config or "
                "tensor_parallel_size > 1)"})

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        object.__setattr__(self, "speculative_config",
                           parse_speculative_config(self.speculative_config))
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise _bad("speculative_config", self.speculative.as_dict() if self.speculative
                       else None, "not supported with tensor_parallel_size > 1 yet")
        if self.async_scheduling is True and self.speculative_config is not None:
            raise _bad("async_scheduling", True, "not supported with speculative_config yet "
                       "(a drafted step's tokens decide the next step's)")
        if self.async_scheduling is True and self.tensor_parallel_size != 1:
            raise _bad("async_scheduling", True, "not supported with tensor_parallel_size > 1 "
                       "yet")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "cuda_graph_pieces"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise _bad(name, value, "must be an int >= 1")
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise _bad("num_blocks", self.num_blocks, "exclusive with kv_cache_memory")
        u = self.gpu_memory_utilization
        if u is not None:
            if not (_is_number(u) and 0 < u <= 1):
                raise _bad("gpu_memory_utilization", u, "must be a number in (0, 1]")
            if self.num_blocks is not None or self.kv_cache_memory is not None:
                raise _bad("gpu_memory_utilization", u,
                           "exclusive with num_blocks and kv_cache_memory")
        if self.seed is not None and not (_is_int(self.seed) and self.seed >= 0):
            raise _bad("seed", self.seed, "must be an int >= 0")
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
        if self.tier_secret_file is not None and not (isinstance(self.tier_secret_file, str)
                                                      and self.tier_secret_file):
            raise _bad("tier_secret_file", self.tier_secret_file, "must be a non-empty path string")
        if self.hash_seed is not None and not (_is_int(self.hash_seed)
                                               and 0 <= self.hash_seed < 1 << 64):
            raise _bad("hash_seed", self.hash_seed, "must be an int in [0, 2**64)")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_bind"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and "://" in value):
                raise _bad(name, value, "must be a ZeroMQ endpoint such as 'tcp://*:5557'")
        if (self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None
                and self.kv_events_bind is None):
            raise _bad("kv_events_replay_endpoint", self.kv_events_replay_endpoint,
                       "needs kv_events_endpoint or kv_events_bind")
        if not isinstance(self.kv_events_topic, str):
            raise _bad("kv_events_topic", self.kv_events_topic, "must be a string")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "cuda_graphs", "progress",
                     "record_steps", "decode_planner", "host_cache_write_through", "fused_model",
                     "async_scheduling"):
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
    def speculative(self) -> Optional[SpeculativeConfig]:
        """The speculative settings (``speculative_config`` as parsed), or ``None``."""
        sc = self.speculative_config
        return sc if isinstance(sc, SpeculativeConfig) else None

    @property
    def step_token_budget(self) -> int:
        """Most new tokens in one step's buffers: ``max_num_batched_tokens``, raised to
        ``max_num_seqs`` (a decode step carries one token per sequence)."""
        return max(self.max_num_batched_tokens, self.max_num_seqs)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
