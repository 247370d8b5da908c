"""``pagedkv serve`` under hostile or careless clients: nothing one request sends stalls the others.

Real uvicorn on loopback (the ``Server`` of ``tests/test_serve.py``), the real ``openai`` client,
raw sockets for slow clients. Waits are bounded polls, never timed assertions:

* a prompt (or chat) whose tokenization is slow does not hold the engine: a stream already running
  advances while the slow tokenization is in progress (an instrumented tokenizer that blocks until
  the test has seen the stream advance; on the engine thread it would block the stream instead);
* a prompt whose bytes cannot fit ``max_model_len`` is refused before any tokenizer sees it;
* ``logprobs`` / ``top_logprobs`` above ``max_logprobs`` are 400s; lone surrogates anywhere in a
  request are 400s naming the field; a body over ``max_body_bytes`` is a 413;
* connections above the cap are refused at once; clients trickling a request's head or body are
  answered 408 and closed at the deadline; the server still serves afterwards.
"""

from __future__ import annotations

import asyncio
import copy
import select
import socket
import threading
import time
from typing import Any, Dict, List

import pytest

from serve_server import (  # noqa: F401  (fixtures; skips without the serve extras)
    CHAT, NAME, Server, client, httpx, model_dir, openai, server,
)
from polling import wait_for

MARK = "w99 w98 w97"


class _Gate:
    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released_in_time = None
        self.longest_text = 0


class _GatedTokenizer:
    """A tokenizer whose encoding of a text holding ``MARK`` blocks until the gate is released
    (at most 30 s); records the longest text it was asked to encode. Copies share the gate."""

    def __init__(self, inner: Any, gate: _Gate) -> None:
        self._inner = inner
        self._gate = gate

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(text, str):
            self._gate.longest_text = max(self._gate.longest_text, len(text))
            if MARK in text:
                self._gate.entered.set()
                self._gate.released_in_time = self._gate.release.wait(30)
        return self._inner(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_GatedTokenizer":
        return _GatedTokenizer(copy.deepcopy(self._inner, memo), self._gate)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_slow_tokenization_does_not_stall_a_running_stream(model_dir, route):
    gate = _Gate()
    s = Server(model_dir, tokenizer=lambda tok: _GatedTokenizer(tok, gate))
    try:
        chunks: List[int] = []
        stream_done = threading.Event()

        async def stream() -> None:
            body = {"model": NAME, "prompt": "w3 w4 w5", "max_tokens": 240, "ignore_eos": True,
                    "stream": True, "temperature": 0}
            async with httpx.AsyncClient(timeout=60) as c:
                async with c.stream("POST", f"{s.url}/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            chunks.append(1)
            stream_done.set()

        async def slow() -> int:
            while not chunks:
                await asyncio.sleep(0.005)
            async with httpx.AsyncClient(timeout=60) as c:
                if route == "chat":
                    r = await c.post(f"{s.url}/v1/chat/completions", json={
                        "model": NAME, "messages": [{"role": "user", "content": MARK}],
                        "max_tokens": 2})
                else:
                    r = await c.post(f"{s.url}/v1/completions", json={
                        "model": NAME, "prompt": MARK, "max_tokens": 2})
            return r.status_code

        async def watch() -> bool:
            # Once the slow request is inside the tokenizer, the stream must still advance.
            try:
                await asyncio.to_thread(gate.entered.wait, 30)
                assert gate.entered.is_set(), "the slow prompt never reached the tokenizer"
                at_entry = len(chunks)
                deadline = time.monotonic() + 30
                while len(chunks) < at_entry + 3 and not stream_done.is_set():
                    if time.monotonic() > deadline:
                        return False
                    await asyncio.sleep(0.005)
                return True
            finally:
                gate.release.set()

        async def main() -> Any:
            return await asyncio.gather(stream(), slow(), watch())

        _, status, advanced = asyncio.run(asyncio.wait_for(main(), 120))
        assert advanced, "the stream did not advance while a prompt was being tokenized"
        assert gate.released_in_time is True
        assert status == 200
        assert len(chunks) >= 10
        s.wait_idle()
    finally:
        gate.release.set()
        s.stop()


def test_huge_prompt_refused_before_tokenizing(model_dir):
    gate = _Gate()
    s = Server(model_dir, tokenizer=lambda tok: _GatedTokenizer(tok, gate))
    try:
        cap = s.server.config.app.state.pagedkv.max_prompt_bytes
        assert cap == 256 * 16  # max_model_len x the floor of bytes per token ("w127": 4 bytes)
        huge = "w3 " * ((4 << 20) // 3)  # ~4 MiB
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model=NAME, prompt=huge, max_tokens=2)
        body = info.value.body
        assert body["param"] == "prompt" and body["code"] == "context_length_exceeded", body
        assert "max_prompt_bytes" in body["message"]
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": huge}],
                                      max_tokens=2)
        assert info.value.body["param"] == "messages"
        # No tokenizer (the server's copies nor the engine's) ever saw the huge text.
        assert gate.longest_text < len(huge) // 100
        assert gate.longest_text <= cap
        # A prompt under the cap but over the context is still the engine's 400.
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model=NAME, prompt="w3 " * 400, max_tokens=2)
        assert info.value.body["param"] == "prompt"
        assert s.used_blocks() == 0
    finally:
        s.stop()


