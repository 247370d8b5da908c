"""The response formats of the HTTP server: completion and chat, whole and as SSE chunks.

Owns :class:`_CompletionFormat` and :class:`_ChatFormat` (a whole response, the opening chunks, a
streamed chunk, the usage chunk; logprobs in each API's shape), :func:`_usage` (OpenAI's
``usage`` with ``prompt_tokens_details.cached_tokens``), :func:`_event` (one server-sent event),
:class:`_Delta` (what of one choice's cumulative output has been sent, yielding :class:`_Piece`)
and the ``stream_options`` flags (:func:`_include_usage`, :func:`_continuous_usage`).

Invariants:

* every ``usage`` carries ``prompt_tokens_details.cached_tokens`` (the prompt tokens served from
  the prefix cache, any tier);
* streamed text is the final text cut into pieces: a piece is sent only once no later output can
  take it back (a partial stop string or an incomplete UTF-8 sequence is held until resolved).
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional, Union

from ..engine.outputs import CompletionOutput, RequestOutput
from .protocol import ChatCompletionRequest, CompletionRequest


def _include_usage(req: Union[CompletionRequest, ChatCompletionRequest]) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _continuous_usage(req: Union[CompletionRequest, ChatCompletionRequest]) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage
                and req.stream_options.continuous_usage_stats)


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _Piece:
    __slots__ = ("text", "logprobs", "token_ids", "finish_reason", "stop_reason")

    def __init__(self, text: str, logprobs: List[Any], token_ids: List[int],
                 finish_reason: Optional[str], stop_reason: Any) -> None:
        self.text = text
        self.logprobs = logprobs
        self.token_ids = token_ids
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason


class _Delta:
    """What of one choice's cumulative output has been sent."""

    __slots__ = ("sent_text", "sent_tokens", "sent_logprobs", "holdback", "done")

    def __init__(self, params: Any) -> None:
        self.sent_text = ""
        self.sent_tokens = 0
        self.sent_logprobs = 0
        stops = getattr(params, "stop", None) or ()
        # A stop string might still complete and be cut from the text: hold back all but one of
        # its characters until it did or did not.
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.done = False

    def advance(self, c: CompletionOutput) -> Optional[_Piece]:
        if self.done:
            return None
        text = c.text
        finished = c.finish_reason is not None
        if finished:
            safe = text
        else:
            safe = text[: len(text) - self.holdback] if self.holdback else text
            while safe.endswith("\ufffd"):
                safe = safe[:-1]
        piece = ""
        if safe.startswith(self.sent_text) and len(safe) > len(self.sent_text):
            piece = safe[len(self.sent_text):]
            self.sent_text = safe
        new_ids = list(c.token_ids[self.sent_tokens:])
        self.sent_tokens = len(c.token_ids)
        lps = list((c.logprobs or [])[self.sent_logprobs:])
        self.sent_logprobs += len(lps)
        if not piece and not lps and not finished:
            return None
        self.done = finished
        return _Piece(piece, lps, new_ids, c.finish_reason, c.stop_reason)



def _token_text(lp: Any, token_id: int) -> str:
    text = getattr(lp, "decoded_token", None)
    return text if text is not None else f"token_id:{token_id}"


