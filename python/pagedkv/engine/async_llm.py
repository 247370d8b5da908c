"""The engine behind asyncio: many concurrent streams, one thread stepping one :class:`LLMEngine`.

Owns :class:`AsyncLLM` (``async for out in llm.generate(prompt, params, request_id=...)``) and the
:class:`RequestObserver` hook through which request-level signals (time to first token, inter-token
latency, end-to-end latency, token counts) are recorded.

Invariants:

* after construction only the engine thread touches the engine: adds, aborts, steps and
  :meth:`AsyncLLM.call` run there one after another, so the engine (not thread-safe) has one caller;
  between two steps the thread applies every command queued meanwhile, in order;
* each request owns one :class:`asyncio.Queue` on the event loop that called ``generate``; the engine
  thread hands outputs to it only through ``loop.call_soon_threadsafe``;
* a stream that ends before its request finished (the consumer was cancelled, the generator closed,
  the HTTP client went away) aborts the request: the abort is applied before the engine runs another
  step, and ``generate`` returns (or re-raises the cancellation) only once it was applied, so the
  request's KV blocks are free by the time the consumer's cancellation completes;
* an error that belongs to one request (a prompt that can never fit the pool) ends that request's
  stream with the typed error; a step failing for any other reason ends every stream with
  :class:`~pagedkv.errors.EngineDeadError`, and no further request is accepted (``errored``);
* with ``max_queue_size``, a request is refused with
  :class:`~pagedkv.errors.EngineOverloadedError` (nothing queued) while that many requests wait for
  their first token.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import uuid
from typing import (TYPE_CHECKING, Any, AsyncIterator, Callable, Dict, List, Optional, Protocol,
                    Set, TypeVar, Union)

from ..errors import EngineDeadError, EngineOverloadedError, InvalidArgumentError, OutOfBlocksError
from .outputs import RequestOutput
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .llm_engine import LLMEngine
    from .request import Prompt
    from .loader import LoadedModel

__all__ = ["AsyncLLM", "RequestObserver"]

T = TypeVar("T")


class RequestObserver(Protocol):
    """Receives request-level events from the engine thread (keep each call cheap).

    Times are seconds. ``on_tokens`` is called once per step in which a request produced tokens
    (``since_last_s`` is the time since its previous step with tokens, ``None`` for its first).
    An observer may also define ``on_cached_tokens(num_cached_tokens, num_prompt_tokens)``: it is
    then called once per request, with its first token, with the prompt tokens the prefix cache
    served (any tier; :attr:`RequestOutput.num_cached_tokens`).
    """

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None: ...

    def on_tokens(self, num_new_tokens: int, since_last_s: Optional[float]) -> None: ...

    def on_finished(self, e2e_s: float, finish_reason: str) -> None: ...


class _Stream:
    """Loop-side end of one request: its queue and the loop that owns it."""

    __slots__ = ("loop", "queue", "waiting", "aborted")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: "asyncio.Queue[Union[RequestOutput, BaseException]]" = asyncio.Queue()
        #: Counted in ``AsyncLLM._num_waiting`` (no first token yet).
        self.waiting = True
        #: Set by :meth:`AsyncLLM.abort`: outputs still queued are dropped.
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True
        self.queue.put_nowait(asyncio.CancelledError())


class _Track:
    """Engine-thread bookkeeping of one request, for the observers."""

    __slots__ = ("arrival", "last", "tokens", "prompt_len", "delta")

    def __init__(self, arrival: float, delta: bool) -> None:
        self.arrival = arrival
        self.last: Optional[float] = None
        self.tokens = 0
        self.prompt_len = 0
        self.delta = delta


_STOP = object()


def _is_delta(params: Optional[SamplingParams]) -> bool:
    kind = getattr(params, "output_kind", None)
    return kind is not None and getattr(kind, "name", str(kind)).upper().endswith("DELTA")


def _resolve(fut: "asyncio.Future[Any]", value: Any = None,
             error: Optional[BaseException] = None) -> None:
    if fut.done():  # the awaiting side was cancelled
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is left to tell
        pass


class AsyncLLM:
    """An :class:`LLMEngine` served to asyncio code, shaped like vLLM's ``AsyncLLM``.

    ``AsyncLLM(model, **engine_args)`` builds the engine (the arguments of :class:`LLMEngine`);
    :meth:`from_engine` wraps one that exists. A daemon thread steps it while any request is
    unfinished and sleeps otherwise.

    Args:
        model: As for :class:`LLMEngine`: a model directory or ``.gguf`` file, a
            :class:`~pagedkv.engine.loader.LoadedModel` built in memory (used as it is, on its own
            device), or ``None`` (the embedded SmolLM2-135M-Instruct).
        max_queue_size: Most requests waiting for their first token; one more is refused with
            :class:`~pagedkv.errors.EngineOverloadedError`. ``None``: no limit.
        observers: :class:`RequestObserver` objects told about every request (see
            :mod:`pagedkv.serve.request_metrics` for the Prometheus one).
        **engine_args: Keywords of :class:`LLMEngine`.

    Example::

        llm = pagedkv.AsyncLLM(num_blocks=256)
        async for out in llm.generate("Hello", pagedkv.SamplingParams(max_tokens=8)):
            print(out.outputs[0].text)
        llm.shutdown()
    """

    def __init__(self, model: Union[str, "LoadedModel", None] = None, *,
                 max_queue_size: Optional[int] = None,
                 observers: Optional[List[RequestObserver]] = None, **engine_args: Any) -> None:
        from .llm_engine import LLMEngine

        self._setup(LLMEngine(model, **engine_args), max_queue_size, observers)

    @classmethod
    def from_engine(cls, engine: "LLMEngine", *, max_queue_size: Optional[int] = None,
                    observers: Optional[List[RequestObserver]] = None) -> "AsyncLLM":
        """Wraps an existing engine; from now on only this object's thread may touch it."""
        self = cls.__new__(cls)
        self._setup(engine, max_queue_size, observers)
        return self

    def _setup(self, engine: "LLMEngine", max_queue_size: Optional[int],
               observers: Optional[List[RequestObserver]]) -> None:
        if max_queue_size is not None and (isinstance(max_queue_size, bool)
                                           or not isinstance(max_queue_size, int)
                                           or max_queue_size < 1):
            raise InvalidArgumentError(
                f"invalid argument: max_queue_size = {max_queue_size!r}: must be an int >= 1 "
                f"or None", what="max_queue_size", value=max_queue_size, reason="must be >= 1")
        self.engine = engine
        self.max_queue_size = max_queue_size
        self.observers: List[RequestObserver] = list(observers or ())
        self._streams: Dict[str, _Stream] = {}
        self._inbox: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        # Guards `_dead` against a submit racing the thread's exit, and the waiting count, which
        # callers raise and the engine thread lowers.
        self._lock = threading.Lock()
        self._dead: Optional[str] = None
        self._num_waiting = 0
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        # Engine-thread state only.
        self._tracks: Dict[str, _Track] = {}
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------------------------- public

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (``None`` if it has none). The engine thread uses it (to
        tokenize string prompts and to detokenize), so another thread must not: tokenize on a
        copy (``copy.deepcopy``; the server keeps one per worker thread) and pass
        ``{"prompt": text, "prompt_token_ids": ids}``, or go through :meth:`call`."""
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (see :attr:`tokenizer`)."""
        return self.engine.tokenizer

    @property
    def errored(self) -> bool:
        """Whether the engine loop has stopped (shut down or failed)."""
        return self._dead is not None

    @property
    def dead_reason(self) -> Optional[str]:
        """Why the engine loop stopped, or ``None`` while it runs."""
        return self._dead

    @property
    def num_waiting(self) -> int:
        """Requests accepted that have not produced their first token yet."""
        return self._num_waiting

    @property
    def num_unfinished(self) -> int:
        """Requests whose streams are open."""
        return len(self._streams)

    async def generate(self, prompt: "Prompt", sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None, *,
                       cache_salt: Union[str, bytes, None] = None) -> AsyncIterator[RequestOutput]:
        """Queues a request and yields its :class:`RequestOutput` after every step that changed it,
        the finished one last (what each output holds follows ``sampling_params.output_kind``).

        Leaving the loop early (``break`` under ``contextlib.aclosing``, cancelling the task, an
        exception) aborts the request; its blocks are free when the cancellation or close returns.
        A generator merely dropped is closed, and its request aborted, once the loop finalizes it.

        Raises:
            InvalidArgumentError: A bad prompt, parameter or salt, or a request id in use.
            OutOfBlocksError: The prompt can never fit the KV pool.
            EngineOverloadedError: ``max_queue_size`` requests already wait.
            EngineDeadError: The engine loop has stopped.
        """
        loop = asyncio.get_running_loop()
        if request_id is None:
            request_id = f"{self._prefix}-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError(
                f"invalid argument: request_id = {request_id!r}: must be a non-empty string",
                what="request_id", value=request_id, reason="must be a non-empty string")
        if request_id in self._streams:
            raise InvalidArgumentError(
                f"invalid argument: request_id = {request_id!r}: already in use by an unfinished "
                f"request", what="request_id", value=request_id, reason="already in use")
        stream = _Stream(loop)
        with self._lock:
            if self.max_queue_size is not None and self._num_waiting >= self.max_queue_size:
                raise EngineOverloadedError(
                    f"{self._num_waiting} requests already wait for their first token "
                    f"(max_queue_size {self.max_queue_size}); retry later",
                    waiting=self._num_waiting, max_queue_size=self.max_queue_size)
            self._num_waiting += 1
        self._streams[request_id] = stream
        added: "asyncio.Future[None]" = loop.create_future()
        arrival = time.perf_counter()
        rid = request_id
        finished = False
        try:
            self._submit(lambda: self._do_add(rid, prompt, sampling_params, cache_salt, arrival,
                                              loop, added),
                         lambda err: _post(loop, _resolve, added, None, err))
            await added
            while True:
                item = await stream.queue.get()
                if stream.aborted:
                    finished = True
                    raise asyncio.CancelledError()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await self._abort_and_wait(rid, loop)
            self._streams.pop(rid, None)
            self._unwait(stream)

    async def abort(self, request_id: str) -> bool:
        """Aborts a request: its stream's next ``__anext__`` raises ``asyncio.CancelledError``
        (outputs not yet taken are dropped). Returns whether it was still unfinished. Its blocks
        are free when this returns."""
        loop = asyncio.get_running_loop()
        done: "asyncio.Future[bool]" = loop.create_future()
        self._submit(lambda: _post(loop, _resolve, done, self._do_abort(request_id, notify=True)),
                     lambda err: _post(loop, _resolve, done, False))
        return await done

    async def call(self, fn: Callable[["LLMEngine"], T]) -> T:
        """Runs ``fn(engine)`` on the engine thread between two steps; returns its result (or
        raises its exception). The way to read engine state that is not thread-safe."""
        loop = asyncio.get_running_loop()
        done: "asyncio.Future[T]" = loop.create_future()

        def run() -> None:
            try:
                value = fn(self.engine)
            except BaseException as exc:  # handed to the caller
                _post(loop, _resolve, done, None, exc)
            else:
                _post(loop, _resolve, done, value)

        self._submit(run, lambda err: _post(loop, _resolve, done, None, err))
        return await done

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the engine thread after its current step (open streams end with
        :class:`~pagedkv.errors.EngineDeadError`) and shuts the engine down. Idempotent."""
        with self._lock:
            if self._dead is None:
                self._inbox.put(_STOP)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self.engine.shutdown()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    # ----------------------------------------------------------------------- caller side

    def _submit(self, cmd: Callable[[], None], on_dead: Callable[[BaseException], None]) -> None:
        """Queues ``cmd`` for the engine thread; should the loop stop first, ``on_dead`` gets the
        error instead (every queued command is answered one way or the other)."""
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine loop has stopped: {self._dead}",
                                      reason=self._dead)
            self._inbox.put((cmd, on_dead))

    async def _abort_and_wait(self, rid: str, loop: asyncio.AbstractEventLoop) -> None:
        done: "asyncio.Future[bool]" = loop.create_future()
        try:
            self._submit(lambda: _post(loop, _resolve, done, self._do_abort(rid, notify=False)),
                         lambda err: _post(loop, _resolve, done, False))
        except EngineDeadError:
            return
        try:
            # Shielded: a second cancellation must not leave the abort half-waited; the abort
            # itself is already queued and happens regardless.
            await asyncio.shield(done)
        except asyncio.CancelledError:
            pass

    def _unwait(self, stream: _Stream) -> None:
        with self._lock:
            if stream.waiting:
                stream.waiting = False
                self._num_waiting -= 1

    # ----------------------------------------------------------------------- engine thread

    def _do_add(self, rid: str, prompt: "Prompt", params: Optional[SamplingParams],
                salt: Union[str, bytes, None], arrival: float, loop: asyncio.AbstractEventLoop,
                added: "asyncio.Future[None]") -> None:
        try:
            self.engine.add_request(rid, prompt, params, cache_salt=salt, arrival_time=arrival)
        except Exception as exc:
            _post(loop, _resolve, added, None, exc)
            return
        self._tracks[rid] = _Track(arrival, _is_delta(params))
        _post(loop, _resolve, added, None)

    def _do_abort(self, rid: str, notify: bool) -> bool:
        live = rid in self.engine._requests
        if live:
            self.engine.abort_request(rid)
            track = self._tracks.pop(rid, None)
            if track is not None:
                for obs in self.observers:
                    obs.on_finished(time.perf_counter() - track.arrival, "abort")
            stream = self._streams.get(rid)
            if notify and stream is not None:
                # Posted before abort() is answered, so the stream is marked when it returns.
                _post(stream.loop, stream.abort)
        return live

    def _run(self) -> None:
        engine = self.engine
        while True:
            cmds: List[Any] = []
            if not engine.has_unfinished_requests():
                cmds.append(self._inbox.get())  # idle: sleep until someone wants something
            while True:
                try:
                    cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for i, cmd in enumerate(cmds):
                if cmd is _STOP:
                    self._die("the engine was shut down", cmds[i + 1:])
                    return
                try:
                    cmd[0]()
                except BaseException as exc:  # each command answers its own errors; not this one
                    self._die(f"a command failed: {type(exc).__name__}: {exc}", cmds[i + 1:])
                    return
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except OutOfBlocksError as exc:
                # The engine dropped the request that can never be scheduled; its stream gets the
                # error, everyone else carries on.
                for rid in [r for r in self._tracks if r not in engine._requests]:
                    self._tracks.pop(rid, None)
                    self._fail(rid, exc)
                continue
            except BaseException as exc:
                self._die(f"a step failed: {type(exc).__name__}: {exc}")
                return
            self._deliver(outputs)

    def _deliver(self, outputs: List[RequestOutput]) -> None:
        now = time.perf_counter()
        by_loop: Dict[asyncio.AbstractEventLoop, List[Any]] = {}
        for out in outputs:
            rid = out.request_id
            stream = self._streams.get(rid)
            track = self._tracks.get(rid)
            if track is not None:
                self._observe(track, out, now)
                if out.finished:
                    del self._tracks[rid]
            if stream is None:
                continue
            if stream.waiting:
                self._unwait(stream)
            by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            _post(loop, _put_all, items)

    def _observe(self, track: _Track, out: RequestOutput, now: float) -> None:
        n = sum(len(c.token_ids) for c in out.outputs)
        new = n if track.delta else n - track.tokens
        track.tokens = track.tokens + n if track.delta else n
        if new > 0:
            if track.last is None:
                first = out.metrics.first_token_time if out.metrics is not None else None
                for obs in self.observers:
                    obs.on_first_token((first if first is not None else now) - track.arrival,
                                       len(out.prompt_token_ids))
                    on_cached = getattr(obs, "on_cached_tokens", None)
                    if on_cached is not None:
                        on_cached(out.num_cached_tokens, len(out.prompt_token_ids))
            for obs in self.observers:
                obs.on_tokens(new, None if track.last is None else now - track.last)
            track.last = now
        if out.finished:
            reasons: Set[str] = {c.finish_reason for c in out.outputs if c.finish_reason}
            reason = "length" if reasons == {"length"} else "stop"
            for obs in self.observers:
                obs.on_finished(now - track.arrival, reason)

    def _fail(self, rid: str, exc: BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            _post(stream.loop, stream.queue.put_nowait, exc)

    def _die(self, reason: str, pending: Optional[List[Any]] = None) -> None:
        with self._lock:
            self._dead = reason
        err = EngineDeadError(f"the engine loop has stopped: {reason}", reason=reason)
        # Commands queued before `_dead` was set still expect an answer; none of them runs.
        pending = list(pending or ())
        while True:
            try:
                pending.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for cmd in pending:
            if cmd is not _STOP:
                cmd[1](err)
        for rid in list(self._streams):
            self._fail(rid, err)


def _put_all(items: List[Any]) -> None:
    for q, out in items:
        q.put_nowait(out)
