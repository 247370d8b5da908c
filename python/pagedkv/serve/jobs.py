"""The request job of the HTTP server: one HTTP request's engine requests, from admission to close.

Owns :class:`_Job` (start: admit every prompt and wait for each one's first output; the pumps
merging the prompts' outputs into one queue; ``outputs``; ``close``), the disconnect watches
(:func:`_wait_disconnect`, :func:`_unless_gone`, :class:`_ClientGone`), :func:`_settle`, and the
two ways a job is answered: :func:`_respond` (one JSON body, or a stream) and :func:`_sse` (the
server-sent events of a stream).

Invariants:

* a request is admitted (or refused with its error) before a streaming response starts, so a
  stream never begins with an error;
* a client that goes away (before its first token, mid-stream, or while a non-streaming request
  runs) has its requests aborted and their KV blocks freed before the engine's next step;
* an engine failure after admission is reported in-band in the stream.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Tuple

from fastapi.responses import Response

from ..engine.async_llm import AsyncLLM
from ..engine.outputs import RequestOutput
from ..errors import PagedKVError
from .formats import _Delta, _event, _usage
from .protocol import error_body

logger = logging.getLogger("pagedkv.serve")

_DONE = object()


class _ClientGone(Exception):
    """The client disconnected while its request ran."""


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
