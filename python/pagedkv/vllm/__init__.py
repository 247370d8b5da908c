"""pagedkv inside vLLM v1: a drop-in ``KVCacheManager`` and ``BlockPool`` on pagedkv's Rust core.

This package owns the adapters (:mod:`pagedkv.vllm.pool`, the block pool;
:mod:`pagedkv.vllm.manager`, the whole KV cache manager over that pool), their activation
(:func:`activate`, :func:`activate_manager`, also run by the ``vllm.general_plugins`` entry point
``pagedkv``) and a pytest plugin (:mod:`pagedkv.vllm.pytest_plugin`) that runs vLLM's own tests
with them swapped in.

Activation is one line of configuration: with ``pagedkv[vllm]`` installed, vLLM loads every
``vllm.general_plugins`` entry point in each process before it builds the scheduler; pagedkv's
plugin rebinds the scheduler's ``KVCacheManager`` only when ``PAGEDKV_VLLM_MANAGER=1`` is set,
and ``vllm.v1.core.kv_cache_coordinator.BlockPool`` only when ``PAGEDKV_VLLM_POOL=1`` is set, so
installing the package alone changes nothing::

    PAGEDKV_VLLM_MANAGER=1 vllm serve ...         # the whole manager (implies the pool)
    PAGEDKV_VLLM_POOL=1 vllm serve ...            # the pool only, under vLLM's manager
    # VLLM_PLUGINS=pagedkv loads only pagedkv's plugin

Importing this package does not import vLLM; :func:`activate` does.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "activate",
    "activate_manager",
    "deactivate",
    "deactivate_manager",
    "is_active",
    "is_manager_active",
    "register",
]

_saved: dict[str, Any] = {}


def activate(*, also_block_pool_module: bool = False) -> type:
    """Make vLLM build :class:`~pagedkv.vllm.pool.PagedKVBlockPool` for its KV cache manager.

    Rebinds ``kv_cache_coordinator.BlockPool`` (the name ``KVCacheCoordinator.__init__`` calls).
    With ``also_block_pool_module``, ``vllm.v1.core.block_pool.BlockPool`` is rebound too, so
    code that imports the class by name after this call (tests building a pool directly) gets
    ours. Idempotent; returns the pool class.
    """
    from vllm.v1.core import block_pool, kv_cache_coordinator

    from pagedkv.vllm.pool import PagedKVBlockPool

    if "coordinator" not in _saved:
        _saved["coordinator"] = kv_cache_coordinator.BlockPool
    kv_cache_coordinator.BlockPool = PagedKVBlockPool  # type: ignore[misc]
    if also_block_pool_module:
        if "module" not in _saved:
            _saved["module"] = block_pool.BlockPool
        block_pool.BlockPool = PagedKVBlockPool  # type: ignore[misc]
    return PagedKVBlockPool


def deactivate() -> None:
    """Undo :func:`activate`: vLLM's own pool again."""
    from vllm.v1.core import block_pool, kv_cache_coordinator

    if "coordinator" in _saved:
        kv_cache_coordinator.BlockPool = _saved.pop("coordinator")
    if "module" in _saved:
        block_pool.BlockPool = _saved.pop("module")


def is_active() -> bool:
    """Whether vLLM's coordinator builds the pagedkv pool."""
    from vllm.v1.core import kv_cache_coordinator

    from pagedkv.vllm.pool import PagedKVBlockPool

    return kv_cache_coordinator.BlockPool is PagedKVBlockPool


def activate_manager(*, also_manager_module: bool = False) -> type:
    """Make vLLM's scheduler build pagedkv's KV cache manager.

    Rebinds ``vllm.v1.core.sched.scheduler.KVCacheManager`` (the name ``Scheduler.__init__``
    calls) to :class:`~pagedkv.vllm.manager.DropInKVCacheManager`: pagedkv's manager (on the
    pagedkv pool; hybrid models run vLLM's per-group code over that pool), vLLM's own manager
    for a model with no KV cache group. With
    ``also_manager_module``, ``vllm.v1.core.kv_cache_manager.KVCacheManager`` is rebound too
    (tests that build a manager directly). Idempotent; returns the class.
    """
    from vllm.v1.core import kv_cache_manager
    from vllm.v1.core.sched import scheduler

    from pagedkv.vllm.manager import DropInKVCacheManager

    if "scheduler" not in _saved:
        _saved["scheduler"] = scheduler.KVCacheManager
    scheduler.KVCacheManager = DropInKVCacheManager  # type: ignore[misc]
    if also_manager_module:
        if "manager_module" not in _saved:
            _saved["manager_module"] = kv_cache_manager.KVCacheManager
        kv_cache_manager.KVCacheManager = DropInKVCacheManager  # type: ignore[misc]
    return DropInKVCacheManager


def deactivate_manager() -> None:
    """Undo :func:`activate_manager`: vLLM's own manager again."""
    from vllm.v1.core import kv_cache_manager
    from vllm.v1.core.sched import scheduler

    if "scheduler" in _saved:
        scheduler.KVCacheManager = _saved.pop("scheduler")
    if "manager_module" in _saved:
        kv_cache_manager.KVCacheManager = _saved.pop("manager_module")


def is_manager_active() -> bool:
    """Whether vLLM's scheduler builds pagedkv's KV cache manager."""
    from vllm.v1.core.sched import scheduler

    from pagedkv.vllm.manager import DropInKVCacheManager

    return scheduler.KVCacheManager is DropInKVCacheManager


def _on(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "False")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: activates the manager when
    ``PAGEDKV_VLLM_MANAGER=1``, the pool alone when ``PAGEDKV_VLLM_POOL=1``."""
    if _on("PAGEDKV_VLLM_MANAGER"):
        activate_manager()
    if _on("PAGEDKV_VLLM_POOL"):
        activate()
