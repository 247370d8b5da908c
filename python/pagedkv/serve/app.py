"""The OpenAI-compatible HTTP server: a FastAPI app over one :class:`~pagedkv.AsyncLLM`.

Owns :func:`build_app` (the routes, the error mapping, streaming over server-sent events),
:func:`uvicorn_config` (uvicorn with a connection cap and header / body deadlines) and
:func:`serve` (build the engine, run uvicorn). Routes: ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize``,
``POST /detokenize``, ``GET /version``, ``GET /health``, ``GET /metrics`` (Prometheus text: the
KV-cache collector of :mod:`pagedkv.metrics` and the request signals of :mod:`.request_metrics`, on
the same port).

Invariants:

* no request can stall the others: prompts are tokenized and chats rendered on worker threads
  (each with its own copy of the tokenizer), never on the engine thread nor the event loop; the
  engine is handed token ids. Every size a client controls is capped before any work scales with
  it: the body (``max_body_bytes``, 413), a prompt's bytes (``max_prompt_bytes``, derived from
  ``max_model_len``), ``logprobs`` / ``top_logprobs`` (``max_logprobs``), ``n`` (the engine's
  ``max_num_seqs``), stop lists (:data:`MAX_STOP_STRINGS`, :data:`MAX_STOP_BYTES`,
  :data:`MAX_STOP_TOKEN_IDS`); and, under :func:`uvicorn_config`, the connections and the time
  to send a request's head and body (never the time to read an answer);
* every client connection has ``TCP_NODELAY`` (:func:`uvicorn_config`), whoever bound the
  listening socket: a response's pieces are not held for the client's delayed ACK;
* every error response is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
  unknown routes and methods and unparsable bodies included: a bad request (bad value, a field
  that would change the output and is not implemented, a string with a lone surrogate, a prompt
  that cannot fit) is 400, an unknown model or route 404, a wrong method 405, a body over the cap
  413, a missing or wrong API key 401, a full queue (``max_queue_size``) or a stopped engine 503;
  a field the server does not use is accepted and logged once per name;
* every response's ``usage`` carries ``prompt_tokens_details.cached_tokens`` (the prompt tokens
  served from the prefix cache, any tier);
* a request is admitted (or refused with its error) before a streaming response starts, so a
  stream never begins with an error;
* a client that goes away — before its first token, mid-stream, or while a non-streaming request
  runs — has its requests aborted and their KV blocks freed before the engine's next step;
* streamed text is the final text cut into pieces: a piece is sent only once no later output can
  take it back (a partial stop string or an incomplete UTF-8 sequence is held until resolved).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import (Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Set, Tuple,
                    TypeVar, Union)

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_llm import AsyncLLM
from ..engine.outputs import CompletionOutput, RequestOutput
from ..errors import (EngineDeadError, EngineOverloadedError, InvalidArgumentError,
                      InvalidConfigError, OutOfBlocksError, PagedKVError)
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       TokenizeRequest, UnsupportedFieldError, error_body, find_lone_surrogate,
                       sampling_params)
from .request_metrics import RequestMetrics

__all__ = ["build_app", "serve", "uvicorn_config", "ServerState", "DEFAULT_MAX_LOGPROBS",
           "DEFAULT_MAX_CONNECTIONS", "DEFAULT_HEADER_TIMEOUT_S", "DEFAULT_BODY_TIMEOUT_S",
           "DEFAULT_KEEP_ALIVE_S"]

T = TypeVar("T")

#: Most ``logprobs`` (completions) / ``top_logprobs`` (chat) a request may ask for (vLLM's default).
DEFAULT_MAX_LOGPROBS = 20
#: Open client connections beyond which a new one is answered 503 and closed at once.
DEFAULT_MAX_CONNECTIONS = 1024
#: Seconds a client has to send a request's head (request line and headers), from the connection
#: (or the end of the previous response) on.
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: Seconds a client has to send a request's body, once its head arrived.
DEFAULT_BODY_TIMEOUT_S = 30.0
#: Seconds an idle keep-alive connection is kept open.
DEFAULT_KEEP_ALIVE_S = 5
#: A prompt's bytes are capped at ``max_model_len`` times the longest token's bytes, and never
#: fewer than this many bytes per token.
MIN_BYTES_PER_TOKEN = 16
#: Stop lists: at most this many stop strings, of at most this many UTF-8 bytes each, and this
#: many stop token ids (each is checked against every generated token on the engine thread).
MAX_STOP_STRINGS = 64
MAX_STOP_BYTES = 1024
MAX_STOP_TOKEN_IDS = 1024
#: The body cap's floor (``max_body_bytes`` defaults to the larger of this and 2 x the prompt cap).
MIN_BODY_BYTES = 16 << 20

logger = logging.getLogger("pagedkv.serve")

_DONE = object()


class _ClientGone(Exception):
    """The client disconnected while its request ran."""


class ServerState:
    """What the routes share: the engine, its name, the metrics registry, the caps.

    ``max_logprobs``: the most ``logprobs`` / ``top_logprobs`` a request may ask for.
    ``max_prompt_bytes``: the most UTF-8 bytes of one prompt (or one chat's messages), refused
    before tokenizing. ``max_body_bytes``: the most bytes of a request body.
    """

    #: Distinct ignored field names logged at most (a client inventing names cannot grow it).
    MAX_LOGGED_FIELDS = 256

    def __init__(self, llm: AsyncLLM, served_model_name: str, api_key: Optional[str],
                 chat_template: Optional[str], metrics: RequestMetrics, registry: Any, *,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS, max_prompt_bytes: int = 1 << 20,
                 max_body_bytes: int = MIN_BODY_BYTES) -> None:
        self.llm = llm
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.chat_template = chat_template
        self.metrics = metrics
        self.registry = registry
        self.max_logprobs = max_logprobs
        self.max_prompt_bytes = max_prompt_bytes
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self._logged_fields: Set[str] = set()

    def log_ignored(self, names: List[str]) -> None:
        """Logs each ignored field name the first time a request carries it."""
        new = [n for n in names if n not in self._logged_fields]
        if not new or len(self._logged_fields) >= self.MAX_LOGGED_FIELDS:
            return
        self._logged_fields.update(new)
        logger.warning("request fields accepted but not used (logged once per name): %s",
                       ", ".join(ascii(n) for n in new))


class _Tokenizers:
    """Worker threads that tokenize prompts and render chats, each with its own copy of the
    model's tokenizer (a tokenizer is not shared across threads: the engine thread keeps the
    original for detokenizing). ``run(fn, *args)`` calls ``fn(tokenizer, *args)`` on one of them.
    """

    def __init__(self, tokenizer: Any, workers: int) -> None:
        copies: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        for _ in range(workers):
            copies.put(copy.deepcopy(tokenizer))
        self._local = threading.local()

        def take() -> None:
            self._local.tokenizer = copies.get_nowait()

        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedkv-tokenize",
                                        initializer=take)

    def _call(self, fn: Callable[..., T], args: Tuple[Any, ...]) -> T:
        return fn(self._local.tokenizer, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._call, fn, args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _longest_token_bytes(tokenizer: Any, vocab_size: int) -> int:
    """The most UTF-8 bytes of one token's string form (an upper bound of the bytes of text one
    token covers: a byte-level BPE shows a byte as one character of at most 2 bytes, SentencePiece
    a space as 3 bytes); 0 when the tokenizer cannot tell."""
    try:
        tokens = tokenizer.convert_ids_to_tokens(list(range(int(vocab_size))))
        return max((len(t.encode("utf-8", "surrogatepass")) for t in tokens
                    if isinstance(t, str)), default=0)
    except Exception:  # a tokenizer without the method, or one that refuses an id
        return 0


def build_app(llm: AsyncLLM, *, served_model_name: str, api_key: Optional[str] = None,
              chat_template: Optional[str] = None, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
              max_prompt_bytes: Optional[int] = None, max_body_bytes: Optional[int] = None,
              tokenizer_workers: int = 2) -> Any:
    """The FastAPI app serving ``llm`` under the model name ``served_model_name``.

    ``api_key``: when set, every ``/v1`` route needs ``Authorization: Bearer <api_key>``.
    ``chat_template``: a Jinja chat template used instead of the tokenizer's.
    ``max_logprobs``: the most ``logprobs`` (completions) / ``top_logprobs`` (chat) a request may
    ask for; more is a 400.
    ``max_prompt_bytes``: the most UTF-8 bytes of a prompt (of a chat's messages together),
    refused with a 400 before tokenizing. ``None``: ``max_model_len`` times the longest token's
    bytes (at least :data:`MIN_BYTES_PER_TOKEN`), which no prompt that fits can exceed.
    ``max_body_bytes``: the most bytes of a request body (413 above). ``None``: twice the prompt
    cap, at least :data:`MIN_BODY_BYTES`.
    ``tokenizer_workers``: threads tokenizing prompts and rendering chats, each with its own copy
    of the tokenizer; 0 tokenizes on the engine thread between steps (a long prompt then stalls
    every stream: for comparison only).

    Raises:
        InvalidConfigError: A cap that is not a positive int (``max_logprobs`` may be 0), or
            ``tokenizer_workers`` not an int >= 0.
    """
    for field, value, low in (("max_logprobs", max_logprobs, 0),
                              ("max_prompt_bytes", max_prompt_bytes, 1),
                              ("max_body_bytes", max_body_bytes, 1),
                              ("tokenizer_workers", tokenizer_workers, 0)):
        if value is None and field in ("max_prompt_bytes", "max_body_bytes"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidConfigError(f"{field} must be an int >= {low}, got {value!r}",
                                     field=field, value=value, reason=f"must be >= {low}")
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    labels = {"model_name": served_model_name}
    metrics = RequestMetrics(labels=labels)
    llm.observers.append(metrics)
    registry = CollectorRegistry(auto_describe=False)
    engine = llm.engine
    registry.register(engine.metrics_collector(labels=labels))
    registry.register(metrics)
    base_tokenizer = llm.get_tokenizer()
    if max_prompt_bytes is None:
        per_token = max(MIN_BYTES_PER_TOKEN,
                        _longest_token_bytes(base_tokenizer, engine.vocab_size)
                        if base_tokenizer is not None else 0)
        max_prompt_bytes = int(engine.max_model_len) * per_token
    if max_body_bytes is None:
        max_body_bytes = max(MIN_BODY_BYTES, 2 * max_prompt_bytes)
    state = ServerState(llm, served_model_name, api_key, chat_template, metrics, registry,
                        max_logprobs=max_logprobs, max_prompt_bytes=max_prompt_bytes,
                        max_body_bytes=max_body_bytes)
    tokenizers: Optional[_Tokenizers] = None
    if base_tokenizer is not None and tokenizer_workers > 0:
        try:
            tokenizers = _Tokenizers(base_tokenizer, tokenizer_workers)
        except Exception as exc:  # a tokenizer that cannot be copied: the engine thread's
            logger.warning("the tokenizer cannot be copied (%s: %s); prompts are tokenized on "
                           "the engine thread", type(exc).__name__, exc)

    async def on_tokenizer(fn: Callable[..., T], *args: Any) -> T:
        if tokenizers is not None:
            return await tokenizers.run(fn, *args)
        return await llm.call(lambda e: fn(e.tokenizer, *args))

    app = FastAPI(title="pagedkv", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pagedkv = state
    if tokenizers is not None:
        app.router.on_shutdown.append(tokenizers.shutdown)

    def err(status: int, message: str, type_: str, param: Optional[str] = None,
            code: Union[int, str, None] = None) -> JSONResponse:
        return JSONResponse(error_body(message, type_, param, code), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {ascii(request.url.path)[1:-1]}"
            type_, code = "invalid_request_error", "not_found"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {ascii(request.url.path)[1:-1]}"
            type_, code = "invalid_request_error", "method_not_allowed"
        else:
            message, type_, code = str(exc.detail), "invalid_request_error", None
        resp = err(exc.status_code, message, type_, None, code)
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", msg)
            param, msg = None, f"the body is not valid JSON: {reason}"
        # ascii(): a message naming a client's value must stay encodable (lone surrogates).
        text = f"{param}: {msg}" if param else str(msg)
        return err(400, ascii(text)[1:-1] if not text.isascii() else text,
                   "invalid_request_error", param, "invalid_value")

    @app.exception_handler(UnsupportedFieldError)
    async def _unsupported(_request: Request, exc: UnsupportedFieldError) -> JSONResponse:
        return err(400, str(exc), "invalid_request_error", exc.param, "unsupported_parameter")

    @app.exception_handler(InvalidArgumentError)
    async def _invalid(_request: Request, exc: InvalidArgumentError) -> JSONResponse:
        code = getattr(exc, "code", None) or "invalid_value"
        return err(400, str(exc), "invalid_request_error", exc.what, code)

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

    app.add_middleware(_BodyCap, max_body_bytes=max_body_bytes)

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

    def model_card() -> Dict[str, Any]:
        return {"id": state.served_model_name, "object": "model", "created": state.created,
                "owned_by": "pagedkv", "root": engine.model_path,
                "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size}

    @app.get("/v1/models")
    async def models() -> Dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", response_model=None)
    async def model(model_id: str) -> Any:
        return check_model(model_id) or model_card()

    @app.get("/version")
    async def version() -> Dict[str, str]:
        from .. import __version__

        return {"version": str(__version__)}

    def check_request(req: Any) -> None:
        """The checks every route's body gets before any work: lone surrogates, ignored
        fields (logged)."""
        where = find_lone_surrogate(req)
        if where is not None:
            raise InvalidArgumentError(
                f"invalid argument: {where}: the string holds a lone UTF-16 surrogate (not "
                f"encodable as UTF-8)", what=where, value="<string>", reason="lone surrogate")
        ignored = getattr(req, "ignored_fields", None)
        if ignored is not None:
            state.log_ignored(ignored())
        stop = getattr(req, "stop", None)
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        ids = getattr(req, "stop_token_ids", None) or ()
        checks = [("stop", len(stops), MAX_STOP_STRINGS, "stop strings"),
                  ("stop_token_ids", len(ids), MAX_STOP_TOKEN_IDS, "stop token ids")]
        if len(stops) <= MAX_STOP_STRINGS:
            checks.append(("stop", max((len(x.encode("utf-8")) for x in stops), default=0),
                           MAX_STOP_BYTES, "bytes in one stop string"))
        for what, n, limit, unit in checks:
            if n > limit:
                raise InvalidArgumentError(
                    f"invalid argument: {what}: {n} {unit}, more than the server's limit {limit}",
                    what=what, value=f"<{n} {unit}>", reason=f"more than {limit} {unit}")

    def check_bytes(what: str, nbytes: int) -> None:
        if nbytes > state.max_prompt_bytes:
            exc = InvalidArgumentError(
                f"invalid argument: {what} of {nbytes} bytes is longer than max_prompt_bytes = "
                f"{state.max_prompt_bytes} (no text of that size fits max_model_len = "
                f"{engine.max_model_len} tokens)", what=what, value=f"<{nbytes} bytes>",
                reason="longer than max_prompt_bytes")
            exc.code = "context_length_exceeded"  # type: ignore[attr-defined]
            raise exc

    def text_bytes(text: str) -> int:
        # Characters are a lower bound of bytes: a huge string is refused without encoding it.
        return len(text) if len(text) > state.max_prompt_bytes else len(text.encode("utf-8"))

    async def tokenized(prompts: List[Union[str, List[int]]],
                        add_special_tokens: bool = True) -> List[Any]:
        """Each string prompt as ``{"prompt", "prompt_token_ids"}``, tokenized on a worker
        thread; token-id prompts unchanged (the engine checks them)."""
        texts = [p for p in prompts if isinstance(p, str)]
        for t in texts:
            check_bytes("prompt", text_bytes(t))
        if not texts or base_tokenizer is None:
            return list(prompts)  # the engine refuses text without a tokenizer
        ids = await on_tokenizer(_encode_all, texts, add_special_tokens)
        it = iter(ids)
        return [{"prompt": p, "prompt_token_ids": next(it)} if isinstance(p, str) else p
                for p in prompts]

    async def rendered(messages: List[Dict[str, Any]], add_generation_prompt: bool,
                       continue_final_message: bool,
                       kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        check_bytes("messages", sum(text_bytes(str(v)) for m in messages for v in m.values()))
        return await on_tokenizer(_render_chat, messages, state.chat_template,
                                  add_generation_prompt, continue_final_message, kwargs)

    def check_logprobs(what: str, k: Optional[int]) -> None:
        if k is not None and k > state.max_logprobs:
            raise InvalidArgumentError(
                f"invalid argument: {what} = {k}: more than max_logprobs = {state.max_logprobs}",
                what=what, value=k, reason="more than max_logprobs")

    @app.post("/tokenize", response_model=None)
    async def tokenize(req: TokenizeRequest) -> Any:
        bad = check_model(req.model)
        if bad is not None:
            return bad
        check_request(req)
        req.check()
        if req.messages is not None:
            messages = [_message_dict(m) for m in req.messages]
            ids = (await rendered(messages, req.add_generation_prompt,
                                  req.continue_final_message,
                                  req.chat_template_kwargs))["prompt_token_ids"]
        else:
            assert req.prompt is not None
            if base_tokenizer is None:
                raise InvalidArgumentError("invalid argument: prompt: the model has no tokenizer",
                                           what="prompt", value="<text>", reason="no tokenizer")
            check_bytes("prompt", text_bytes(req.prompt))
            ids = (await on_tokenizer(_encode_all, [req.prompt], req.add_special_tokens))[0]
        strs = (await on_tokenizer(_token_strs, ids)) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize", response_model=None)
    async def detokenize(req: DetokenizeRequest) -> Any:
        bad = check_model(req.model)
        if bad is not None:
            return bad
        if base_tokenizer is None:
            raise InvalidArgumentError("invalid argument: tokens: the model has no tokenizer",
                                       what="tokens", value="<ids>", reason="no tokenizer")
        if len(req.tokens) > engine.max_model_len:
            raise InvalidArgumentError(
                f"invalid argument: tokens: {len(req.tokens)} ids, more than max_model_len = "
                f"{engine.max_model_len}", what="tokens", value=f"<{len(req.tokens)} ids>",
                reason="more than max_model_len")
        for t in req.tokens:
            if not 0 <= t < engine.vocab_size:
                raise InvalidArgumentError(
                    f"invalid argument: tokens: id {t} outside the vocabulary "
                    f"[0, {engine.vocab_size})", what="tokens", value=t,
                    reason="outside the vocabulary")
        return {"prompt": await on_tokenizer(_decode, list(req.tokens))}

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        bad = check_model(req.model)
        if bad is not None:
            return bad
        check_request(req)
        req.check()
        check_logprobs("logprobs", req.logprobs)
        params = sampling_params(req, 16 if req.max_tokens is None else req.max_tokens,
                                 req.logprobs)
        prompts = await tokenized(req.prompts(), req.add_special_tokens)
        job = _Job(llm, prompts, params, req.cache_salt, "cmpl")
        return await _respond(job, request, req.stream, _CompletionFormat(
            job.id, state.served_model_name, req.n, req.logprobs is not None,
            _include_usage(req), _continuous_usage(req)), StreamingResponse, JSONResponse)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        bad = check_model(req.model)
        if bad is not None:
            return bad
        check_request(req)
        req.check()
        if req.logprobs:
            check_logprobs("top_logprobs", req.top_logprobs)
        messages = req.messages_as_dicts()
        prompt = await rendered(messages, req.add_generation_prompt, req.continue_final_message,
                                req.chat_template_kwargs)
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
            _include_usage(req), _continuous_usage(req)), StreamingResponse, JSONResponse)

    return app


def _include_usage(req: Union[CompletionRequest, ChatCompletionRequest]) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _continuous_usage(req: Union[CompletionRequest, ChatCompletionRequest]) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage
                and req.stream_options.continuous_usage_stats)


def _message_dict(m: Any) -> Dict[str, Any]:
    d = {"role": m.role, "content": m.text()}
    if m.name:
        d["name"] = m.name
    return d


# These run on a tokenizer worker thread (:class:`_Tokenizers`), with that thread's tokenizer.

def _encode_all(tokenizer: Any, texts: List[str], add_special_tokens: bool) -> List[List[int]]:
    return [list(tokenizer(t, add_special_tokens=add_special_tokens)["input_ids"])
            for t in texts]


def _token_strs(tokenizer: Any, ids: List[int]) -> List[str]:
    return [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]


def _decode(tokenizer: Any, ids: List[int]) -> str:
    return str(tokenizer.decode(ids))


def _render_chat(tokenizer: Any, messages: List[Dict[str, Any]], template: Optional[str],
                 add_generation_prompt: bool, continue_final_message: bool,
                 kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The conversation as a prompt (``{"prompt", "prompt_token_ids"}``), rendered as
    :meth:`pagedkv.LLM.chat` renders it."""
    from ..chat import render_conversations

    return render_conversations(tokenizer, messages, chat_template=template,
                                add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message,
                                chat_template_kwargs=kwargs)[0]


class _BodyCap:
    """ASGI middleware: a request body is read in full before the route runs, and refused with
    413 (OpenAI's error shape, connection closed) once it passes ``max_body_bytes``; a declared
    ``content-length`` over the cap is refused before reading anything."""

    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_body_bytes:
                    await self._refuse(send, declared)
                    return
        chunks: List[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await self._refuse(send, size)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> Any:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, send: Any, size: int) -> None:
        body = json.dumps(error_body(
            f"the request body of {size}+ bytes is larger than max_body_bytes = "
            f"{self.max_body_bytes}", "invalid_request_error", None, "body_too_large")).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


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
    usage_prompt: Dict[int, int] = {}
    usage_cached: Dict[int, int] = {}
    usage_completion: Dict[Tuple[int, int], int] = {}
    try:
        for chunk in fmt.opening():
            yield _event(chunk)
        async for i, out in job.outputs():
            usage_prompt[i] = len(out.prompt_token_ids)
            usage_cached[i] = out.num_cached_tokens
            for c in out.outputs:
                key = (i, c.index)
                d = deltas.get(key)
                if d is None:
                    d = deltas[key] = _Delta(job.params)
                usage_completion[key] = len(c.token_ids)
                piece = d.advance(c)
                if piece is None:
                    continue
                chunk = fmt.chunk(i * fmt.n + c.index, piece)
                if fmt.continuous_usage:
                    chunk["usage"] = _usage(sum(usage_prompt.values()),
                                            sum(usage_completion.values()),
                                            sum(usage_cached.values()))
                yield _event(chunk)
        if fmt.include_usage:
            yield _event(fmt.usage_chunk(sum(usage_prompt.values()),
                                         sum(usage_completion.values()),
                                         sum(usage_cached.values())))
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


# ---------------------------------------------------------------------------------- running

def _protocol_class(max_connections: int, header_timeout_s: float,
                    body_timeout_s: float) -> Any:
    """uvicorn's h11 protocol with a connection cap and deadlines for a request's head and body.

    A connection beyond ``max_connections`` open ones is answered 503 and closed at once. From the
    connection (and again from the end of each response) the client has ``header_timeout_s`` to
    complete a request's head, then ``body_timeout_s`` to complete its body; past either, it gets
    408 (if nothing was answered yet) and the connection is closed (a route still reading sees a
    disconnect). A response being sent has no deadline: a stream lasts as long as it runs.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    def refuse(transport: Any, status: bytes) -> None:
        if not transport.is_closing():
            transport.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\n"
                            b"connection: close\r\n\r\n")
            transport.close()

    class BoundedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._deadline: Optional[asyncio.TimerHandle] = None
            self._phase: Optional[str] = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            # asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP; one bound by
            # the caller as socket.socket() (proto 0) would hold a response's body until the
            # client's delayed ACK of its head (~40 ms on Linux).
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:  # pragma: no cover - not TCP after all
                    pass
            if len(self.connections) > max_connections:
                logger.warning("%d connections open (max_connections %d): one refused",
                               len(self.connections), max_connections)
                refuse(transport, b"503 Service Unavailable")
                return
            self._arm("head")

        def _arm(self, phase: str) -> None:
            self._disarm()
            self._phase = phase
            delay = header_timeout_s if phase == "head" else body_timeout_s
            self._deadline = self.loop.call_later(delay, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = None
            self._phase = None

        def _track(self) -> None:
            if self.transport is None or self.transport.is_closing():
                self._disarm()
                return
            theirs = self.conn.their_state
            if self._phase == "head" and theirs is not h11.IDLE:
                if theirs is h11.SEND_BODY:
                    self._arm("body")
                else:
                    self._disarm()
            elif self._phase == "body" and theirs is not h11.SEND_BODY:
                self._disarm()

        def _expired(self) -> None:
            phase = self._phase
            self._deadline = None
            self._phase = None
            if self.transport.is_closing():
                return
            logger.info("a client did not send its request's %s in time; connection closed",
                        phase)
            if phase == "body" and self.cycle is not None and self.cycle.response_started:
                self.transport.close()  # an answer is under way: no second status line
            else:
                refuse(self.transport, b"408 Request Timeout")

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm("head")
            self._track()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

    return BoundedH11Protocol


def uvicorn_config(app: Any, *, host: str = "127.0.0.1", port: int = 8000,
                   log_level: str = "info", max_connections: int = DEFAULT_MAX_CONNECTIONS,
                   header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                   body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                   keep_alive_s: int = DEFAULT_KEEP_ALIVE_S, **config: Any) -> Any:
    """A ``uvicorn.Config`` serving ``app`` with the slow-client bounds of :func:`_protocol_class`
    (``max_connections``, ``header_timeout_s``, ``body_timeout_s``; and ``TCP_NODELAY`` on every
    connection, which asyncio sets only on sockets it created), ``keep_alive_s`` as uvicorn's
    ``timeout_keep_alive``, and uvicorn's ``limit_concurrency`` above the connection cap (its 503
    for too many running requests). ``config``: more ``uvicorn.Config`` keywords.

    Raises:
        InvalidConfigError: ``max_connections`` or ``keep_alive_s`` not an int >= 1, or a
            timeout not a positive number.
    """
    import uvicorn

    for field, value in (("max_connections", max_connections), ("keep_alive_s", keep_alive_s)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidConfigError(f"{field} must be an int >= 1, got {value!r}", field=field,
                                     value=value, reason="must be >= 1")
    for field, t in (("header_timeout_s", header_timeout_s), ("body_timeout_s", body_timeout_s)):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise InvalidConfigError(f"{field} must be a positive number of seconds, got {t!r}",
                                     field=field, value=t, reason="must be > 0")
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level,
        http=_protocol_class(max_connections, float(header_timeout_s), float(body_timeout_s)),
        limit_concurrency=max_connections + 1, timeout_keep_alive=keep_alive_s, **config)


def _fd_bounded(max_connections: int) -> int:
    """``max_connections`` lowered to what the process's open-file limit leaves (64 kept back
    for the engine, logs and the model), with a warning when it had to be."""
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        return max_connections
    if soft != resource.RLIM_INFINITY and soft - 64 < max_connections:
        bounded = max(1, soft - 64)
        logger.warning("max_connections %d lowered to %d: the open-file limit is %d (ulimit -n)",
                       max_connections, bounded, soft)
        return bounded
    return max_connections


def serve(model: Optional[str], *, host: str = "127.0.0.1", port: int = 8000,
          served_model_name: Optional[str] = None, max_queue_size: Optional[int] = None,
          api_key: Optional[str] = None, chat_template: Optional[str] = None,
          log_level: str = "info", engine_config: Any = None,
          max_model_len: Optional[int] = None, tokenizer: Optional[str] = None,
          max_logprobs: int = DEFAULT_MAX_LOGPROBS, max_prompt_bytes: Optional[int] = None,
          max_connections: int = DEFAULT_MAX_CONNECTIONS,
          header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
          body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
          keep_alive_s: int = DEFAULT_KEEP_ALIVE_S, **engine_args: Any) -> None:
    """Binds ``host:port``, builds the engine, and serves it until interrupted (``pagedkv serve``).

    The port is bound before the model loads (a port in use fails at once, with
    :class:`~pagedkv.errors.InvalidConfigError`), and the bound socket is handed to uvicorn.
    The engine's settings are ``engine_config`` (an :class:`~pagedkv.engine.config.EngineConfig`)
    or ``engine_args`` (its fields, plus ``device`` and ``dtype``), not both;
    ``max_model_len`` and ``tokenizer`` as for :func:`pagedkv.serve.launch.build_async_llm`.
    ``max_logprobs``, ``max_prompt_bytes``: as for :func:`build_app`; ``max_connections``
    (lowered to what the open-file limit allows), ``header_timeout_s``, ``body_timeout_s``,
    ``keep_alive_s``: as for :func:`uvicorn_config`.
    """
    import os

    import uvicorn

    from ..engine.config import EngineConfig
    from .launch import bind_socket, build_async_llm

    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise InvalidConfigError(f"port must be an int in [0, 65535], got {port!r}", field="port",
                                 value=port, reason="out of range")
    device, dtype = engine_args.pop("device", None), engine_args.pop("dtype", None)
    if engine_config is not None and engine_args:
        raise InvalidConfigError(f"give engine_config or its fields, not both (got "
                                 f"{', '.join(sorted(engine_args))})", field="engine_config",
                                 value=sorted(engine_args), reason="exclusive")
    config = engine_config if engine_config is not None else EngineConfig(**engine_args)
    if chat_template is not None and os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            chat_template = f.read()
    sock = bind_socket(host, port)
    try:
        bound = sock.getsockname()[1]
        logger.info("bound %s:%d; loading the model", host, bound)
        llm = build_async_llm(model, config=config, max_queue_size=max_queue_size,
                              device=device, dtype=dtype, max_model_len=max_model_len,
                              tokenizer=tokenizer)
        try:
            name = served_model_name or default_model_name(model)
            # The engine itself warns at start-up when the KV pool, not the model, bounds a
            # sequence.
            app = build_app(llm, served_model_name=name, api_key=api_key,
                            chat_template=chat_template, max_logprobs=max_logprobs,
                            max_prompt_bytes=max_prompt_bytes)
            server = uvicorn.Server(uvicorn_config(
                app, host=host, port=bound, log_level=log_level,
                max_connections=_fd_bounded(max_connections), header_timeout_s=header_timeout_s,
                body_timeout_s=body_timeout_s, keep_alive_s=keep_alive_s))
            # uvicorn names the address only when it binds it itself.
            logger.info("serving on http://%s:%d (Ctrl+C to quit)",
                        f"[{host}]" if ":" in host else host, bound)
            server.run(sockets=[sock])
        finally:
            llm.shutdown()
    finally:
        sock.close()


def default_model_name(model: Optional[str]) -> str:
    """The name ``/v1/models`` reports: the model directory's or file's name (without ``.gguf``),
    ``SmolLM2-135M-Instruct`` for the embedded model."""
    import os

    if model is None:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(str(model)))
    return base[:-5] if base.endswith(".gguf") else base
