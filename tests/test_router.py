"""The prefix-aware router over real replicas: uvicorn servers of tiny Llamas on loopback.

Each replica is a real ``pagedkv serve`` app (AsyncLLM + build_app) in a thread; its cache is
announced by a real ZeroMQ publisher the test drives (events in the core's shape), so every
placement below is decided from what the test published. The router runs in uvicorn too, with its
lifespan (subscribers, health probes). Waits are bounded polls.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any, Callable, List, Optional

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagedkv import AsyncLLM, hash_prompt  # noqa: E402
from pagedkv.chat import render_conversations  # noqa: E402
from pagedkv.events import EventSink, KVEventBatch, ZmqEventPublisher  # noqa: E402
from pagedkv.router import PrefixIndex, ReplicaSpec, Router, build_app  # noqa: E402
from pagedkv.router.app import load_tokenizer  # noqa: E402
from pagedkv.serve.app import build_app as build_serve_app  # noqa: E402

from polling import wait_for as _poll  # noqa: E402
from tiny_llama import save_tiny_llama  # noqa: E402

BLOCK = 4
KEY = 0x5EED
ENGINE = dict(device="cpu", num_blocks=128, block_size=BLOCK, max_num_seqs=8,
              max_num_batched_tokens=64, hash_seed=KEY)


def wait_for(cond: Callable[[], bool], timeout: float = 15.0) -> None:
    """Replicas and routers start slowly on a loaded box: a longer default than events' tests."""
    _poll(cond, timeout, 0.02)


class Uvicorn:
    """An app served by uvicorn in a thread, on ``port`` (0: a free one)."""

    def __init__(self, app: Any, port: int = 0, lifespan: str = "off") -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class Replica:
    def __init__(self, model_dir: str) -> None:
        self.llm = AsyncLLM(model_dir, **ENGINE)
        self.app = build_serve_app(self.llm, served_model_name="tiny")
        self.http: Optional[Uvicorn] = Uvicorn(self.app)
        self.url = self.http.url
        self.events = ZmqEventPublisher("tcp://127.0.0.1:*")

    def announce(self, tokens: List[int], salt: Optional[str] = None) -> None:
        hashes = hash_prompt(tokens, BLOCK, KEY, salt)
        sink = EventSink()
        sink.add_stored(hashes, None, tokens[:len(hashes) * BLOCK], BLOCK)
        self.events.publish(KVEventBatch(ts=time.time(), events=sink.take()))

    def clear(self) -> None:
        sink = EventSink()
        sink.add_cleared()
        self.events.publish(KVEventBatch(ts=time.time(), events=sink.take()))

    def close(self) -> None:
        if self.http is not None:
            self.http.stop()
        self.events.close()
        self.llm.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: Any) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def fleet(model_dir: str) -> Any:
    replicas = [Replica(model_dir) for _ in range(2)]
    router = Router([ReplicaSpec(r.url, r.events.endpoint) for r in replicas], block_size=BLOCK,
                    hash_seed=KEY, tokenizer=load_tokenizer(model_dir), health_interval_s=0.1)
    front = Uvicorn(build_app(router), lifespan="on")
    wait_for(lambda: all(r.subscriber is not None for r in router.replicas))
    time.sleep(0.3)  # the SUB sockets' subscriptions reach the publishers
    yield replicas, router, front
    front.stop()
    for r in replicas:
        r.close()


def post(front: Uvicorn, path: str, body: dict) -> httpx.Response:
    return httpx.post(front.url + path, json=body, timeout=60)


def indexed(router: Router, i: int, tokens: List[int]) -> Callable[[], bool]:
    hashes = hash_prompt(tokens, BLOCK, KEY)
    return lambda: router.index.match(hashes).get(i, 0) == len(hashes)


PROMPT_A = [5 + (i % 40) for i in range(24)]
PROMPT_B = [50 + (i % 30) for i in range(24)]


def test_index_tracks_tiers_and_longest_prefix() -> None:
    idx = PrefixIndex()
    sink = EventSink()
    sink.add_stored([1, 2, 3], None, [0] * 6, 2, medium="GPU")
    sink.add_stored([1, 2], None, [0] * 4, 2, medium="CPU")
    idx.apply(0, KVEventBatch(ts=0, events=sink.take()))
    sink.add_stored([1], None, [0, 0], 2)
    idx.apply(1, KVEventBatch(ts=0, events=sink.take()))
    assert idx.match([1, 2, 3, 4]) == {0: 3, 1: 1}
    assert idx.tiers(0, 1) == {"GPU", "CPU"}
    sink.add_removed([2], medium="GPU")
    idx.apply(0, KVEventBatch(ts=0, events=sink.take()))
    assert idx.tiers(0, 2) == {"CPU"} and idx.match([1, 2, 3]) == {0: 3, 1: 1}
    sink.add_removed([2], medium="CPU")
    idx.apply(0, KVEventBatch(ts=0, events=sink.take()))
    assert idx.match([1, 2, 3]) == {0: 1, 1: 1}
    sink.add_cleared()
    idx.apply(0, KVEventBatch(ts=0, events=sink.take()))
    assert idx.match([1]) == {1: 1} and idx.blocks(0) == 0 and idx.blocks(1) == 1