class _CompletionFormat:
    def __init__(self, id_: str, model: str, n: int, logprobs: bool, include_usage: bool,
                 continuous_usage: bool = False) -> None:
        self.id, self.model, self.n = id_, model, n
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.created = int(time.time())
        self.offsets: Dict[int, int] = {}

    def _head(self) -> Dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model}

    def _logprobs(self, index: int, token_ids: List[int], entries: List[Any]) -> Dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = self.offsets.get(index, 0)
        for tid, entry in zip(token_ids, entries):
            chosen = entry.get(tid)
            text = _token_text(chosen, tid)
            tokens.append(text)
            token_lps.append(chosen.logprob if chosen is not None else None)
            tops.append({_token_text(lp, t): lp.logprob for t, lp in
                         sorted(entry.items(), key=lambda kv: kv[1].rank or 0)})
            offsets.append(offset)
            offset += len(text)
        self.offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def opening(self) -> List[Dict[str, Any]]:
        return []

    def chunk(self, index: int, piece: _Piece) -> Dict[str, Any]:
        lp = self._logprobs(index, piece.token_ids, piece.logprobs) if self.logprobs else None
        return {**self._head(), "choices": [{
            "index": index, "text": piece.text, "logprobs": lp,
            "finish_reason": piece.finish_reason, "stop_reason": piece.stop_reason}]}

    def usage_chunk(self, prompt: int, completion: int, cached: int) -> Dict[str, Any]:
        return {**self._head(), "choices": [], "usage": _usage(prompt, completion, cached)}

    def full(self, finals: List[RequestOutput]) -> Dict[str, Any]:
        choices = []
        completion = 0
        for i, out in enumerate(finals):
            for c in out.outputs:
                index = i * self.n + c.index
                completion += len(c.token_ids)
                lp = (self._logprobs(index, list(c.token_ids), list(c.logprobs or []))
                      if self.logprobs else None)
                choices.append({"index": index, "text": c.text, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        cached = sum(o.num_cached_tokens for o in finals)
        return {**self._head(), "choices": choices, "usage": _usage(prompt, completion, cached)}


class _ChatFormat:
    def __init__(self, id_: str, model: str, n: int, logprobs: bool, top: int,
                 include_usage: bool, continuous_usage: bool = False) -> None:
        self.id, self.model, self.n = id_, model, n
        self.logprobs, self.top = logprobs, top
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.created = int(time.time())

    def _head(self, obj: str) -> Dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, token_ids: List[int], entries: List[Any]) -> Dict[str, Any]:
        content = []
        for tid, entry in zip(token_ids, entries):
            chosen = entry.get(tid)
            text = _token_text(chosen, tid)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[: self.top]
            content.append({
                "token": text, "logprob": chosen.logprob if chosen is not None else None,
                "bytes": list(text.encode()),
                "top_logprobs": [{"token": _token_text(lp, t), "logprob": lp.logprob,
                                  "bytes": list(_token_text(lp, t).encode())}
                                 for t, lp in ranked],
            })
        return {"content": content}

    def opening(self) -> List[Dict[str, Any]]:
        return [{**self._head("chat.completion.chunk"), "choices": [{
            "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]} for i in range(self.n)]

    def chunk(self, index: int, piece: _Piece) -> Dict[str, Any]:
        lp = self._logprobs(piece.token_ids, piece.logprobs) if self.logprobs else None
        delta = {"content": piece.text} if piece.text or piece.finish_reason is None else {}
        return {**self._head("chat.completion.chunk"), "choices": [{
            "index": index, "delta": delta, "logprobs": lp, "finish_reason": piece.finish_reason,
            "stop_reason": piece.stop_reason}]}

    def usage_chunk(self, prompt: int, completion: int, cached: int) -> Dict[str, Any]:
        return {**self._head("chat.completion.chunk"), "choices": [],
                "usage": _usage(prompt, completion, cached)}

    def full(self, finals: List[RequestOutput]) -> Dict[str, Any]:
        out = finals[0]
        choices = []
        for c in out.outputs:
            lp = self._logprobs(list(c.token_ids), list(c.logprobs or [])) if self.logprobs \
                else None
            choices.append({"index": c.index,
                            "message": {"role": "assistant", "content": c.text},
                            "logprobs": lp, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
        completion = sum(len(c.token_ids) for c in out.outputs)
        return {**self._head("chat.completion"), "choices": choices,
                "usage": _usage(len(out.prompt_token_ids), completion, out.num_cached_tokens)}


def _usage(prompt: int, completion: int, cached: int) -> Dict[str, Any]:
    """OpenAI's ``usage``; ``cached``: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


