"""Test configuration: the `gpu` marker skips its tests when no CUDA device is present; the
``redis_server`` fixture runs a real redis-server for the remote tier (tests/redis_server.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import pytest

if TYPE_CHECKING:
    from redis_server import RedisServer


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    # pagedkv's cache (converted models, measured rates) goes to a fresh directory per run, never
    # the user's; subprocesses inherit it.
    import os
    import tempfile

    os.environ["PAGEDKV_CACHE_DIR"] = tempfile.mkdtemp(prefix="pagedkv-test-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    import os
    import shutil

    path = os.environ.get("PAGEDKV_CACHE_DIR", "")
    if os.path.basename(path).startswith("pagedkv-test-cache-"):
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    # Imported only when a gpu test is collected, so CPU-only runs never pay for torch.
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> "Iterator[RedisServer]":
    """A fresh ``redis-server`` on a free loopback port (see tests/redis_server.py), killed after."""
    from redis_server import RedisServer, redis_or_skip

    server = RedisServer(redis_or_skip(), tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: "RedisServer") -> str:
    """The URL of a fresh ``redis-server`` (the ``redis_server`` fixture's), for tests that only talk to it."""
    return redis_server.url
