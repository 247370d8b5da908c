"""pytest plugin: run a test suite (vLLM's own KV-cache tests) with the pagedkv block pool.

Load it with ``-p pagedkv.vllm.pytest_plugin``. At configure time, before test modules are
imported, it rebinds vLLM's ``BlockPool`` both where the KV cache coordinator looks it up and in
``vllm.v1.core.block_pool`` (tests that build a pool directly import it from there), so every
pool a test makes is pagedkv's. After each test it checks that every live pagedkv pool is
coherent with its core; a test that leaves one incoherent fails.

With ``PAGEDKV_VLLM_TEST_MANAGER=1`` it also rebinds vLLM's ``KVCacheManager`` (in the
scheduler's module and in ``vllm.v1.core.kv_cache_manager``) to pagedkv's drop-in manager
(:mod:`pagedkv.vllm.manager`), and checks every pagedkv manager a test built after it.

With ``PAGEDKV_VLLM_TEST_OFFLOAD=1`` it rebinds vLLM's ``CPUOffloadingManager`` (in
``vllm.v1.kv_offload.cpu.manager``, where the offloading tests import it, and in the CPU spec's
module) to a factory that builds pagedkv's :class:`~pagedkv.vllm.offload.PagedKVOffloadingManager`
for the LRU policy (vLLM's own manager for any other policy, which pagedkv does not provide), and
checks every pagedkv offloading manager a test built after it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

_MANAGER = os.environ.get("PAGEDKV_VLLM_TEST_MANAGER", "0") not in ("", "0")
_OFFLOAD = os.environ.get("PAGEDKV_VLLM_TEST_OFFLOAD", "0") not in ("", "0")
#: pagedkv offloading managers built since the last test ended.
_offload_managers: list[Any] = []


def _rebind_offload() -> None:
    from vllm.v1.kv_offload.cpu import manager as cpu_manager
    from vllm.v1.kv_offload.cpu import spec as cpu_spec

    from pagedkv.vllm.offload import PagedKVOffloadingManager

    stock = cpu_manager.CPUOffloadingManager

    def build(num_chunks: int, cache_policy: str = "lru", *args: Any, **kwargs: Any) -> Any:
        if cache_policy != "lru" or (args and args[0]) or kwargs.get("cache_policy_module_path"):
            return stock(num_chunks, cache_policy, *args, **kwargs)
        m = PagedKVOffloadingManager(num_chunks, cache_policy, *args, **kwargs)
        _offload_managers.append(m)
        return m

    cpu_manager.CPUOffloadingManager = build  # type: ignore[assignment,misc]
    cpu_spec.CPUOffloadingManager = build  # type: ignore[assignment,misc]


#: pagedkv managers built since the last test ended (held until then: a test's manager is
#: usually unreachable once the test function returns).
_managers: list[Any] = []


def pytest_configure(config: pytest.Config) -> None:
    from pagedkv.vllm import activate

    activate(also_block_pool_module=True)
    if _OFFLOAD:
        _rebind_offload()
    if _MANAGER:
        from pagedkv.vllm import activate_manager
        from pagedkv.vllm.manager import PagedKVCacheManager

        activate_manager(also_manager_module=True)
        init = PagedKVCacheManager.__init__

        def tracked_init(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            _managers.append(self)

        PagedKVCacheManager.__init__ = tracked_init  # type: ignore[method-assign]
    config.addinivalue_line("markers", "pagedkv_pool: the run uses pagedkv's block pool")


def pytest_report_header(config: pytest.Config) -> str:
    line = "pagedkv: vLLM BlockPool -> pagedkv.vllm.pool.PagedKVBlockPool"
    if _MANAGER:
        line += "; KVCacheManager -> pagedkv.vllm.manager.DropInKVCacheManager"
    if _OFFLOAD:
        line += "; CPUOffloadingManager (lru) -> pagedkv.vllm.offload.PagedKVOffloadingManager"
    return line


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    result = yield
    from pagedkv.vllm.pool import PagedKVBlockPool

    pools = list(PagedKVBlockPool._live)
    PagedKVBlockPool._live.clear()
    _checked[0] += len(pools)
    managers = list(_managers)
    _managers.clear()
    _checked_managers[0] += len(managers)
    offload = list(_offload_managers)
    _offload_managers.clear()
    _checked_offload[0] += len(offload)
    for m in managers:
        m.check_coherence()
    for m in offload:
        m.check_coherence()
    for p in pools:
        p.check_coherence()
    return result


_checked = [0]
_checked_managers = [0]
_checked_offload = [0]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(
        f"pagedkv: {_checked[0]} pagedkv block pools built by tests, each checked against its core"
    )
    if _MANAGER:
        terminalreporter.write_line(
            f"pagedkv: {_checked_managers[0]} pagedkv KV cache managers built by tests, "
            f"each checked against its pool"
        )
    if _OFFLOAD:
        terminalreporter.write_line(
            f"pagedkv: {_checked_offload[0]} pagedkv offloading managers built by tests, "
            f"each checked against its core"
        )
