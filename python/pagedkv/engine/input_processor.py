"""Input processing: from what a caller passes to a validated :class:`~.request.Request`.

Owns prompt handling (text through the tokenizer, token ids checked against the vocabulary, the
dict forms), the checks of sampling parameters that depend on the model, request ids, cache
salts, per-request seeds, and the shapes :meth:`LLM.generate <pagedkv.engine.llm.LLM.generate>`
accepts (one prompt or a list, one setting or one per prompt).

Invariants: validation (:meth:`InputProcessor.validate`) is complete before anything is queued
and changes nothing, so bad input raises a :mod:`pagedkv.errors` class and leaves the engine as
it was; a mapping is a prompt only as a plain dict of ``prompt`` / ``prompt_token_ids`` (never
iterated otherwise); a prompt that reaches ``max_model_len``, or one whose ``max_tokens`` would
run past a pool-set limit, is refused here rather than cut short later; token ids handed on are
a fresh list of plain ints. It imports neither the engine core nor output processing.
"""

from __future__ import annotations

import array
import itertools
import os
import random
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Container, List, Optional, Tuple, Union

import numpy as np

from ..errors import InvalidArgumentError
from .request import Prompt, Request
from .sampling_params import RequestOutputKind, SamplingParams

__all__ = ["InputProcessor", "ValidatedRequest", "bad_argument", "check_prompt_mapping",
           "normalize_prompts", "per_prompt", "final_only"]

#: ``(request_id, text or None, token ids, params, cache salt)`` of a validated request.
ValidatedRequest = Tuple[str, Optional[str], List[int], SamplingParams, Optional[bytes]]


def bad_argument(what: str, value: Any, reason: str) -> InvalidArgumentError:
    """The :class:`InvalidArgumentError` for ``what = value`` (a long list shown by its length)."""
    shown = value if not isinstance(value, (list, tuple)) or len(value) <= 8 else f"<{len(value)} items>"
    return InvalidArgumentError(
        f"invalid argument: {what} = {shown!r}: {reason}", what=what, value=shown, reason=reason
    )


_bad = bad_argument

_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def check_prompt_mapping(prompt: Any) -> None:
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


def normalize_prompts(prompts: Any) -> List[Any]:
    """``generate``'s ``prompts`` as a list of prompts: one prompt (a string, a dict, a flat list
    of ints, a 1-D array or tensor of ids) becomes a list of one."""
    if prompts is None:
        raise _bad("prompts", None, "None is not a prompt; conversations go to LLM.chat()")
    if isinstance(prompts, Mapping):
        check_prompt_mapping(prompts)
    if getattr(prompts, "ndim", None) == 1:
        return [prompts]  # one prompt as a 1-D array or tensor of token ids
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and prompts and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompts)
    ):
        return [prompts]
    return list(prompts)


def per_prompt(what: str, value: Any, n: int, kind: Any) -> List[Any]:
    """``value`` once per prompt: one value of type ``kind`` (or None) for all, or a list of
    exactly ``n``."""
    if value is None or isinstance(value, kind):
        return [value] * n
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise _bad(what, f"<{len(value)} items>", f"needs one entry per prompt ({n})")
        return list(value)
    raise _bad(what, type(value).__name__, "must be one value or one per prompt")


def final_only(params: Any) -> Any:
    """``generate`` waits for final outputs: intermediate snapshots would only cost time."""
    if params is None:
        return SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)
    if isinstance(params, SamplingParams) and params.output_kind is not RequestOutputKind.FINAL_ONLY:
        return replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    return params


