"""pagedkv inside vLLM v1: a drop-in ``BlockPool`` backed by pagedkv's Rust core.

This package owns the adapter (:mod:`pagedkv.vllm.pool`), its activation (:func:`activate`,
also run by the ``vllm.general_plugins`` entry point ``pagedkv``) and a pytest plugin
(:mod:`pagedkv.vllm.pytest_plugin`) that runs vLLM's own tests with the pool swapped in.

Activation is one line of configuration: with ``pagedkv[vllm]`` installed, vLLM loads every
``vllm.general_plugins`` entry point in each process before it builds the scheduler; pagedkv's
plugin rebinds ``vllm.v1.core.kv_cache_coordinator.BlockPool`` only when
``PAGEDKV_VLLM_POOL=1`` is set, so installing the package alone changes nothing::

    PAGEDKV_VLLM_POOL=1 vllm serve ...            # or VLLM_PLUGINS=pagedkv to load only ours

Importing this package does not import vLLM; :func:`activate` does.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["activate", "deactivate", "is_active", "register"]

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


def register() -> None:
    """The ``vllm.general_plugins`` entry point: activates when ``PAGEDKV_VLLM_POOL=1``."""
    if os.environ.get("PAGEDKV_VLLM_POOL", "0") not in ("", "0", "false", "False"):
        activate()
