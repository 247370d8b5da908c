"""The reference prefix-aware router: OpenAI requests to the replica that caches their prefix.

Owns :class:`Router` (replicas, their event subscribers, health, the choice) and
:func:`build_app` (the FastAPI front: ``/v1/completions``, ``/v1/chat/completions``, streaming
proxied chunk by chunk, ``/v1/models``, ``/health``, ``/metrics``, ``/router/state``).

How a request is placed (``docs/router.md``): the router tokenizes the prompt as the replicas do
(the model's tokenizer; for chat its chat template, as :mod:`pagedkv.chat`), computes the
prompt's block hashes with the fleet's hash key and the request's ``cache_salt``
(:func:`pagedkv.hash_prompt`), and sends it to the up replica whose published cache holds the
longest prefix of them, ties broken by load (the router's own count of requests in flight to
each), else to the least loaded. ``policy="round_robin"`` ignores the index (the baseline).

Invariants: only up replicas are chosen while one is up; a replica is marked down when a request
or a health probe cannot reach it, and up again when a probe answers, at which point its index is
dropped and its event stream resynchronised (it may have restarted); a request is retried on the
next choice only when its connection could not be opened (nothing was sent): once a byte of it
left, it is never resent (generation is not idempotent), and a replica that then fails answers
502; a client that goes away closes the request to the replica (which then stops generating);
the response's status, body and stream chunks are the replica's, unchanged, plus an
``x-pagedkv-replica`` header naming it; every error the router makes itself (a body that does not
parse, an unknown route or method, no replica reachable, a replica failing mid-request) is
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; placement (tokenizing,
hashing, the index lookup) runs off the event loop. Health probes log at debug only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import (Any, AsyncIterator, Awaitable, Dict, List, Optional, Sequence, TypeVar,
                    Union)

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..events.schema import BlockStored, KVEventBatch
from ..hashing import hash_prompt
from .index import DEFAULT_MAX_BYTES_PER_REPLICA, PrefixIndex

__all__ = ["ReplicaSpec", "Router", "build_app", "POLICIES"]

logger = logging.getLogger("pagedkv.router")

POLICIES = ("prefix", "round_robin")
T = TypeVar("T")


def _bad(what: str, value: object, reason: str) -> Exception:
    from ..errors import InvalidArgumentError

    return InvalidArgumentError(f"invalid argument: {what} = {value!r}: {reason}", what=what,
                                value=value, reason=reason)


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica: its HTTP base URL, and the ZeroMQ endpoints of its KV events (optional)."""

    url: str
    events: Optional[str] = None
    replay: Optional[str] = None


@dataclass
class _Replica:
    spec: ReplicaSpec
    up: bool = True
    in_flight: int = 0
    routed: int = 0
    subscriber: Any = None
    block_size_seen: Optional[int] = None


@dataclass
class RouterStats:
    """Counters of the requests placed."""

    requests: int = 0
    #: Requests whose prompt was hashed (a tokenizer and a prompt it could read).
    hashed: int = 0
    #: Prompt blocks looked up, and how many of them the chosen replica was known to hold.
    prompt_blocks: int = 0
    matched_blocks: int = 0
    retries: int = 0
    failed: int = 0
    extra: Dict[str, int] = field(default_factory=dict)


