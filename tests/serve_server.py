"""The in-process ``pagedkv serve`` the serve tests drive: ``Server`` (a real uvicorn thread on a
free loopback port over an ``AsyncLLM`` of the tiny random Llama of ``tests/tiny_llama.py``) and
the module-scoped ``model_dir`` / ``server`` / ``client`` fixtures (a test module imports them).
Importing it skips the importing module when the serve extras are missing."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagedkv import AsyncLLM  # noqa: E402
from pagedkv.serve.app import build_app, uvicorn_config  # noqa: E402

from tiny_llama import save_tiny_llama  # noqa: E402

__all__ = ["NAME", "ENGINE", "CHAT", "Server", "model_dir", "server", "client", "httpx", "openai"]

NAME = "tiny"
ENGINE = dict(device="cpu", num_blocks=128, block_size=4, max_num_seqs=8,
              max_num_batched_tokens=64)
CHAT = [{"role": "user", "content": "w5 w6 w7"}]


class Server:
    """A uvicorn server over an AsyncLLM, on a socket bound to a free loopback port."""

    def __init__(self, model_dir: str, max_queue_size=None, *, app_args=None, limits=None,
                 tokenizer=None, **engine):
        self.llm = AsyncLLM(model_dir, max_queue_size=max_queue_size, **{**ENGINE, **engine})
        if tokenizer is not None:  # wraps the engine's tokenizer before the app copies it
            self.llm.engine.tokenizer = tokenizer(self.llm.engine.tokenizer)
        app = build_app(self.llm, served_model_name=NAME, **(app_args or {}))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, log_level="warning", lifespan="off",
                                                    **(limits or {})))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def used_blocks(self) -> int:
        return self.llm.engine.manager.stats().used_blocks

    def wait_idle(self, timeout=15.0) -> None:
        deadline = time.monotonic() + timeout
        while self.used_blocks() or self.llm.num_unfinished:
            assert time.monotonic() < deadline, (self.used_blocks(), self.llm.num_unfinished)
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.llm.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)
