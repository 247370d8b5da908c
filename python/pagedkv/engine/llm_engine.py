"""The engine: requests in, tokens out, every KV read and write through the paged cache.

Owns :class:`LLMEngine` (``add_request`` / ``step`` / ``has_unfinished_requests``, one scheduler
step per call), shaped like vLLM's ``LLMEngine``. It composes the parts :mod:`.builder` makes from
one :class:`~.config.EngineConfig`, each owning its own invariants:

* :mod:`.input_processor` validates and tokenizes a request into a :class:`~.request.Request`;
* :mod:`.core` (:class:`~.core.EngineCore`) runs one scheduler step: the scheduler, the block
  manager, the model runner, the sampler and the tiers below the GPU;
* :mod:`.output_processor` turns each step's draws into finishes, text, logprobs and
  :class:`~.outputs.RequestOutput` snapshots;
* :mod:`.stats` counts what the engine did (:class:`~.stats.EngineStats`).

Invariants of this module: a request is validated completely (prompt, parameters, salt, fit)
before anything is queued, so bad input raises a :mod:`pagedkv.errors` class and leaves the engine
unchanged; an unfinished request is in ``LLMEngine._requests`` from ``add_request`` until the step
that reports it finished (or its abort); ``max_model_len`` is the model's context, or what the KV
pool holds for one sequence when that is less, and a request whose prompt reaches it, or whose
prompt plus ``max_tokens`` exceeds a pool-set limit, is refused at ``add_request``, never cut short.
"""

from __future__ import annotations

import time
from typing import Any, Dict, FrozenSet, List, Optional, Tuple, Union

from .builder import build_engine, config_from_kwargs, keyword_signature, settings_doc
from .config import EngineConfig
from .input_processor import ValidatedRequest, bad_argument
from .loader import LoadedModel
from .outputs import RequestOutput
from .request import Prompt, Request
from .sampling_params import SamplingParams
from .stats import EngineStats
from .summary import log_startup