class Router:
    """Places requests on replicas by their published caches (see the module doc).

    Args:
        replicas: The replicas, in order (their index is their id in :attr:`index`).
        block_size: The replicas' block size (all alike).
        hash_seed: The replicas' hash key (``pagedkv serve --hash-seed``); ``None`` with
            ``policy="round_robin"`` only.
        tokenizer: The model's tokenizer (``None``: only token-id prompts are hashed).
        chat_template: The chat template the replicas use, if not the tokenizer's.
        policy: ``"prefix"`` (cache-aware) or ``"round_robin"``.
        health_interval_s: Seconds between health probes of every replica.
        topic: The event topic to subscribe to.
        index_max_bytes: The index's bound per replica, in bytes (:class:`PrefixIndex`).
        index_ttl_s: Time-to-live of index entries by tier (None: the index's default, which
            ages out ``"STORAGE"`` entries, whose removals a shared tier cannot report).

    Raises:
        InvalidArgumentError: No replica, a bad policy, block size or hash key.
    """

    def __init__(self, replicas: Sequence[ReplicaSpec], *, block_size: int,
                 hash_seed: Optional[int], tokenizer: Any = None,
                 chat_template: Optional[str] = None, policy: str = "prefix",
                 health_interval_s: float = 1.0, topic: str = "",
                 index_max_bytes: int = DEFAULT_MAX_BYTES_PER_REPLICA,
                 index_ttl_s: Optional[Dict[str, Optional[float]]] = None) -> None:
        if not replicas:
            raise _bad("replicas", list(replicas), "at least one replica is needed")
        if policy not in POLICIES:
            raise _bad("policy", policy, f"must be one of {', '.join(POLICIES)}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise _bad("block_size", block_size, "must be an int >= 1")
        if policy == "prefix" and hash_seed is None:
            raise _bad("hash_seed", None, "the prefix policy needs the replicas' hash key")
        self.replicas = [_Replica(spec) for spec in replicas]
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.policy = policy
        self.health_interval_s = health_interval_s
        self.topic = topic
        self.index = PrefixIndex(index_max_bytes, ttl_s=index_ttl_s)
        self.stats = RouterStats()
        self._rr = itertools.count()
        self._tok_lock = threading.Lock()
        self._started = False

    # --------------------------------------------------------------------------- events

    def start(self) -> None:
        """Subscribes to every replica's events. Idempotent."""
        if self._started:
            return
        from ..events.subscriber import EventSubscriber

        self._started = True
        for i, rep in enumerate(self.replicas):
            if rep.spec.events is None:
                continue
            rep.subscriber = EventSubscriber(
                rep.spec.events, rep.spec.replay, topic=self.topic,
                on_batch=lambda batch, i=i: self._on_batch(i, batch),
                on_reset=lambda i=i: self.index.clear(i))

    def close(self) -> None:
        """Closes the subscribers."""
        for rep in self.replicas:
            if rep.subscriber is not None:
                rep.subscriber.close()
                rep.subscriber = None
        self._started = False

    def _on_batch(self, i: int, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored) and event.block_size != self.block_size:
                if self.replicas[i].block_size_seen != event.block_size:
                    logger.warning("replica %s publishes block size %d, the router hashes %d: "
                                   "its blocks will never match", self.replicas[i].spec.url,
                                   event.block_size, self.block_size)
                self.replicas[i].block_size_seen = event.block_size
        self.index.apply(i, batch)

    # --------------------------------------------------------------------------- health

    def mark_down(self, i: int) -> None:
        rep = self.replicas[i]
        if rep.up:
            logger.warning("replica %s is down", rep.spec.url)
        rep.up = False

    def mark_up(self, i: int) -> None:
        rep = self.replicas[i]
        if not rep.up:
            logger.warning("replica %s is up again; re-indexing it", rep.spec.url)
            # It may have restarted unseen: what it cached before is gone or unknown.
            self.index.clear(i)
            if rep.subscriber is not None:
                rep.subscriber.resync()
        rep.up = True

    async def probe(self, client: Any) -> None:
        """One health probe of every replica (GET /health), marking each up or down."""
        async def one(i: int) -> None:
            try:
                r = await client.get(self.replicas[i].spec.url + "/health", timeout=2.0)
                ok = r.status_code == 200
            except Exception:
                ok = False
            (self.mark_up if ok else self.mark_down)(i)

        await asyncio.gather(*(one(i) for i in range(len(self.replicas))))

    # --------------------------------------------------------------------------- placement

    def prompt_tokens(self, path: str, body: Dict[str, Any]) -> Optional[List[int]]:
        """The token ids the replica will see for this request, or None when the router cannot
        tell (no tokenizer, an unreadable prompt: the replica reports any error)."""
        try:
            if path.endswith("/chat/completions"):
                if self.tokenizer is None:
                    return None
                from ..chat import render_conversations

                with self._tok_lock:
                    rendered = render_conversations(
                        self.tokenizer, body.get("messages"),
                        chat_template=self.chat_template,
                        add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                        continue_final_message=bool(body.get("continue_final_message", False)),
                        chat_template_kwargs=body.get("chat_template_kwargs"))
                return list(rendered[0]["prompt_token_ids"])
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # several prompts: the first decides
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    return None
                with self._tok_lock:
                    return list(self.tokenizer(prompt)["input_ids"])
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return list(prompt)
        except Exception as exc:
            logger.debug("cannot tokenize a request: %s", exc)
        return None

    def place(self, path: str, body: Dict[str, Any]) -> List[int]:
        """:meth:`choose` for a request body (its tokens and salt); blocking, so the app calls
        it off the event loop."""
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        return self.choose(self.prompt_tokens(path, body), salt)

    def choose(self, tokens: Optional[List[int]], salt: Optional[str]) -> List[int]:
        """Replica ids in the order to try them: the best first, then the others by load."""
        up = [i for i, r in enumerate(self.replicas) if r.up]
        pool = up or list(range(len(self.replicas)))  # all down: try anyway
        self.stats.requests += 1
        if self.policy == "round_robin":
            start = next(self._rr)
            n = len(pool)
            return [pool[(start + k) % n] for k in range(n)]
        matched: Dict[int, int] = {}
        if tokens is not None and self.hash_seed is not None:
            try:
                hashes = hash_prompt(tokens, self.block_size, self.hash_seed, salt or None)
            except ValueError:
                hashes = []
            # The replica computes at least the last token: a whole-prompt hit counts one less.
            usable = (len(tokens) - 1) // self.block_size
            hashes = hashes[:usable]
            self.stats.hashed += 1
            self.stats.prompt_blocks += len(hashes)
            matched = self.index.match(hashes)
        order = sorted(pool, key=lambda i: (-matched.get(i, 0), self.replicas[i].in_flight,
                                            self.replicas[i].routed, i))
        self.stats.matched_blocks += matched.get(order[0], 0)
        return order


def _forward_headers(headers: Any) -> Dict[str, str]:
    keep = ("authorization", "content-type", "accept", "x-request-id")
    return {k: v for k, v in headers.items() if k.lower() in keep}


def error_body(message: str, type_: str, param: Optional[str] = None,
               code: Union[int, str, None] = None) -> Dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error(status: int, message: str, type_: str, param: Optional[str] = None,
           code: Union[int, str, None] = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


class _ClientGone(Exception):
    """The client disconnected before the replica's answer was complete."""


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (``http.disconnect``); the body was read already."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_gone(watcher: "asyncio.Future[None]", aw: Awaitable[T]) -> T:
    """``await aw``, unless the client goes first: then ``aw`` is cancelled and
    :class:`_ClientGone` raised."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise _ClientGone


class _HealthLogFilter(logging.Filter):
    """Keeps httpx's per-request INFO line off the log for the router's health probes (they are
    logged at debug on ``pagedkv.router``); every other request's line passes."""

    def __init__(self, urls: Sequence[str]) -> None:
        super().__init__()
        self.urls = {u + "/health" for u in urls}

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) >= 2 and str(args[1]) in self.urls:
            logger.debug("health probe: %s", record.getMessage())
            return False
        return True


def build_app(router: Router) -> Any:
    """The router's FastAPI app; its lifespan starts the subscribers and the health loop."""
    import json

    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    state: Dict[str, Any] = {}

    async def health_loop(client: httpx.AsyncClient) -> None:
        while True:
            await router.probe(client)
            await asyncio.sleep(router.health_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=2.0))
        state["client"] = client
        quiet = _HealthLogFilter([r.spec.url for r in router.replicas])
        logging.getLogger("httpx").addFilter(quiet)
        router.start()
        task = asyncio.create_task(health_loop(client))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            router.close()
            await client.aclose()
            logging.getLogger("httpx").removeFilter(quiet)

    app = FastAPI(title="pagedkv router", lifespan=lifespan)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "api_error")
        return JSONResponse(error_body(str(exc.detail), kind, None, exc.status_code),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, f"invalid request: {exc.errors()[:1]}", "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("router: a request failed")
        return _error(500, f"the router failed: {type(exc).__name__}", "api_error")

    def parse_body(raw: bytes) -> Union[Dict[str, Any], JSONResponse]:
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except RecursionError:
            return _error(400, "the request body is nested deeper than the JSON parser allows",
                          "invalid_request_error", None, "invalid_json")
        except ValueError as exc:
            return _error(400, f"the request body is not JSON: {exc}", "invalid_request_error",
                          None, "invalid_json")
        if not isinstance(body, dict):
            return _error(400, f"the request body must be a JSON object, not "
                               f"{type(body).__name__}", "invalid_request_error", None,
                          "invalid_json")
        return body

    async def proxy(request: Request, path: str) -> Response:
        raw = await request.body()
        body = parse_body(raw)
        if isinstance(body, JSONResponse):
            return body
        order = await asyncio.to_thread(router.place, path, body)
        client: httpx.AsyncClient = state["client"]
        headers = _forward_headers(request.headers)
        watcher = asyncio.ensure_future(_disconnected(request))
        handed_off = False
        try:
            for i in order:
                rep = router.replicas[i]
                req = client.build_request("POST", rep.spec.url + path, content=raw,
                                           headers=headers)
                rep.in_flight += 1
                try:
                    resp = await _unless_gone(watcher, client.send(req, stream=True))
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    # The connection never opened: nothing of the request left, it may go on.
                    rep.in_flight -= 1
                    logger.warning("replica %s unreachable (%s); trying the next", rep.spec.url,
                                   exc)
                    router.mark_down(i)
                    router.stats.retries += 1
                    continue
                except _ClientGone:
                    rep.in_flight -= 1
                    return Response(status_code=499)
                except httpx.HTTPError as exc:
                    # The request (or part of it) reached the replica: never resent.
                    rep.in_flight -= 1
                    router.stats.failed += 1
                    logger.warning("replica %s failed after the request was sent (%s); not "
                                   "resent", rep.spec.url, exc)
                    return _error(502, f"the replica failed after the request was sent "
                                       f"({type(exc).__name__}); it is not resent, since "
                                       f"generation is not idempotent", "api_error", None,
                                  "replica_failed")
                except BaseException:
                    rep.in_flight -= 1
                    raise
                rep.routed += 1
                out_headers = {"x-pagedkv-replica": rep.spec.url}
                media = resp.headers.get("content-type", "application/json")
                if media.startswith("text/event-stream"):
                    handed_off = True
                    return StreamingResponse(
                        _stream(resp, rep, watcher), status_code=resp.status_code,
                        media_type=media, headers=out_headers)
                try:
                    content = await _unless_gone(watcher, resp.aread())
                except _ClientGone:
                    return Response(status_code=499)
                except httpx.HTTPError as exc:
                    router.stats.failed += 1
                    return _error(502, f"the replica failed mid-answer ({type(exc).__name__})",
                                  "api_error", None, "replica_failed")
                finally:
                    rep.in_flight -= 1
                    await resp.aclose()
                return Response(content, status_code=resp.status_code, media_type=media,
                                headers=out_headers)
        finally:
            if not handed_off:
                watcher.cancel()
        router.stats.failed += 1
        return _error(503, "no replica could be reached", "service_unavailable_error", None,
                      "no_replica")

    async def _stream(resp: httpx.Response, rep: _Replica,
                      watcher: "asyncio.Future[None]") -> AsyncIterator[bytes]:
        """The replica's chunks, until it ends or the client goes (then the upstream request is
        closed, which the replica sees as its client gone)."""
        try:
            chunks = resp.aiter_raw().__aiter__()
            while True:
                try:
                    chunk = await _unless_gone(watcher, chunks.__anext__())
                except (StopAsyncIteration, _ClientGone):
                    return
                except httpx.HTTPError as exc:
                    logger.warning("replica %s failed mid-stream (%s)", rep.spec.url, exc)
                    return
                yield chunk
        finally:
            watcher.cancel()
            rep.in_flight -= 1
            await resp.aclose()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        client: httpx.AsyncClient = state["client"]
        for i, rep in enumerate(router.replicas):
            if not rep.up:
                continue
            try:
                r = await client.get(rep.spec.url + "/v1/models",
                                     headers=_forward_headers(request.headers))
            except httpx.HTTPError:
                router.mark_down(i)
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        return _error(503, "no replica is up", "service_unavailable_error", None, "no_replica")

    @app.get("/health")
    async def health() -> Response:
        up = sum(r.up for r in router.replicas)
        return Response(status_code=200 if up else 503)

    @app.get("/router/state")
    async def router_state() -> Dict[str, Any]:
        index = router.index
        return {
            "policy": router.policy,
            "replicas": [{"url": r.spec.url, "up": r.up, "in_flight": r.in_flight,
                          "routed": r.routed, "indexed_blocks": index.blocks(i),
                          "indexed_entries": index.entries(i),
                          "evicted_entries": index.evicted.get(i, 0),
                          "expired_entries": index.expired.get(i, 0),
                          "events": None if r.subscriber is None else {
                              "applied": r.subscriber.tracker.applied_batches,
                              "replays": r.subscriber.tracker.replays,
                              "restarts": r.subscriber.tracker.restarts,
                              "lost_resets": r.subscriber.tracker.lost_resets,
                              "oversized_replays": r.subscriber.oversized_replays}}
                         for i, r in enumerate(router.replicas)],
            "stats": {k: v for k, v in vars(router.stats).items() if k != "extra"},
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        lines = []
        s = router.stats
        for name, value in (("requests", s.requests), ("hashed_requests", s.hashed),
                            ("prompt_blocks", s.prompt_blocks),
                            ("matched_blocks", s.matched_blocks), ("retries", s.retries),
                            ("failed_requests", s.failed)):
            lines.append(f"# TYPE pagedkv_router_{name}_total counter")
            lines.append(f"pagedkv_router_{name}_total {value}")
        for name, get in (("replica_up", lambda i, r: int(r.up)),
                          ("replica_in_flight", lambda i, r: r.in_flight),
                          ("replica_indexed_blocks", lambda i, r: router.index.blocks(i))):
            lines.append(f"# TYPE pagedkv_router_{name} gauge")
            for i, r in enumerate(router.replicas):
                lines.append(f'pagedkv_router_{name}{{replica="{r.spec.url}"}} {get(i, r)}')
        return PlainTextResponse("\n".join(lines) + "\n",
                                 media_type="text/plain; version=0.0.4")

    return app


def load_tokenizer(model: str) -> Any:
    """The tokenizer of a Hugging Face model directory or a ``.gguf`` file, loaded offline.

    Raises:
        ModelLoadError: It cannot be loaded.
    """
    import os

    from transformers import AutoTokenizer

    from ..errors import ModelLoadError

    kwargs: Dict[str, Any] = {"local_files_only": True}
    directory = model
    if model.endswith(".gguf"):
        directory, kwargs["gguf_file"] = os.path.split(os.path.abspath(model))
    try:
        return AutoTokenizer.from_pretrained(directory, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"{model}: cannot load the tokenizer: {exc}", path=model,
                             reason=type(exc).__name__) from None


def run(replicas: Sequence[ReplicaSpec], *, host: str, port: int, log_level: str = "info",
        **router_args: Any) -> None:
    """Builds the router and serves it with uvicorn until interrupted."""
    import uvicorn

    router = Router(replicas, **router_args)
    uvicorn.run(build_app(router), host=host, port=port, log_level=log_level)


