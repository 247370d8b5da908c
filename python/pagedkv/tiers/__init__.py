"""The tiers of the prefix cache below the host: a local disk store and a shared Redis/Valkey store.

Owns the block record format (:mod:`.record`), the layout fingerprint that namespaces every tier
(:mod:`.fingerprint`), :class:`DiskStore` (:mod:`.disk`), :class:`RemoteStore` (:mod:`.remote`)
and :class:`TierFetcher` (:mod:`.fetcher`), which reads a request's prefix across them.
Both stores hold a host block's bytes verbatim, keyed by its chained prefix hash, and serve a block
only after its record verified (fingerprint, hash, salt digest, token ids, checksum): anything else
is a counted miss. ``redis`` is imported only when a :class:`RemoteStore` is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .disk import DiskStore, load_or_create_hash_key
from .fetcher import FetcherStats, TierFetcher
from .fingerprint import fingerprint, fingerprint_for_spec
from .record import BlockMeta, Reason, StoreClosedError, TierStats, decode, decode_checked, encode

if TYPE_CHECKING:
    from .remote import RemoteStore

__all__ = [
    "BlockMeta",
    "DiskStore",
    "FetcherStats",
    "Reason",
    "RemoteStore",
    "StoreClosedError",
    "TierFetcher",
    "TierStats",
    "decode",
    "decode_checked",
    "encode",
    "fingerprint",
    "fingerprint_for_spec",
    "load_or_create_hash_key",
]


def __getattr__(name: str) -> Any:
    # RemoteStore's module is light, but keeping it out of `import pagedkv.tiers` keeps the disk
    # tier usable (and importable) where redis is not installed.
    if name == "RemoteStore":
        from .remote import RemoteStore

        return RemoteStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
