"""The OpenAI-compatible HTTP server: a FastAPI app over one :class:`~pagedkv.AsyncLLM`.

Owns :func:`build_app` (the routes, the error mapping, the checks of each request's caps),
:class:`ServerState` (what the routes share) and :func:`serve` (build the engine, run uvicorn).
The server's other concerns live beside it, and what callers import is re-exported here:
:mod:`.limits` (the caps' defaults, the body cap, :func:`uvicorn_config`: uvicorn with a
connection cap and header / body deadlines), :mod:`.tokenizing` (the tokenizer worker threads),
:mod:`.jobs` (a request's engine requests, streaming over server-sent events, disconnects) and
:mod:`.formats` (the completion / chat response and chunk shapes, ``usage``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize``, ``GET /version``,
``GET /health``, ``GET /metrics`` (Prometheus text: the KV-cache collector of
:mod:`pagedkv.metrics` and the request signals of :mod:`.request_metrics`, on the same port).

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

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Set, TypeVar, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_llm import AsyncLLM
from ..errors import (EngineDeadError, EngineOverloadedError, InvalidArgumentError,
                      InvalidConfigError, OutOfBlocksError, PagedKVError)
from .formats import _ChatFormat, _CompletionFormat, _continuous_usage, _include_usage
from .jobs import _Job, _respond
from .limits import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_KEEP_ALIVE_S,
                     DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_LOGPROBS, MAX_STOP_BYTES,
                     MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MIN_BODY_BYTES, MIN_BYTES_PER_TOKEN,
                     _BodyCap, _fd_bounded, _longest_token_bytes, uvicorn_config)
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       TokenizeRequest, UnsupportedFieldError, error_body, find_lone_surrogate,
                       sampling_params)
from .request_metrics import RequestMetrics
from .tokenizing import _decode, _encode_all, _render_chat, _Tokenizers, _token_strs

__all__ = ["build_app", "serve", "uvicorn_config", "ServerState", "DEFAULT_MAX_LOGPROBS",
           "DEFAULT_MAX_CONNECTIONS", "DEFAULT_HEADER_TIMEOUT_S", "DEFAULT_BODY_TIMEOUT_S",
           "DEFAULT_KEEP_ALIVE_S"]

T = TypeVar("T")

logger = logging.getLogger("pagedkv.serve")


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
    spec = engine.spec_decode_collector(labels=labels)
    if spec is not None:
        registry.register(spec)
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


def _message_dict(m: Any) -> Dict[str, Any]:
    d = {"role": m.role, "content": m.text()}
    if m.name:
        d["name"] = m.name
    return d


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
