"""The OpenAI-compatible HTTP server: a FastAPI app over one :class:`~pagedkv.AsyncLLM`.

Owns :func:`build_app` (the routes, the error mapping, streaming over server-sent events) and
:func:`serve` (build the engine, run uvicorn). Routes: ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus
text: the KV-cache collector of :mod:`pagedkv.metrics` and the request signals of
:mod:`.request_metrics`, on the same port).

Invariants:

* every error response is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``:
  a bad request (unknown field, bad value, a prompt that cannot fit) is 400, an unknown model 404,
  a missing or wrong API key 401, a full queue (``max_queue_size``) or a stopped engine 503;
* a request is admitted (or refused with its error) before a streaming response starts, so a
  stream never begins with an error;
* a client that goes away — before its first token, mid-stream, or while a non-streaming request
  runs — has its requests aborted and their KV blocks freed before the engine's next step;
* streamed text is the final text cut into pieces: a piece is sent only once no later output can
  take it back (a partial stop string or an incomplete UTF-8 sequence is held until resolved).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Tuple, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.async_llm import AsyncLLM
from ..engine.outputs import CompletionOutput, RequestOutput
from ..errors import (EngineDeadError, EngineOverloadedError, InvalidArgumentError,
                      InvalidConfigError, OutOfBlocksError, PagedKVError)
from .protocol import (ChatCompletionRequest, CompletionRequest, UnsupportedFieldError,
                       error_body, sampling_params)
from .request_metrics import RequestMetrics

__all__ = ["build_app", "serve", "ServerState"]

logger = logging.getLogger("pagedkv.serve")

_DONE = object()


class _ClientGone(Exception):
    """The client disconnected while its request ran."""


class ServerState:
    """What the routes share: the engine, its name, the metrics registry."""

    def __init__(self, llm: AsyncLLM, served_model_name: str, api_key: Optional[str],
                 chat_template: Optional[str], metrics: RequestMetrics, registry: Any) -> None:
        self.llm = llm
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.chat_template = chat_template
        self.metrics = metrics
        self.registry = registry
        self.created = int(time.time())


def build_app(llm: AsyncLLM, *, served_model_name: str, api_key: Optional[str] = None,
              chat_template: Optional[str] = None) -> Any:
    """The FastAPI app serving ``llm`` under the model name ``served_model_name``.

    ``api_key``: when set, every ``/v1`` route needs ``Authorization: Bearer <api_key>``.
    ``chat_template``: a Jinja chat template used instead of the tokenizer's.
    """
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    labels = {"model_name": served_model_name}
    metrics = RequestMetrics(labels=labels)
    llm.observers.append(metrics)
    registry = CollectorRegistry(auto_describe=False)
    engine = llm.engine
    registry.register(engine.metrics_collector(labels=labels))
    registry.register(metrics)
    state = ServerState(llm, served_model_name, api_key, chat_template, metrics, registry)

    app = FastAPI(title="pagedkv", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pagedkv = state

    def err(status: int, message: str, type_: str, param: Optional[str] = None,
            code: Union[int, str, None] = None) -> JSONResponse:
        return JSONResponse(error_body(message, type_, param, code), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        return err(400, f"{param}: {msg}" if param else str(msg), "invalid_request_error",
                   param, "invalid_value")

    @app.exception_handler(UnsupportedFieldError)
    async def _unsupported(_request: Request, exc: UnsupportedFieldError) -> JSONResponse:
        return err(400, str(exc), "invalid_request_error", exc.param, "unsupported_parameter")

    @app.exception_handler(InvalidArgumentError)
    async def _invalid(_request: Request, exc: InvalidArgumentError) -> JSONResponse:
        return err(400, str(exc), "invalid_request_error", exc.what, "invalid_value")

    @app.exception_handler(OutOfBlocksError)
    async def _no_room(_request: Request, exc: OutOfBlocksError) -> JSONResponse:
        return err(400, str(exc), "invalid_request_error", "prompt", "context_length_exceeded")

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(_request: Request, exc: EngineOverloadedError) -> JSONResponse:
        return err(503, str(exc), "service_unavailable_error", None, "queue_full")

    @app.exception_handler(EngineDeadError)
    async def _dead(_request: Request, exc: EngineDeadError) -> JSONResponse:
        return err(503, str(exc), "service_unavailable_error", None, "engine_dead")

    @app.exception_handler(PagedKVError)
    async def _other(_request: Request, exc: PagedKVError) -> JSONResponse:
        return err(400, str(exc), "invalid_request_error", None, None)

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Any:
        if state.api_key is not None and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {state.api_key}":
                return err(401, "missing or wrong API key (Authorization: Bearer <key>)",
                           "authentication_error", None, "invalid_api_key")
        return await call_next(request)

    def check_model(name: Optional[str]) -> Optional[JSONResponse]:
        if name is not None and name != state.served_model_name:
            return err(404, f"the model {name!r} does not exist; this server serves "
                            f"{state.served_model_name!r}", "invalid_request_error", "model",
                       "model_not_found")
        return None

    @app.get("/health")
    async def health() -> Response:
        if llm.errored:
            return err(503, f"the engine loop has stopped: {llm.dead_reason}",
                       "service_unavailable_error", None, "engine_dead")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Dict[str, Any]:
        return {"object": "list", "data": [{
            "id": state.served_model_name, "object": "model", "created": state.created,
            "owned_by": "pagedkv", "root": engine.model_path, "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size,
        }]}

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        bad = check_model(req.model)
        if bad is not None:
            return bad
        req.check()
        params = sampling_params(req, 16 if req.max_tokens is None else req.max_tokens,
                                 req.logprobs)
        job = _Job(llm, req.prompts(), params, req.cache_salt, "cmpl")
        return await _respond(job, request, req.stream, _CompletionFormat(
            job.id, state.served_model_name, req.n, req.logprobs is not None,
            _include_usage(req)), StreamingResponse, JSONResponse)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        bad = check_model(req.model)
        if bad is not None:
            return bad
        req.check()
        messages = req.messages_as_dicts()
        template = state.chat_template
        prompt = await llm.call(lambda e: _render_chat(
            e, messages, template, req.add_generation_prompt, req.continue_final_message,
            req.chat_template_kwargs))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, engine.max_model_len - len(prompt["prompt_token_ids"]))
        top = None
        if req.logprobs:
            top = req.top_logprobs or 0
        params = sampling_params(req, max_tokens, top)
        job = _Job(llm, [prompt], params, req.cache_salt, "chatcmpl")
        return await _respond(job, request, req.stream, _ChatFormat(
            job.id, state.served_model_name, req.n, req.logprobs, req.top_logprobs or 0,
            _include_usage(req)), StreamingResponse, JSONResponse)

    return app


def _include_usage(req: Union[CompletionRequest, ChatCompletionRequest]) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _render_chat(engine: Any, messages: List[Dict[str, Any]], template: Optional[str],
                 add_generation_prompt: bool, continue_final_message: bool,
                 kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The conversation as a prompt, rendered as :meth:`pagedkv.LLM.chat` renders it. Runs on the
    engine thread: the tokenizer is not shared across threads."""
    from ..chat import render_conversations

    return render_conversations(engine.tokenizer, messages, chat_template=template,
                                add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message,
                                chat_template_kwargs=kwargs)[0]


