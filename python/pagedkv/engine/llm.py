"""The offline API: a batch of prompts (or conversations) to completion.

Owns :class:`LLM` (``generate`` / ``chat``: outputs in input order), shaped like ``vllm.LLM``; it
drives one :class:`~.llm_engine.LLMEngine` (or, on a tensor-parallel rank other than 0, the
worker that runs rank 0's steps). ``LLMEngine`` and ``EngineStats`` are importable from here too.

Invariants: every prompt of a batch is validated before any is queued (a bad one leaves the
engine unchanged); requests a ``generate`` call queued and did not see finish are aborted when it
raises; ``generate`` asks for final outputs only (intermediate snapshots would only cost time).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Union, overload

from tqdm.auto import tqdm

from ..distributed.launch import build_worker, dist_rank, serve_until_end
from ..distributed.step_broadcast import CMD_STOP
from .builder import config_from_kwargs, keyword_signature
from .config import EngineConfig
from .input_processor import bad_argument, final_only, normalize_prompts, per_prompt
from .llm_engine import LLMEngine
from .loader import LoadedModel
from .model_runner import build_rank_runner
from .outputs import RequestOutput
from .request import Prompt
from .sampling_params import SamplingParams
from .stats import EngineStats

__all__ = ["LLM", "LLMEngine", "EngineStats", "Prompt"]


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

    def __init__(self, model: Union[str, LoadedModel, None] = None, *,
                 device: Optional[str] = None, dtype: Any = None, progress: bool = True,
                 **engine_args: Any) -> None:
        self._setup(model, device, dtype, config_from_kwargs({"progress": progress, **engine_args}))

    @classmethod
    def from_config(cls, config: EngineConfig, model: Union[str, LoadedModel, None] = None, *,
                    device: Optional[str] = None, dtype: Any = None) -> "LLM":
        """An LLM with the settings of ``config``; ``model``, ``device`` and ``dtype`` as for the
        constructor."""
        if not isinstance(config, EngineConfig):
            raise bad_argument("config", type(config).__name__, "must be an EngineConfig")
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
        prompts = normalize_prompts(prompts)
        n = len(prompts)
        params_list = [final_only(p) for p in
                       per_prompt("sampling_params", sampling_params, n, SamplingParams)]
        salts = per_prompt("cache_salt", cache_salt, n, (str, bytes))
        # Validate everything before queuing anything: a bad prompt leaves the engine unchanged.
        validated = [engine._validate(None, p, sp, s) for p, sp, s in zip(prompts, params_list, salts)]
        ids = []
        start = time.perf_counter()
        for v in validated:
            engine._enqueue(v, start)
            ids.append(v[0])

        results: Dict[str, RequestOutput] = {}
        pending = set(ids)
        bar = tqdm(total=n, desc="generating", unit="req", disable=not use_tqdm or None,
                   dynamic_ncols=True)
        gen_before = engine.num_generated_tokens
        try:
            while pending:
                for out in engine.step():
                    if out.request_id in pending and out.finished:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
                if use_tqdm:
                    done = engine.num_generated_tokens - gen_before
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
        from ..chat import render_conversations

        tok = self.get_tokenizer()
        prompts = render_conversations(tok, messages, chat_template=chat_template,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message,
                                       chat_template_kwargs=chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, cache_salt=cache_salt)


# Every EngineConfig field, with its default, in the constructor's signature (help, IDEs).
setattr(LLM.__init__, "__signature__", keyword_signature(LLM.__init__))
