"""The OpenAI-compatible wire format: request models (pydantic) and the error body.

Owns :class:`CompletionRequest`, :class:`ChatCompletionRequest`, :class:`TokenizeRequest`,
:class:`DetokenizeRequest`, :func:`error_body`, :func:`find_lone_surrogate` and the mapping of a
request to :class:`~pagedkv.SamplingParams`. Invariants:

* tolerant where it cannot change the answer: a field the server does not use (``store``,
  ``metadata``, ``user``, ``service_tier``, ``parallel_tool_calls``, ``reasoning_effort``, any
  unknown name) is accepted and reported by :meth:`_Sampling.ignored_fields`, never a 400;
* strict where it would: a field whose meaning the engine cannot honour and that changes the output
  (``logit_bias``, ``suffix``, ``echo``, ``tools``, a non-text ``response_format``, structured or
  guided decoding, ...; :data:`STRICT_FIELDS`) is a 400 naming it;
* every option it accepts is passed to ``SamplingParams``, whose own validation names the bad value;
* no string with a lone UTF-16 surrogate (``"\\ud800"`` in JSON) reaches the engine: it cannot be
  encoded, so it is a 400 naming the field (:func:`find_lone_surrogate`).

Beyond OpenAI's fields, the requests take the engine's own sampling options under vLLM's names
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``), as the ``openai`` client's ``extra_body``
sends them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "StreamOptions",
           "TokenizeRequest", "DetokenizeRequest", "UnsupportedFieldError", "STRICT_FIELDS",
           "error_body", "find_lone_surrogate", "sampling_params"]

#: Fields (beyond the declared ones) whose meaning the engine cannot honour and that would change
#: the output: present with a value other than null / false / empty, they are a 400 naming them.
STRICT_FIELDS: Dict[str, str] = {
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "prediction": "predicted outputs are not supported",
    "audio": "audio output is not supported",
    "guided_json": "guided decoding is not supported",
    "guided_regex": "guided decoding is not supported",
    "guided_choice": "guided decoding is not supported",
    "guided_grammar": "guided decoding is not supported",
    "structured_outputs": "structured outputs are not supported",
    "prompt_logprobs": "prompt_logprobs is not supported by the server",
    "allowed_token_ids": "allowed_token_ids is not supported",
    "bad_words": "bad_words is not supported",
    "logits_processors": "logits_processors is not supported",
    "use_beam_search": "beam search is not supported",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
}


def _empty(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, list) and not value)


def find_lone_surrogate(value: Any, path: str = "") -> Optional[str]:
    """The dotted path (``messages.0.content``) of the first string in ``value`` (nested dicts,
    lists and pydantic models, keys included) holding a lone UTF-16 surrogate, or ``None``."""
    stack: List[Tuple[str, Any]] = [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, BaseModel):
            items = dict(v)
            if v.model_extra:
                items.update(v.model_extra)
            stack.extend((f"{where}.{k}" if where else k, x) for k, x in reversed(items.items()))
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(v, dict):
            for k, x in reversed(list(v.items())):
                key = f"{where}.{k}" if where else str(k)
                if isinstance(k, str) and find_lone_surrogate(k) is not None:
                    return where or "body"
                stack.append((key, x))
        elif isinstance(v, (list, tuple)):
            # Token-id lists are long and hold no string: only containers and strings are pushed.
            stack.extend((f"{where}.{i}" if where else str(i), x)
                         for i, x in reversed(list(enumerate(v)))
                         if isinstance(x, (str, list, tuple, dict, BaseModel)))
    return None


class UnsupportedFieldError(ValueError):
    """A request field the server knows of but does not implement."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def error_body(message: str, type_: str, param: Optional[str] = None,
               code: Union[int, str, None] = None) -> Dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False
    #: With ``include_usage``: usage (so far) in every chunk, not only in a last one.
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints. Unknown fields are kept (``model_extra``), checked
    against :data:`STRICT_FIELDS` by :meth:`check`, otherwise ignored."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Union[str, List[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[Dict[str, float]] = None
    # The engine's own options (vLLM's names).
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: Optional[str] = None

    def _check_unsupported(self) -> None:
        if self.logit_bias:
            raise UnsupportedFieldError("logit_bias", "logit_bias is not supported")
        for name, value in (self.model_extra or {}).items():
            if name in STRICT_FIELDS and not _empty(value):
                raise UnsupportedFieldError(name, f"{name}: {STRICT_FIELDS[name]}")

    def ignored_fields(self) -> List[str]:
        """The request's fields the server accepted without using them (``stream_options.X``
        for those inside ``stream_options``), sorted."""
        names = [k for k in (self.model_extra or {}) if k not in STRICT_FIELDS]
        if self.user is not None:
            names.append("user")
        if self.stream_options is not None and self.stream_options.model_extra:
            names.extend(f"stream_options.{k}" for k in self.stream_options.model_extra)
        return sorted(names)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    #: Whether a string prompt is tokenized with the tokenizer's special tokens (BOS).
    add_special_tokens: bool = True

    def prompts(self) -> List[Union[str, List[int]]]:
        """The request's prompts, one per choice group (a flat list of ints is one prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def check(self) -> None:
        self._check_unsupported()
        if self.echo:
            raise UnsupportedFieldError("echo", "echo is not supported")
        if self.suffix:
            raise UnsupportedFieldError("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFieldError("best_of", "best_of other than n is not supported")
        if not self.prompts():
            raise UnsupportedFieldError("prompt", "prompt must not be empty")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, List[Dict[str, Any]], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        """The message's text; content parts other than text are refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise UnsupportedFieldError(
                    "messages", f"content part of type {part.get('type')!r} is not supported "
                                f"(text only)")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[Dict[str, Any]] = None
    #: The chat template places the special tokens: only False (vLLM's chat default) is served.
    add_special_tokens: bool = False

    def check(self) -> None:
        self._check_unsupported()
        if self.add_special_tokens:
            raise UnsupportedFieldError("add_special_tokens", "add_special_tokens: the chat "
                                        "template places the special tokens; only false")
        if self.tools:
            raise UnsupportedFieldError("tools", "tools are not supported")
        if self.tool_choice not in (None, "none", "auto"):  # without tools, "auto" is "none"
            raise UnsupportedFieldError("tool_choice", "tool_choice is not supported")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise UnsupportedFieldError("response_format",
                                        "response_format other than text is not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedFieldError("top_logprobs", "top_logprobs needs logprobs: true")
        modalities = (self.model_extra or {}).get("modalities")
        if modalities is not None and modalities != ["text"]:
            raise UnsupportedFieldError("modalities", "modalities other than [\"text\"] are not "
                                                      "supported")

    def messages_as_dicts(self) -> List[Dict[str, str]]:
        out = []
        for m in self.messages:
            d = {"role": m.role, "content": m.text()}
            if m.name:
                d["name"] = m.name
            out.append(d)
        return out


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): a ``prompt``, or chat ``messages`` rendered through the
    chat template."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[List[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise UnsupportedFieldError("prompt", "give exactly one of prompt and messages")


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape)."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    tokens: List[int]


def sampling_params(req: Union[CompletionRequest, ChatCompletionRequest],
                    max_tokens: int, logprobs: Optional[int]) -> Any:
    """The request's :class:`~pagedkv.SamplingParams` (raises its ``InvalidArgumentError``)."""
    from ..engine.sampling_params import SamplingParams

    kwargs: Dict[str, Any] = dict(n=req.n, max_tokens=max_tokens, seed=req.seed,
                                  ignore_eos=req.ignore_eos,
                                  skip_special_tokens=req.skip_special_tokens)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if req.stop:
        kwargs["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.include_stop_str_in_output:
        kwargs["include_stop_str_in_output"] = True
    if req.stop_token_ids:
        kwargs["stop_token_ids"] = tuple(req.stop_token_ids)
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    return SamplingParams(**kwargs)
