"""The tiered prefix cache below the GPU: the host pool, and the stores under it.

The map, top down::

    host.py         HostKVPool (pinned host blocks) and SwapEngine (the copies between it and the
                    device pool: the host tier's bytes, and swap preemption)
    cache.py        TierCache: the admission gate that fetches a prompt's blocks from the stores
                    into host slots (ready / admitted / forget), after_schedule (demoted host
                    blocks to the stores, the stores' evictions to KV events), the figures per tier
    store.py        BlockStore, the one protocol the cache calls on a store, and BACKENDS, the
                    registry the stores are built from (a backend is a module plus one line)
    disk.py         DiskStore: the local disk tier          (backend "disk", locality LOCAL)
    remote.py       RemoteStore: Redis/Valkey, shared       (backend "remote", locality REMOTE)
    record.py       the block record both stores write, BlockMeta, TierStats
    fingerprint.py  the layout identity that namespaces every store
    model.py        ModelledDiskTier: the simulator's tier (the same manager calls, no bytes)

The engine imports :class:`TierCache`, :func:`build_tier_cache`, :func:`manager_tier_args` and
:class:`SwapEngine`; the simulator :class:`ModelledDiskTier`. Which tier holds what is the Rust
core's decision (``docs/tiers.md``); this package moves and keeps the bytes.

Invariants: nothing here imports :mod:`pagedkv.engine`; ``import pagedkv.tiers`` imports neither
torch (``host``) nor redis (``remote``): those load when first named.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .cache import TierCache, TierCacheStats, build_tier_cache, manager_tier_args
from .disk import DiskStore, load_or_create_hash_key
from .fingerprint import fingerprint, fingerprint_for_spec
from .model import ModelledDiskTier, TierModelStats
from .record import BlockMeta, Reason, StoreClosedError, TierStats, decode, decode_checked, encode
from .store import BACKENDS, BlockStore, backend, build_stores

if TYPE_CHECKING:
    from .host import HostKVPool, SwapEngine
    from .remote import RemoteStore

__all__ = [
    "BACKENDS",
    "BlockMeta",
    "BlockStore",
    "DiskStore",
    "HostKVPool",
    "ModelledDiskTier",
    "Reason",
    "RemoteStore",
    "StoreClosedError",
    "SwapEngine",
    "TierCache",
    "TierCacheStats",
    "TierModelStats",
    "TierStats",
    "backend",
    "build_stores",
    "build_tier_cache",
    "decode",
    "decode_checked",
    "encode",
    "fingerprint",
    "fingerprint_for_spec",
    "load_or_create_hash_key",
    "manager_tier_args",
]

#: Names loaded on first use, by module: torch for the host pool, redis for the remote store.
_LAZY = {
    "HostKVPool": ".host",
    "SwapEngine": ".host",
    "RemoteStore": ".remote",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