class InputProcessor:
    """Validates and tokenizes requests for one loaded model and one KV pool.

    Args:
        tokenizer: The model's tokenizer (``None``: prompts must be token ids).
        vocab_size: The model's vocabulary (0: unknown, ids are not range-checked).
        max_model_len: The longest sequence served (the model's context or the pool's limit).
        model_context_len: The model's own context.
        max_num_seqs: Most sequences in one step (bounds ``n``).
        tensor_parallel: Whether steps run tensor-parallel (no prompt logprobs then).
        seed: Seeds the draws of seeds for requests that give none (``None``: random).
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, max_model_len: int,
                 model_context_len: int, max_num_seqs: int, tensor_parallel: bool,
                 seed: Optional[int] = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.model_context_len = model_context_len
        self.max_num_seqs = max_num_seqs
        self.tensor_parallel = tensor_parallel
        self._request_ids = itertools.count()
        # Seeds for requests that give none: drawn once per request, so even an unseeded request
        # resumes unchanged after a preemption.
        self._seed_rng = random.Random(seed)

    # ---------------------------------------------------------------------------- prompts

    def tokenize(self, prompt: Prompt) -> Tuple[Optional[str], List[int]]:
        """``(text or None, token ids)`` of a prompt, validated against the model (see
        :meth:`LLMEngine.tokenize <pagedkv.engine.llm_engine.LLMEngine.tokenize>`)."""
        given_text: Optional[str] = None
        if isinstance(prompt, Mapping):
            check_prompt_mapping(prompt)
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
            ids = self.check_ids(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
        if given_text is not None:
            text = given_text
        if not ids:
            raise _bad("prompt", text if text is not None else ids, "the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise _bad("prompt", ids, f"{len(ids)} tokens leave no room for a generated token "
                                      f"within max_model_len = {self.max_model_len} "
                                      f"({self._limit_name()})")
        return text, ids

    def check_ids(self, seq: Any) -> List[int]:
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

    # --------------------------------------------------------------------------- requests

    def validate(self, request_id: Optional[str], prompt: Prompt,
                 params: Optional[SamplingParams], cache_salt: Union[str, bytes, None],
                 in_use: Container[str]) -> ValidatedRequest:
        """Checks a request completely (``in_use``: the ids of unfinished requests); returns
        what :meth:`make_request` takes. Changes nothing but the id counter."""
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise _bad("params", type(params).__name__, "must be a SamplingParams")
        if params.n > self.max_num_seqs:
            raise _bad("n", params.n, f"more samples than max_num_seqs "
                                      f"({self.max_num_seqs}) can run together")
        if request_id is None:
            request_id = f"req-{next(self._request_ids)}"
            while request_id in in_use:
                request_id = f"req-{next(self._request_ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise _bad("request_id", request_id, "must be a non-empty string")
        elif request_id in in_use:
            raise _bad("request_id", request_id, "already in use by an unfinished request")
        salt = self._check_salt(cache_salt)
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
        return request_id, text, ids, params, salt

    @staticmethod
    def _check_salt(cache_salt: Union[str, bytes, None]) -> Optional[bytes]:
        if cache_salt is None:
            return None
        if isinstance(cache_salt, str):
            cache_salt = cache_salt.encode()
        elif not isinstance(cache_salt, (bytes, bytearray)):
            raise _bad("cache_salt", cache_salt, "must be str or bytes")
        salt = bytes(cache_salt)
        if not salt:
            raise _bad("cache_salt", salt, "must not be empty (an empty salt would "
                                           "share the unsalted cache); pass None for no salt")
        return salt

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
        if params.prompt_logprobs is not None and self.tensor_parallel:
            raise _bad("prompt_logprobs", params.prompt_logprobs,
                       "not supported with tensor_parallel_size > 1")

    def make_request(self, validated: ValidatedRequest, arrival_time: Optional[float]) -> Request:
        """The :class:`Request` of a validated request: its seed drawn (when the params give
        none), and a private cache namespace when it asks for prompt logprobs."""
        request_id, text, ids, params, salt = validated
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        if params.prompt_logprobs is not None:
            # Every prompt position's logits are needed, so no prefix-cache hit may skip one: a
            # private cache namespace (nor does any other request then hit these blocks).
            salt = (salt or b"") + b"\x00prompt-logprobs\x00" + os.urandom(16)
        return Request(request_id, text, ids, params, salt, seed,
                       time.perf_counter() if arrival_time is None else arrival_time)