__all__ = ["LLMEngine", "EngineStats", "Prompt"]


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
        **engine_args: Any :class:`~pagedkv.engine.config.EngineConfig` field, by name, each
            defaulting to the field's default (the signature lists them all). Each field's help
            is appended below ("Settings"); the config's docstring groups them.

    Raises:
        ModelLoadError: ``model`` does not exist, is not a model directory or ``.gguf`` file, or is
            not a Llama-family architecture.
        ConfigArgumentError: A setting is out of range, or two exclusive ones are given (the
            keywords build an :class:`~pagedkv.engine.config.EngineConfig`, validated once;
            :meth:`from_config` takes one directly).
        InvalidConfigError: The tensor-parallel split does not fit the model or the machine.
        InvalidArgumentError: ``device`` or ``dtype`` is not understood, or a keyword is no
            :class:`~pagedkv.engine.config.EngineConfig` field (the error names it).
    """

    def __init__(self, model: Union[str, LoadedModel, None] = None, *, device: Optional[str] = None,
                 dtype: Any = None, **engine_args: Any) -> None:
        self._setup(model, device, dtype, config_from_kwargs(engine_args))

    @classmethod
    def from_config(cls, config: EngineConfig, model: Union[str, LoadedModel, None] = None, *,
                    device: Optional[str] = None, dtype: Any = None) -> "LLMEngine":
        """An engine with the settings of ``config`` (the constructor's keywords, validated once);
        ``model``, ``device`` and ``dtype`` as for the constructor."""
        if not isinstance(config, EngineConfig):
            raise bad_argument("config", type(config).__name__, "must be an EngineConfig")
        engine = cls.__new__(cls)
        engine._setup(model, device, dtype, config)
        return engine

    def _setup(self, model: Union[str, LoadedModel, None], device: Optional[str], dtype: Any,
               config: EngineConfig) -> None:
        #: After :meth:`shutdown` with ``record_steps``: each rank's step records, in rank order.
        self.tp_step_records: Optional[List[Any]] = None
        parts = build_engine(config, model, device, dtype)
        #: The settings this engine runs with.
        self.config = config
        self.loaded = parts.loaded
        self.device = parts.device
        self.model_path = parts.model_path
        self.tokenizer = parts.loaded.tokenizer
        self.block_size = config.block_size
        #: The model's own context (``max_position_embeddings``, capped at a sliding window).
        self.model_context_len = parts.model_context_len
        #: The longest sequence (prompt and completion) the engine serves: the model's context, or
        #: less when the KV pool cannot hold that much for one sequence.
        self.max_model_len = parts.max_model_len
        self.vocab_size = parts.inputs.vocab_size
        #: The engine core (:class:`~.core.EngineCore`), input and output processing.
        self.core = parts.core
        # Drafts stop short of the longest sequence served (the pool may hold less than the
        # model's context).
        self.core.max_model_len = parts.max_model_len
        self.input_processor = parts.inputs
        self.output_processor = parts.outputs
        self._stats = parts.stats
        self.core.on_preempt = self._count_preemptions
        self.core.on_prefill = self._count_prefill
        #: Unfinished requests by id.
        self._requests: Dict[str, Request] = {}
        log_startup(self)

    @property
    def eos_token_ids(self) -> FrozenSet[int]:
        """The tokens that end a sample with ``"stop"`` (unless ``ignore_eos``)."""
        return self.output_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: FrozenSet[int]) -> None:
        self.output_processor.eos_token_ids = frozenset(ids)

    # The core's parts, read where tests, benches and tools look for them.
    @property
    def runner(self) -> Any:
        """The :class:`~pagedkv.engine.model_runner.ModelRunner`."""
        return self.core.runner

    @property
    def manager(self) -> Any:
        """The :class:`pagedkv.BlockManager` (built by the engine core on the runner's pool)."""
        return self.core.manager

    @property
    def scheduler(self) -> Any:
        """The :class:`pagedkv.scheduler.Scheduler`."""
        return self.core.scheduler

    @property
    def tiers(self) -> Any:
        """The tiers below the GPU (:mod:`pagedkv.tiers`); None without a host tier
        (and after :meth:`shutdown`)."""
        return self.core.tiers

    @property
    def kv_events(self) -> Any:
        """The step's KV-event publisher (None without ``kv_events_endpoint`` / ``kv_events_bind``)."""
        return self.core.kv_events

    @property
    def cost_rates(self) -> Optional[Tuple[float, float, float]]:
        """``(host link bytes/s, prefill tokens/s, step floor s)`` of the cost model, or None."""
        return self.core.cost_rates

    @property
    def _tp(self) -> Any:
        """Rank 0's handle on the tensor-parallel group (None without TP)."""
        return self.core.tp

    def shutdown(self) -> None:
        """Stops the tensor-parallel ranks (STOP to every rank, spawned processes joined) and
        collects :attr:`tp_step_records`; closes the KV-event publisher and the tiers below the
        host (pending fetches released, writes flushed). Idempotent. The engine cannot run
        steps afterwards."""
        self.core.shutdown()
        tp = self.core.tp
        if tp is not None and not tp.closed:
            tp.close()
            self.tp_step_records = tp.step_records

    def metrics_collector(self, *, labels: Optional[Dict[str, str]] = None,
                          **kwargs: Any) -> Any:
        """A :class:`pagedkv.metrics.PagedKVCollector` reading this engine's manager, scheduler
        and tiers at scrape time (``labels`` and ``kwargs`` as for the collector), so a server
        exports the engine's signals without reaching into its parts.

        Raises:
            MetricsUnavailableError: ``prometheus_client`` is not installed.
        """
        from ..metrics import PagedKVCollector

        bpb = int(self.runner.spec.bytes_per_block)
        core = self.core

        def tiers() -> Dict[str, Dict[str, Any]]:
            t = core.tiers
            return t.totals(bpb) if t is not None else {}

        return PagedKVCollector(self.manager, self.scheduler, labels=labels, bytes_per_block=bpb,
                                tiers=tiers if core.tiers is not None else None, **kwargs)

    def spec_decode_collector(self, *, labels: Optional[Dict[str, str]] = None) -> Any:
        """A :class:`pagedkv.engine.spec_decode.metrics.SpecDecodeCollector` of this engine's
        speculative counters (vLLM's ``spec_decode`` signals), or ``None`` without
        ``speculative_config``.

        Raises:
            MetricsUnavailableError: ``prometheus_client`` is not installed.
        """
        if self.core.proposer is None:
            return None
        from .spec_decode.metrics import SpecDecodeCollector

        return SpecDecodeCollector(self.core, labels=labels)

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
        return self.input_processor.tokenize(prompt)

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
        validated = self._validate(request_id, prompt, params, cache_salt)
        self._enqueue(validated, arrival_time)
        return validated[0]

    def _validate(self, request_id: Optional[str], prompt: Prompt, params: Optional[SamplingParams],
                  cache_salt: Union[str, bytes, None]) -> ValidatedRequest:
        return self.input_processor.validate(request_id, prompt, params, cache_salt, self._requests)

    def _enqueue(self, validated: ValidatedRequest, arrival_time: Optional[float]) -> None:
        req = self.input_processor.make_request(validated, arrival_time)
        self.output_processor.add_request(req)
        self.core.add_request(req)
        self._requests[req.request_id] = req
        self._stats.on_request(len(req.prompt_token_ids))

    def abort_request(self, request_id: str) -> None:
        """Drops a request: its sequences stop and their blocks are freed (cached ones stay cached).

        Raises:
            InvalidArgumentError: No unfinished request has this id.
        """
        req = self._requests.get(request_id)
        if req is None:
            raise bad_argument("request_id", request_id, "no unfinished request has this id")
        self.core.abort_request(req)
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
        core = self.core
        ran = core.step()
        if ran.batch is None:
            if self._requests and not ran.waited:
                # Nothing runs and nothing will free blocks: the head of the queue can never be
                # admitted.
                stuck = next(iter(self._requests.values()))
                self.abort_request(stuck.request_id)
                raise core.out_of_blocks(stuck)
            return []
        out = self.output_processor
        if ran.prompt_logprobs:
            out.record_prompt_logprobs(ran.prompt_logprobs, ran.prompt_logits)
        now = time.perf_counter()
        touched, done = out.process_tokens(ran.sampled, now)
        if done:
            core.finish(done)
        outputs, finished = out.outputs(touched, now)
        for req in finished:
            self._requests.pop(req.request_id, None)
            self._stats.on_finished(req)
        self._stats.record_step(len(ran.batch.seqs), out.num_processed,
                                time.perf_counter() - started)
        core.end_step()
        return outputs

    def _count_preemptions(self, num: int, swapped: int) -> None:
        c = self._stats.counters
        c["num_preemptions"] += num
        c["num_preemptions_swap"] += swapped
        c["num_preemptions_recompute"] += num - swapped

    def _count_prefill(self, tokens: int) -> None:
        self._stats.counters["num_prefill_tokens"] += tokens

    # --------------------------------------------------------------------------------- stats

    def reset_stats(self) -> None:
        """Zeroes the engine's own counters (the manager's cumulative counters are snapshotted, so
        :meth:`stats` reports what happened since)."""
        self._stats.reset()

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated since the last :meth:`reset_stats` (over all samples)."""
        return self._stats.counters["num_generated_tokens"]

    def stats(self) -> EngineStats:
        """What the engine has done since it was created (or :meth:`reset_stats`)."""
        return self._stats.snapshot()


# Every EngineConfig field, with its default, in the constructor's signature and its help in the
# class's docstring (help(), IDEs): generated, so a new knob is one field.
setattr(LLMEngine.__init__, "__signature__", keyword_signature(LLMEngine.__init__))
LLMEngine.__doc__ = (LLMEngine.__doc__ or "") + settings_doc()
