"""The one interface of a store below the host tier, and the registry of the backends.

Owns :class:`BlockStore`, the protocol :class:`~pagedkv.tiers.cache.TierCache` calls on every
lower tier (and the only one: nothing else reaches into a store), and :data:`BACKENDS`, the
registry the engine builds its stores from. A backend is one module whose store class implements
:class:`BlockStore` and has a ``from_config(config, fingerprint, block_bytes)`` classmethod; adding
one is that module plus one line in :data:`BACKENDS`. Its ``name`` keys the engine's figures
(``llm.stats().prefix_hits_by_tier``, the Prometheus ``tier`` label), its ``locality`` goes into
its KV events (``medium="STORAGE"``).

Invariants: the registry's order is the search order (fastest first); a backend module is imported
only when its store is asked for (``redis`` stays unimported without a remote tier); names are
unique, and none is ``"gpu"`` or ``"host"``.
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, List, Optional, Protocol, Sequence, cast

from ..errors import InvalidConfigError
from .record import BlockMeta, Buffer, TierStats

__all__ = ["BACKENDS", "BlockStore", "StoreFactory", "backend", "build_stores"]


class BlockStore(Protocol):
    """What the tier cache calls on a lower tier (:class:`~pagedkv.tiers.DiskStore`,
    :class:`~pagedkv.tiers.RemoteStore`). Every call may come from the cache's reader/writer
    threads; a store must be safe for concurrent calls, and a failure is a miss (False, 0), never a
    wrong answer."""

    #: The tier's name: the key of its figures (unique among the stores; not ``gpu``/``host``).
    name: str
    #: ``"LOCAL"`` (this machine only) or ``"REMOTE"`` (shared by engines): its KV events' locality.
    locality: str
    #: Bytes of one block's payload.
    block_bytes: int

    def put(self, meta: BlockMeta, data: Buffer) -> bool:
        """Stores one block's bytes under ``meta``; False when it was not stored."""
        ...

    def get_into(self, meta: BlockMeta, out: Buffer) -> bool:
        """Reads the block ``meta`` names into ``out`` (``block_bytes`` writable bytes); True only
        when its record verified (fingerprint, hash, salt digest, token ids, checksum)."""
        ...

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` (chain order) the store holds."""
        ...

    def holds(self, hashes: Sequence[int]) -> List[bool]:
        """Which of ``hashes`` the store holds, each on its own (the KV cache groups' probe: a
        sliding group needs a window, not a chain's head)."""
        ...

    def stats(self) -> TierStats:
        """A snapshot of the store's own counters (``usage_bytes`` None where unknown)."""
        ...

    def take_removed(self) -> List[int]:
        """The hashes of the blocks the store dropped (evicted) since the last call; ``[]`` when it
        cannot know (a server with its own eviction policy)."""
        ...

    def close(self) -> None:
        """Finishes queued I/O and releases the store's resources. Idempotent."""
        ...


#: ``from_config(config, fingerprint, block_bytes)``: the store ``config`` asks for, or None when
#: it asks for none of this backend. ``config`` is read by attribute (an
#: :class:`~pagedkv.engine.config.EngineConfig`, or anything with the backend's fields).
StoreFactory = Callable[[object, bytes, int], Optional[BlockStore]]

#: The backends, fastest first: ``name -> "module:Class"`` (the class's ``from_config``), imported
#: on use. A new backend is one module and one line here.
BACKENDS: Dict[str, str] = {
    "disk": "pagedkv.tiers.disk:DiskStore",
    "remote": "pagedkv.tiers.remote:RemoteStore",
}


def backend(name: str) -> StoreFactory:
    """The ``from_config`` of the backend registered as ``name``.

    Raises:
        InvalidConfigError: No backend has that name.
    """
    target = BACKENDS.get(name)
    if target is None:
        raise InvalidConfigError(
            f"unknown tier backend {name!r}: registered are {', '.join(BACKENDS)}",
            field="backend", value=name, reason=f"must be one of {sorted(BACKENDS)}")
    module, _, cls = target.partition(":")
    return cast(StoreFactory, getattr(importlib.import_module(module), cls).from_config)


def build_stores(config: object, fingerprint: bytes, block_bytes: int) -> List[BlockStore]:
    """The lower tiers ``config`` asks for, in registry order (fastest first). A store already
    built is closed again when a later one fails to build.

    Raises:
        InvalidConfigError: Two stores share a name, or one is named ``gpu`` or ``host``;
            whatever a backend's ``from_config`` raises for a bad setting.
    """
    stores: List[BlockStore] = []
    try:
        for name in BACKENDS:
            store = backend(name)(config, fingerprint, block_bytes)
            if store is None:
                continue
            taken = [s.name for s in stores] + ["gpu", "host"]
            if store.name in taken:
                store.close()
                raise InvalidConfigError(
                    f"tier store name {store.name!r} is taken (by {', '.join(taken)})",
                    field="name", value=store.name, reason="must be unique")
            stores.append(store)
    except BaseException:
        for s in stores:
            s.close()
        raise
    return stores