def test_router_tokenizes_as_the_replica_does(fleet: Any, model_dir: str) -> None:
    replicas, router, _ = fleet
    engine = replicas[0].llm.engine
    text = "w1 w2 w3 w4 w5 w6 w7 w8 w9"
    assert router.prompt_tokens("/v1/completions", {"prompt": text}) == engine.tokenize(text)[1]
    assert router.prompt_tokens("/v1/completions", {"prompt": [3, 4, 5]}) == [3, 4, 5]
    chat = [{"role": "user", "content": "w5 w6 w7"}]
    want = render_conversations(engine.tokenizer, chat, chat_template=None,
                                add_generation_prompt=True, continue_final_message=False,
                                chat_template_kwargs=None)[0]["prompt_token_ids"]
    assert router.prompt_tokens("/v1/chat/completions", {"messages": chat}) == want


def test_routes_to_the_longest_cached_prefix(fleet: Any) -> None:
    replicas, router, front = fleet
    replicas[1].announce(PROMPT_A)
    wait_for(indexed(router, 1, PROMPT_A))
    body = {"model": "tiny", "prompt": PROMPT_A, "max_tokens": 3, "temperature": 0}
    for _ in range(2):
        r = post(front, "/v1/completions", body)
        assert r.status_code == 200, r.text
        assert r.headers["x-pagedkv-replica"] == replicas[1].url
    # Replica 0 announces only the first two blocks of B; replica 1 none: B goes to 0.
    replicas[0].announce(PROMPT_B[:8])
    wait_for(lambda: router.index.match(hash_prompt(PROMPT_B, BLOCK, KEY)).get(0) == 2)
    r = post(front, "/v1/completions", {**body, "prompt": PROMPT_B})
    assert r.headers["x-pagedkv-replica"] == replicas[0].url
    # A text prompt whose tokens replica 1 announced goes there too.
    text = "w1 w2 w3 w4 w5 w6 w7 w8 w9"
    replicas[1].announce(replicas[1].llm.engine.tokenize(text)[1])
    wait_for(lambda: router.index.blocks(1) >= 8)
    r = post(front, "/v1/completions", {**body, "prompt": text})
    assert r.headers["x-pagedkv-replica"] == replicas[1].url
    # A salted request hashes differently: the unsalted announcement does not attract it...
    before = router.stats.matched_blocks
    post(front, "/v1/completions", {**body, "cache_salt": "tenant-x"})
    assert router.stats.matched_blocks == before
    # ...a salted one does.
    replicas[0].announce(PROMPT_A, salt="tenant-x")
    wait_for(lambda: router.index.blocks(0) >= 2 + 5)
    r = post(front, "/v1/completions", {**body, "cache_salt": "tenant-x"})
    assert r.headers["x-pagedkv-replica"] == replicas[0].url


def test_streams_are_proxied_chunk_by_chunk(fleet: Any) -> None:
    replicas, router, front = fleet
    body = {"model": "tiny", "prompt": PROMPT_A, "max_tokens": 6, "temperature": 0}
    direct = httpx.post(replicas[1].url + "/v1/completions", json=body, timeout=60).json()
    texts = []
    with httpx.stream("POST", front.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        texts.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(texts) == direct["choices"][0]["text"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}],
            "max_tokens": 4, "temperature": 0}
    r = post(front, "/v1/chat/completions", chat)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    assert post(front, "/v1/completions", {"model": "tiny", "prompt": ""}).status_code == 400
    assert httpx.get(front.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(front.url + "/health").status_code == 200
    assert "pagedkv_router_requests_total" in httpx.get(front.url + "/metrics").text


def test_cleared_empties_that_replicas_index(fleet: Any) -> None:
    replicas, router, front = fleet
    replicas[1].announce(PROMPT_A)
    wait_for(indexed(router, 1, PROMPT_A))
    replicas[1].clear()
    wait_for(lambda: router.index.blocks(1) == 0)
    assert router.index.blocks(0) > 0  # the other replica's entries stay


def test_a_down_replica_is_skipped_and_comes_back(fleet: Any) -> None:
    replicas, router, front = fleet
    replicas[1].announce(PROMPT_A)
    wait_for(indexed(router, 1, PROMPT_A))
    http = replicas[1].http
    port = http.port
    http.stop()
    body = {"model": "tiny", "prompt": PROMPT_A, "max_tokens": 2, "temperature": 0}
    # Whether the health probe or the request finds it first, the request lands on replica 0.
    r = post(front, "/v1/completions", body)
    assert r.status_code == 200 and r.headers["x-pagedkv-replica"] == replicas[0].url
    wait_for(lambda: not router.replicas[1].up)
    replicas[1].http = Uvicorn(replicas[1].app, port=port)
    wait_for(lambda: router.replicas[1].up)
    # Back up: what it cached before is unknown (it may have restarted), so it is re-indexed.
    assert router.index.blocks(1) == 0
    replicas[1].announce(PROMPT_A)
    wait_for(indexed(router, 1, PROMPT_A))
    r = post(front, "/v1/completions", body)
    assert r.headers["x-pagedkv-replica"] == replicas[1].url
