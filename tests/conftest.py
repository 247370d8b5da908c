"""Test configuration: the `gpu` marker skips its tests when no CUDA device is present; the
``redis_server`` fixture runs a real redis-server for the remote tier (tests/redis_server.py).

Hypothesis profiles: ``dev`` (the default) draws new random examples every run, which is how the
property tests find bugs; ``ci`` (``PAGEDKV_HYPOTHESIS_PROFILE=ci``, set by ``scripts/test.sh``)
derandomizes them, so CI runs the same examples every time and a red run is a change's doing,
never the draw's. Run ``dev`` (with more examples: ``--hypothesis-seed`` or a larger
``max_examples``) to explore."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterator

import pytest

try:  # hypothesis is a test dependency; the profiles are registered before any test module
    from hypothesis import settings as _hsettings

    _hsettings.register_profile("dev")
    _hsettings.register_profile("ci", derandomize=True, print_blob=True)
    _hsettings.load_profile(os.environ.get("PAGEDKV_HYPOTHESIS_PROFILE", "dev"))
except ImportError:  # pragma: no cover - the floors job runs without it
    pass

if TYPE_CHECKING:
    from redis_server import RedisServer


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    # pagedkv's cache (converted models, measured rates) goes to a fresh directory per run, never
    # the user's; subprocesses inherit it.
    import tempfile

    os.environ["PAGEDKV_CACHE_DIR"] = tempfile.mkdtemp(prefix="pagedkv-test-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
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