# ------------------------------------------------------------------------------------- jobs

class _Job:
    """The engine requests of one HTTP request (one per prompt), merged into one stream."""

    def __init__(self, llm: AsyncLLM, prompts: List[Any], params: Any, salt: Optional[str],
                 kind: str) -> None:
        self.llm = llm
        self.prompts = prompts
        self.params = params
        self.salt = salt
        self.id = f"{kind}-{uuid.uuid4().hex}"
        self.gens = [llm.generate(p, params, request_id=f"{self.id}-{i}", cache_salt=salt)
                     for i, p in enumerate(prompts)]
        self.queue: "asyncio.Queue[Any]" = asyncio.Queue()
        self.pumps: List["asyncio.Task[None]"] = []
        self.firsts: List[RequestOutput] = []

    async def start(self) -> None:
        """Admits every prompt and waits for each one's first output; on any error (or a
        cancellation), aborts them all and raises it."""
        firsts = [asyncio.ensure_future(g.__anext__()) for g in self.gens]
        try:
            self.firsts = list(await asyncio.gather(*firsts))
        except BaseException:
            for t in firsts:
                t.cancel()  # each generator's own cleanup aborts its request
            await _settle(firsts)
            await self.close()
            raise
        for i, (gen, first) in enumerate(zip(self.gens, self.firsts)):
            self.pumps.append(asyncio.ensure_future(self._pump(i, gen, first)))

    async def _pump(self, i: int, gen: AsyncIterator[RequestOutput], first: RequestOutput) -> None:
        try:
            self.queue.put_nowait((i, first))
            if not first.finished:
                async for out in gen:
                    self.queue.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self.queue.put_nowait((i, exc))
        finally:
            self.queue.put_nowait((i, _DONE))

    async def outputs(self) -> AsyncIterator[Tuple[int, RequestOutput]]:
        """``(prompt index, output)`` as they come, until every prompt finished."""
        open_ = len(self.pumps)
        while open_:
            i, item = await self.queue.get()
            if item is _DONE:
                open_ -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item

    async def close(self) -> None:
        """Aborts whatever is unfinished; returns once the aborts were applied."""
        for t in self.pumps:
            t.cancel()
        await _settle(self.pumps)
        for g in self.gens:
            try:
                await g.aclose()  # type: ignore[attr-defined]
            except (RuntimeError, asyncio.CancelledError):  # pragma: no cover - still running
                pass


async def _settle(tasks: Sequence["asyncio.Future[Any]"]) -> None:
    """Waits for cancelled tasks to finish their clean-up (even if this task is cancelled too)."""
    pending = [t for t in tasks if not t.done()]
    if pending:
        try:
            await asyncio.wait(pending, timeout=30)
        except asyncio.CancelledError:
            pass
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: no "exception was never retrieved" warning


