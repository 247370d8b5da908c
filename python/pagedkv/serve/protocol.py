"""The OpenAI-compatible wire format: request models (pydantic) and the error body.

Owns :class:`CompletionRequest`, :class:`ChatCompletionRequest`, :func:`error_body` and the
mapping of a request to :class:`~pagedkv.SamplingParams`. Invariants: a field the server does not
understand is rejected (``extra="forbid"``), never silently dropped; every option it accepts is
passed to ``SamplingParams``, whose own validation names the bad value; an option OpenAI defines but
the engine does not implement (``logit_bias``, ``suffix``, ``echo``, tools, ...) is a 400 naming it.

Beyond OpenAI's fields, the requests take the engine's own sampling options under vLLM's names
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``), as the ``openai`` client's ``extra_body``
sends them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "StreamOptions",
           "UnsupportedFieldError", "error_body", "sampling_params"]


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
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")

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


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

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

    def check(self) -> None:
        self._check_unsupported()
        if self.tools:
            raise UnsupportedFieldError("tools", "tools are not supported")
        if self.tool_choice not in (None, "none"):
            raise UnsupportedFieldError("tool_choice", "tool_choice is not supported")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise UnsupportedFieldError("response_format",
                                        "response_format other than text is not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedFieldError("top_logprobs", "top_logprobs needs logprobs: true")

    def messages_as_dicts(self) -> List[Dict[str, str]]:
        out = []
        for m in self.messages:
            d = {"role": m.role, "content": m.text()}
            if m.name:
                d["name"] = m.name
            out.append(d)
        return out


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
