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
dropped and its event stream resynchronised (it may have restarted); a request that could not be
sent is retried on the next choice, one that reached a replica is never resent (generation is not
idempotent); the response's status, body and stream chunks are the replica's, unchanged, plus an
``x-pagedkv-replica`` header naming it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..events.schema import BlockStored, KVEventBatch
from ..hashing import hash_prompt
from .index import PrefixIndex

__all__ = ["ReplicaSpec", "Router", "build_app", "POLICIES"]

logger = logging.getLogger("pagedkv.router")

POLICIES = ("prefix", "round_robin")


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

    Raises:
        InvalidArgumentError: No replica, a bad policy, block size or hash key.
    """

    def __init__(self, replicas: Sequence[ReplicaSpec], *, block_size: int,
                 hash_seed: Optional[int], tokenizer: Any = None,
                 chat_template: Optional[str] = None, policy: str = "prefix",
                 health_interval_s: float = 1.0, topic: str = "") -> None:
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
        self.index = PrefixIndex()
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
            logger.info("replica %s is up again; re-indexing it", rep.spec.url)
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


def build_app(router: Router) -> Any:
    """The router's FastAPI app; its lifespan starts the subscribers and the health loop."""
    import contextlib
    import json

    state: Dict[str, Any] = {}

    async def health_loop(client: httpx.AsyncClient) -> None:
        while True:
            await router.probe(client)
            await asyncio.sleep(router.health_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=2.0))
        state["client"] = client
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

    app = FastAPI(title="pagedkv router", lifespan=lifespan)

    async def proxy(request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        tokens = await asyncio.to_thread(router.prompt_tokens, path, body)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        order = router.choose(tokens, salt)
        client: httpx.AsyncClient = state["client"]
        headers = _forward_headers(request.headers)
        for attempt, i in enumerate(order):
            rep = router.replicas[i]
            req = client.build_request("POST", rep.spec.url + path, content=raw, headers=headers)
            rep.in_flight += 1
            try:
                resp = await client.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
                rep.in_flight -= 1
                logger.warning("replica %s unreachable (%s); trying the next", rep.spec.url, exc)
                router.mark_down(i)
                router.stats.retries += 1
                continue
            except BaseException:
                rep.in_flight -= 1
                raise
            rep.routed += 1
            out_headers = {"x-pagedkv-replica": rep.spec.url}
            media = resp.headers.get("content-type", "application/json")
            if media.startswith("text/event-stream"):
                async def chunks(resp: httpx.Response = resp, rep: _Replica = rep
                                 ) -> AsyncIterator[bytes]:
                    try:
                        async for chunk in resp.aiter_raw():
                            yield chunk
                    finally:
                        rep.in_flight -= 1
                        await resp.aclose()

                return StreamingResponse(chunks(), status_code=resp.status_code,
                                         media_type=media, headers=out_headers)
            try:
                content = await resp.aread()
            finally:
                rep.in_flight -= 1
                await resp.aclose()
            return Response(content, status_code=resp.status_code, media_type=media,
                            headers=out_headers)
        router.stats.failed += 1
        return JSONResponse({"error": {"message": "no replica could be reached",
                                       "type": "service_unavailable", "code": 503}},
                            status_code=503)

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
        return JSONResponse({"error": {"message": "no replica is up", "code": 503}},
                            status_code=503)

    @app.get("/health")
    async def health() -> Response:
        up = sum(r.up for r in router.replicas)
        return Response(status_code=200 if up else 503)

    @app.get("/router/state")
    async def router_state() -> Dict[str, Any]:
        return {
            "policy": router.policy,
            "replicas": [{"url": r.spec.url, "up": r.up, "in_flight": r.in_flight,
                          "routed": r.routed, "indexed_blocks": router.index.blocks(i),
                          "events": None if r.subscriber is None else {
                              "applied": r.subscriber.tracker.applied_batches,
                              "replays": r.subscriber.tracker.replays,
                              "restarts": r.subscriber.tracker.restarts,
                              "lost_resets": r.subscriber.tracker.lost_resets}}
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


