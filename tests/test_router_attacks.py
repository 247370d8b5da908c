"""The router's request path under misbehaving replicas and clients, over real sockets.

Replicas here are stand-ins on loopback: raw TCP servers that read a request and then close or
answer garbage (counting every request that reached them), and a uvicorn app that generates
slowly and records when its client went away. The router runs in uvicorn with its lifespan; the
client is httpx. Waits are bounded polls.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any, Dict, List

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("zmq")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, Response, StreamingResponse  # noqa: E402

from pagedkv.router import ReplicaSpec, Router, build_app  # noqa: E402
from polling import wait_for  # noqa: E402


class Uvicorn:
    """An app served by uvicorn in a thread on a free loopback port."""

    def __init__(self, app: Any, lifespan: str = "off") -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class RawReplica:
    """A TCP server that answers ``GET /health`` with 200 and, for any other request, reads it
    whole and then misbehaves: ``mode="close"`` closes the connection, ``"garbage"`` answers
    bytes that are not HTTP. ``posts`` counts the requests that reached it."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.posts = 0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stopped = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, rest = data.partition(b"\r\n\r\n")
                if head.startswith(b"GET /health"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n"
                                 b"connection: close\r\n\r\n")
                    return
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(rest) < length:
                    rest += conn.recv(65536)
                self.posts += 1
                if self.mode == "garbage":
                    conn.sendall(b"\x00\x01 this is not HTTP \xff\r\n\r\n")
            except OSError:
                return

    def close(self) -> None:
        self.stopped = True
        self.sock.close()


def router_front(urls: List[str], **kw: Any) -> Any:
    router = Router([ReplicaSpec(u) for u in urls], block_size=4, hash_seed=0x5EED, **kw)
    return router, Uvicorn(build_app(router), lifespan="on")


BODY = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 4}


@pytest.mark.parametrize("mode", ["close", "garbage"])
def test_a_request_that_reached_a_replica_is_never_resent(mode: str) -> None:
    replicas = [RawReplica(mode), RawReplica(mode)]
    router, front = router_front([r.url for r in replicas], health_interval_s=3600)
    try:
        r = httpx.post(front.url + "/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "not resent" in err["message"]
        assert sum(rep.posts for rep in replicas) == 1
        assert router.stats.retries == 0
    finally:
        front.stop()
        for rep in replicas:
            rep.close()


def test_a_replica_that_refuses_the_connection_is_skipped() -> None:
    """The one retry that stays: the connection never opened, nothing was sent."""
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()  # nothing listens there
    good = SlowReplica()
    router, front = router_front([dead_url, good.http.url], health_interval_s=3600)
    try:
        r = httpx.post(front.url + "/v1/completions", json={**BODY, "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200 and r.headers["x-pagedkv-replica"] == good.http.url
    finally:
        front.stop()
        good.http.stop()


class SlowReplica:
    """A uvicorn app that generates one chunk per 20 ms (``max_tokens`` of them), streamed or
    not, and records how many it made and whether it saw its client go."""

    def __init__(self) -> None:
        self.made = 0
        self.gone = threading.Event()
        self.started = threading.Event()
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            n = int(body["max_tokens"])
            if body.get("stream"):
                async def gen() -> Any:
                    try:
                        for _ in range(n):
                            self.started.set()
                            self.made += 1
                            yield b'data: {"choices": [{"text": "x"}]}\n\n'
                            await asyncio.sleep(0.02)
                        yield b"data: [DONE]\n\n"
                    finally:
                        if self.made < n:
                            self.gone.set()
                return StreamingResponse(gen(), media_type="text/event-stream")
            for _ in range(n):
                self.started.set()
                if await request.is_disconnected():
                    self.gone.set()
                    return Response(status_code=499)
                self.made += 1
                await asyncio.sleep(0.02)
            return JSONResponse({"choices": [{"text": "x" * n}]})

        self.http = Uvicorn(app)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_stops_the_replica(stream: bool) -> None:
    replica = SlowReplica()
    router, front = router_front([replica.http.url], health_interval_s=3600)
    try:
        body = {**BODY, "max_tokens": 1_000, "stream": stream}
        if stream:
            with httpx.stream("POST", front.url + "/v1/completions", json=body,
                              timeout=30) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                next(lines)
                next(lines)
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(front.url + "/v1/completions", json=body, timeout=0.5)
        assert replica.started.is_set()
        wait_for(replica.gone.is_set, 10)
        assert replica.made < 1_000
        wait_for(lambda: router.replicas[0].in_flight == 0, 10)
    finally:
        front.stop()
        replica.http.stop()


def test_router_errors_are_openai_shaped() -> None:
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()
    router, front = router_front([dead_url], health_interval_s=3600)

    def check(r: httpx.Response, status: int) -> Dict[str, Any]:
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        return err

    try:
        url = front.url
        deep = b"[" * 100_000 + b"]" * 100_000
        err = check(httpx.post(url + "/v1/completions", content=deep,
                               headers={"content-type": "application/json"}, timeout=30), 400)
        assert err["type"] == "invalid_request_error"
        check(httpx.post(url + "/v1/completions", content=b"{not json", timeout=30), 400)
        check(httpx.post(url + "/v1/completions", content=b"[1, 2]", timeout=30), 400)
        check(httpx.get(url + "/v1/nothing-here", timeout=30), 404)
        check(httpx.get(url + "/v1/completions", timeout=30), 405)
        err = check(httpx.post(url + "/v1/completions", json=BODY, timeout=30), 503)
        assert err["type"] == "service_unavailable_error"
    finally:
        front.stop()


def test_health_probes_log_at_debug(caplog: Any) -> None:
    replica = SlowReplica()
    caplog.set_level(logging.INFO)
    router, front = router_front([replica.http.url], health_interval_s=0.02)
    try:
        time.sleep(0.5)  # some twenty probes
        # A proxied request is still logged by httpx, once.
        r = httpx.post(front.url + "/v1/completions", json={**BODY, "max_tokens": 1}, timeout=30)
        assert r.status_code == 200
    finally:
        front.stop()
        replica.http.stop()
    loud = [r.getMessage() for r in caplog.records
            if r.levelno >= logging.INFO and "/health" in r.getMessage()]
    assert loud == []
    assert any("/v1/completions" in r.getMessage() for r in caplog.records
               if r.name == "httpx")
