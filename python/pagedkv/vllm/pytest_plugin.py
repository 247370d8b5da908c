"""pytest plugin: run a test suite (vLLM's own KV-cache tests) with the pagedkv block pool.

Load it with ``-p pagedkv.vllm.pytest_plugin``. At configure time, before test modules are
imported, it rebinds vLLM's ``BlockPool`` both where the KV cache coordinator looks it up and in
``vllm.v1.core.block_pool`` (tests that build a pool directly import it from there), so every
pool a test makes is pagedkv's. After each test it checks that every live pagedkv pool is
coherent with its core; a test that leaves one incoherent fails.
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from pagedkv.vllm import activate

    activate(also_block_pool_module=True)
    config.addinivalue_line("markers", "pagedkv_pool: the run uses pagedkv's block pool")


def pytest_report_header(config: pytest.Config) -> str:
    return "pagedkv: vLLM BlockPool -> pagedkv.vllm.pool.PagedKVBlockPool"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    result = yield
    from pagedkv.vllm.pool import PagedKVBlockPool

    pools = list(PagedKVBlockPool._live)
    PagedKVBlockPool._live.clear()
    _checked[0] += len(pools)
    for p in pools:
        p.check_coherence()
    return result


_checked = [0]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(
        f"pagedkv: {_checked[0]} pagedkv block pools built by tests, each checked against its core"
    )