def test_logprobs_capped(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="w3", max_tokens=2, logprobs=21)
    body = info.value.body
    assert set(body) == {"message", "type", "param", "code"}
    assert body["param"] == "logprobs" and "max_logprobs = 20" in body["message"], body
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2, logprobs=True,
                                       top_logprobs=100)
    assert info.value.body["param"] == "top_logprobs"
    r = client.completions.create(model=NAME, prompt="w3", max_tokens=2, logprobs=20)
    assert all(20 <= len(top) <= 21 for top in r.choices[0].logprobs.top_logprobs)  # + chosen


def test_stop_lists_capped(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="w3", max_tokens=2,
                                  stop=[f"w{i}x" for i in range(65)])
    assert info.value.body["param"] == "stop" and "64" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="w3", max_tokens=2, stop="x" * 1025)
    assert info.value.body["param"] == "stop" and "1024" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="w3", max_tokens=2,
                                  extra_body={"stop_token_ids": [5] * 1025})
    assert info.value.body["param"] == "stop_token_ids"
    r = client.completions.create(model=NAME, prompt="w3", max_tokens=2,
                                  stop=[f"w{i}x" for i in range(64)])
    assert r.choices[0].finish_reason == "length"


def test_max_logprobs_is_a_build_app_parameter(model_dir):
    s = Server(model_dir, app_args={"max_logprobs": 2})
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model=NAME, prompt="w3", max_tokens=2, logprobs=3)
        assert "max_logprobs = 2" in info.value.body["message"]
        c.completions.create(model=NAME, prompt="w3", max_tokens=2, logprobs=2)
    finally:
        s.stop()


def _raw_post(url: str, route: str, text: str) -> httpx.Response:
    """POSTs JSON text as it is (a lone surrogate written as an escape, which the openai client
    cannot send)."""
    return httpx.post(f"{url}/v1/{route}", content=text.encode("ascii"),
                      headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize("route,body,param", [
    ("completions", '{"prompt": "w3 \\ud800 w4", "max_tokens": 2}', "prompt"),
    ("completions", '{"prompt": ["w3", "w4 \\udfff"], "max_tokens": 2}', "prompt.1"),
    ("completions", '{"prompt": "w3", "max_tokens": 2, "cache_salt": "a\\ud83d"}',
     "cache_salt"),
    ("completions", '{"prompt": "w3", "max_tokens": 2, "stop": ["\\ud800"]}', "stop.0"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "w3 \\ud800"}]}',
     "messages.0.content"),
    ("chat/completions", '{"messages": [{"role": "us\\udc00er", "content": "w3"}]}',
     "messages.0.role"),
    ("chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages.0.content.0.text"),
    ("chat/completions",
     '{"messages": [{"role": "user", "content": "w3"}], "cache_salt": "\\ud800"}', "cache_salt"),
])
def test_lone_surrogates_are_400(server, route, body, param):
    r = _raw_post(server.url, route, body)
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert "surrogate" in err["message"]
    assert server.used_blocks() == 0


