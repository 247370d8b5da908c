"""The client-facing caps of the HTTP server and the uvicorn it runs under.

Owns the caps' defaults (:data:`DEFAULT_MAX_LOGPROBS`, the stop-list caps, the prompt and body
byte floors, the connection cap and the head / body deadlines), the prompt-byte bound a tokenizer
implies (:func:`_longest_token_bytes`), the body cap (:class:`_BodyCap`, ASGI middleware), and
:func:`uvicorn_config` (uvicorn's h11 protocol with a connection cap, head / body deadlines and
``TCP_NODELAY``, :func:`_protocol_class`), with :func:`_fd_bounded` (the connection cap under the
open-file limit).

Invariants:

* a body over ``max_body_bytes`` is refused with 413 in OpenAI's error shape (connection closed)
  before the route runs; a declared ``content-length`` over the cap before anything is read;
* a connection beyond ``max_connections`` is answered 503 and closed at once; a client slower
  than ``header_timeout_s`` / ``body_timeout_s`` to send a request's head / body gets 408 (if
  nothing was answered yet) and is closed; a response being sent has no deadline;
* every client connection has ``TCP_NODELAY``, whoever bound the listening socket.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any, List, Optional

from ..errors import InvalidConfigError
from .protocol import error_body

__all__ = ["uvicorn_config", "DEFAULT_MAX_LOGPROBS", "DEFAULT_MAX_CONNECTIONS",
           "DEFAULT_HEADER_TIMEOUT_S", "DEFAULT_BODY_TIMEOUT_S", "DEFAULT_KEEP_ALIVE_S",
           "MIN_BYTES_PER_TOKEN", "MAX_STOP_STRINGS", "MAX_STOP_BYTES", "MAX_STOP_TOKEN_IDS",
           "MIN_BODY_BYTES"]

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