async def _wait_disconnect(request: Any) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_gone(request: Any, coro: Any) -> Any:
    """Awaits ``coro``; should the client disconnect first, cancels it and raises _ClientGone."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        watch.cancel()
        raise
    if work in done:
        watch.cancel()
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise _ClientGone


async def _respond(job: _Job, request: Any, stream: bool, fmt: Any, streaming_cls: Any,
                   json_cls: Any) -> Any:
    try:
        await _unless_gone(request, job.start())
    except _ClientGone:
        await job.close()
        return Response(status_code=499)
    if stream:
        return streaming_cls(_sse(job, request, fmt), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

    async def collect() -> List[RequestOutput]:
        last = list(job.firsts)
        async for i, out in job.outputs():
            last[i] = out
        return last

    try:
        finals = await _unless_gone(request, collect())
    except _ClientGone:
        await job.close()
        return Response(status_code=499)
    finally:
        await job.close()
    return json_cls(fmt.full(finals))


async def _sse(job: _Job, request: Any, fmt: Any) -> AsyncIterator[bytes]:
    # Our own disconnect watch: the stream may sit in the engine queue without sending anything,
    # and a client gone must be aborted then too, not at the next write.
    gone = asyncio.ensure_future(_wait_disconnect(request))
    gone.add_done_callback(lambda _t: job.queue.put_nowait((-1, _ClientGone())))
    deltas: Dict[Tuple[int, int], _Delta] = {}
    usage_prompt = 0
    usage_completion: Dict[Tuple[int, int], int] = {}
    seen_prompts = set()
    try:
        for chunk in fmt.opening():
            yield _event(chunk)
        async for i, out in job.outputs():
            if i not in seen_prompts:
                seen_prompts.add(i)
                usage_prompt += len(out.prompt_token_ids)
            for c in out.outputs:
                key = (i, c.index)
                d = deltas.get(key)
                if d is None:
                    d = deltas[key] = _Delta(job.params)
                piece = d.advance(c)
                if piece is None:
                    continue
                usage_completion[key] = len(c.token_ids)
                yield _event(fmt.chunk(i * fmt.n + c.index, piece))
        if fmt.include_usage:
            done = sum(usage_completion.values())
            yield _event(fmt.usage_chunk(usage_prompt, done))
        yield b"data: [DONE]\n\n"
    except _ClientGone:
        logger.info("client went away; request %s aborted", job.id)
    except PagedKVError as exc:
        # Admission already succeeded; an engine failure mid-stream is reported in-band.
        yield _event(error_body(str(exc), "service_unavailable_error", None, None))
    finally:
        gone.cancel()
        await job.close()


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


# ----------------------------------------------------------------------------- formatting

def _token_text(lp: Any, token_id: int) -> str:
    text = getattr(lp, "decoded_token", None)
    return text if text is not None else f"token_id:{token_id}"


class _CompletionFormat:
    def __init__(self, id_: str, model: str, n: int, logprobs: bool, include_usage: bool) -> None:
        self.id, self.model, self.n = id_, model, n
        self.logprobs = logprobs
        self.include_usage = include_usage
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

    def usage_chunk(self, prompt: int, completion: int) -> Dict[str, Any]:
        return {**self._head(), "choices": [], "usage": _usage(prompt, completion)}

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
        return {**self._head(), "choices": choices, "usage": _usage(prompt, completion)}


class _ChatFormat:
    def __init__(self, id_: str, model: str, n: int, logprobs: bool, top: int,
                 include_usage: bool) -> None:
        self.id, self.model, self.n = id_, model, n
        self.logprobs, self.top = logprobs, top
        self.include_usage = include_usage
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

    def usage_chunk(self, prompt: int, completion: int) -> Dict[str, Any]:
        return {**self._head("chat.completion.chunk"), "choices": [],
                "usage": _usage(prompt, completion)}

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
                "usage": _usage(len(out.prompt_token_ids), completion)}


def _usage(prompt: int, completion: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


# ---------------------------------------------------------------------------------- running

def serve(model: Optional[str], *, host: str = "127.0.0.1", port: int = 8000,
          served_model_name: Optional[str] = None, max_queue_size: Optional[int] = None,
          api_key: Optional[str] = None, chat_template: Optional[str] = None,
          log_level: str = "info", **engine_args: Any) -> None:
    """Builds the engine and serves it until interrupted (``pagedkv serve``)."""
    import os

    import uvicorn

    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise InvalidConfigError(f"port must be an int in [0, 65535], got {port!r}", field="port",
                                 value=port, reason="out of range")
    if chat_template is not None and os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            chat_template = f.read()
    llm = AsyncLLM(model, max_queue_size=max_queue_size, **engine_args)
    name = served_model_name or default_model_name(model)
    # The engine itself warns at start-up when the KV pool, not the model, bounds a sequence.
    app = build_app(llm, served_model_name=name, api_key=api_key, chat_template=chat_template)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        llm.shutdown()


def default_model_name(model: Optional[str]) -> str:
    """The name ``/v1/models`` reports: the model directory's or file's name (without ``.gguf``),
    ``SmolLM2-135M-Instruct`` for the embedded model."""
    import os

    if model is None:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(str(model)))
    return base[:-5] if base.endswith(".gguf") else base