def test_body_over_the_cap_is_413(model_dir):
    s = Server(model_dir, app_args={"max_body_bytes": 4096})
    try:
        r = httpx.post(f"{s.url}/v1/completions", json={"model": NAME, "prompt": "w3 " * 2000},
                       timeout=60)
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "body_too_large"
        # Without a content-length (chunked), counted as it comes.
        r = httpx.post(f"{s.url}/v1/completions", content=iter([b"{" + b" " * 3000] * 3),
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 413
        ok = httpx.post(f"{s.url}/v1/completions", json={"model": NAME, "prompt": "w3",
                                                          "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200
    finally:
        s.stop()


# ------------------------------------------------------------------------------ slow clients

def _open(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setblocking(False)
    return sock


def _poll_closed(socks: List[socket.socket], trickle: Dict[socket.socket, bytes],
                 timeout: float) -> Dict[socket.socket, bytes]:
    """Sends one byte of each socket's ``trickle`` every 0.1 s until the server closes it (or its
    bytes run out); returns what each socket received, once all are closed (bounded)."""
    got: Dict[socket.socket, bytes] = {s: b"" for s in socks}
    open_ = set(socks)
    deadline = time.monotonic() + timeout
    while open_:
        assert time.monotonic() < deadline, f"{len(open_)} connections still open"
        readable, _, _ = select.select(list(open_), [], [], 0.1)
        for s in readable:
            try:
                data = s.recv(4096)
            except (ConnectionResetError, BlockingIOError):
                data = b""
            if data:
                got[s] += data
                continue
            open_.discard(s)
        for s in list(open_):
            rest = trickle.get(s, b"")
            if rest:
                try:
                    s.send(rest[:1])
                except (BrokenPipeError, ConnectionResetError):
                    open_.discard(s)
                trickle[s] = rest[1:]
    return got


def test_slow_clients_are_closed_and_capped(model_dir):
    limits = {"max_connections": 6, "header_timeout_s": 0.5, "body_timeout_s": 0.5}
    s = Server(model_dir, limits=limits)
    socks: List[socket.socket] = []
    try:
        state = s.server.server_state
        heads = [_open(s.port) for _ in range(3)]
        bodies = [_open(s.port) for _ in range(3)]
        socks += heads + bodies
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        for b in bodies:
            b.sendall(head + b"content-length: 100000\r\n\r\n{")
        wait_for(lambda: len(state.connections) == 6, 10)
        # The cap: more connections are answered 503 and closed at once.
        extra = [_open(s.port) for _ in range(4)]
        socks += extra
        refused = _poll_closed(extra, {}, 10)
        assert all(r.startswith(b"HTTP/1.1 503") for r in refused.values()), refused
        # Trickling a head or a body (a byte each 0.1 s, far more than the deadline allows):
        # each is answered 408 and closed.
        trickle = {h: head + b"x-slow: " + b"a" * 1000 for h in heads}
        trickle.update({b: b" " * 1000 for b in bodies})
        got = _poll_closed(heads + bodies, trickle, 15)
        assert all(r.startswith(b"HTTP/1.1 408") for r in got.values()), got
        wait_for(lambda: not state.connections, 10)
        # The server still serves, and nothing is left in the engine.
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.completions.create(model=NAME, prompt="w3", max_tokens=2)
        assert r.choices[0].finish_reason == "length"
        assert s.used_blocks() == 0 and s.llm.num_unfinished == 0
    finally:
        for sock in socks:
            sock.close()
        s.stop()


def test_a_stream_outlives_the_deadlines(model_dir):
    # The deadlines bound receiving a request, not sending its answer.
    s = Server(model_dir, limits={"header_timeout_s": 0.2, "body_timeout_s": 0.2,
                                  "keep_alive_s": 1})
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        n = 0
        for _chunk in c.completions.create(model=NAME, prompt="w3", max_tokens=120,
                                           stream=True, extra_body={"ignore_eos": True}):
            n += 1
            if n == 1:
                time.sleep(0.5)  # the client reads slowly: past both deadlines
        assert n >= 100
        # A kept-alive connection serves a second request after a pause under the deadlines.
        with httpx.Client(timeout=30) as h:
            assert h.get(f"{s.url}/health").status_code == 200
            time.sleep(0.1)
            assert h.get(f"{s.url}/health").status_code == 200
    finally:
        s.stop()


def test_responses_are_not_held_by_nagle(server):
    # A socket bound by the caller (proto 0, as these tests and `uvicorn --workers` bind) gets no
    # TCP_NODELAY from asyncio; the server sets it, or a response's body would wait for the
    # client's delayed ACK of its head (~40 ms per request, and per streamed chunk).
    import socket as socket_

    with httpx.Client(timeout=30) as h:
        assert h.get(f"{server.url}/health").status_code == 200
        conns = list(server.server.server_state.connections)
        assert conns
        for proto in conns:
            sock = proto.transport.get_extra_info("socket")
            assert sock.getsockopt(socket_.IPPROTO_TCP, socket_.TCP_NODELAY) != 0


def test_pagedkv_serve_applies_the_bounds(model_dir):
    # The command's own path (serve(): its socket bound before the model loads, then uvicorn
    # through uvicorn_config): a client that never completes its head is answered 408 and closed
    # at the default deadline, and the server keeps serving.
    from test_serve_cli import ENGINE_ARGV, _env, _Proc

    from pagedkv.serve.app import DEFAULT_HEADER_TIMEOUT_S

    proc = _Proc([model_dir, *ENGINE_ARGV, "--served-model-name", NAME], _env())
    sock = None
    try:
        port = int(proc.wait_for(r"serving on http://127\.0\.0\.1:(\d+)").group(1))
        deadline = time.monotonic() + 30
        while True:  # uvicorn may still be starting
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # never finished
        sock.settimeout(DEFAULT_HEADER_TIMEOUT_S + 20)
        got = b""
        while True:
            data = sock.recv(4096)
            if not data:
                break
            got += data
        assert got.startswith(b"HTTP/1.1 408"), got
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                          max_retries=0, timeout=60)
        r = c.completions.create(model=NAME, prompt="w3 w4", max_tokens=2)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        if sock is not None:
            sock.close()
        proc.stop()
