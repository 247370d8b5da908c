"""The disk tier: KV blocks in preallocated segment files on a local file system.

Owns :class:`DiskStore` (one cache directory), :func:`load_or_create_hash_key` (the prefix-hash
key a restarted engine must reuse for its blocks to be found again) and
:func:`load_or_create_tier_key` (the directory's own tier secret, when the engine is given none).
The store's concerns live in helper modules it is assembled from: ``_disk_files`` (the key files,
the lock and the descriptors), ``_disk_segments`` (segment geometry and the start-up scan),
``_disk_index`` (slots, eviction, lookups) and ``_disk_io`` (record writes and reads); every name
above is importable from here.

**Layout.** Blocks live in fixed-size *slots* (one :mod:`~pagedkv.tiers.record` each, the slot size
being the largest record rounded up to 4096 bytes) grouped into segment files of about 256 MiB,
``seg-<slot bytes>x<slots>-<index>.pkv``. A segment is created, at its full size
(``posix_fallocate``), when its first slot is needed, so the directory grows with use up to
``capacity_bytes`` and a full disk shows up then, not in the middle of a block. The in-memory index
(block hash → slot, in LRU order) is rebuilt at start-up from the slots' headers: a restarted
process finds its blocks; a slot whose header is unreadable, of another fingerprint or of another
block size is free space. Segments of another slot geometry or beyond the capacity are deleted.

**Concurrency.** All I/O runs on a thread pool (``put_async`` / ``get_async`` never touch the disk on
the caller's thread) with positional vectored reads and writes (``os.preadv`` / ``os.pwritev``),
so the payload goes between the caller's buffer and the page cache without an intermediate copy.
One lock guards the index; it is never held across a block's I/O. A slot being read is pinned and
never chosen for eviction; a slot being written is in no index entry until its write completed,
so a reader never sees a half-written block as present. A write that a crash interrupts leaves a
record whose checksum fails: a miss on the next read, never wrong bytes. Nothing is fsynced: this
is a cache, and a lost block is a miss.

**Trust.** Every record carries a MAC under the store's tier secret (the fleet's, or one the store
keeps in its directory, ``tier.key``): a record that does not verify is a counted miss
(``unauthenticated``). The directory must be owned by the engine's user and not writable by group
or others; the key files, the lock and the segments are opened relative to the directory's
descriptor with ``O_NOFOLLOW`` (created with ``O_EXCL``) and refused when they are links (symbolic,
or ``st_nlink > 1``), not owned by the user or writable by others
(:class:`~pagedkv.errors.UnsafePathError`). An ``OSError`` at start-up (a full disk, a read-only
file system) raises :class:`~pagedkv.errors.CacheIOError`. The directory's lock and files are
released by :meth:`DiskStore.close`, or when the store is garbage-collected.

**Invariants.** I/O errors, corruption, truncation and foreign records are misses counted in
:meth:`DiskStore.stats`, never exceptions; bad arguments raise
:class:`~pagedkv.errors.InvalidConfigError` / :class:`~pagedkv.errors.InvalidArgumentError` and
change nothing. The directory is 0700 and every file in it 0600. One store at a time owns a
directory (an exclusive ``flock`` on its ``lock`` file); tensor-parallel ranks use one directory each.
Every hash that leaves the index without the caller asking (evicted, overwritten, dropped as bad
bytes) is reported once by :meth:`DiskStore.take_removed` unless it is stored again first.
"""

from __future__ import annotations

import fcntl
import os
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Set

from ..errors import CacheIOError, InvalidConfigError, UnsafePathError
from ._disk_files import (
    HASH_KEY_FILE,
    LOCK_FILE,
    TIER_KEY_FILE,
    _Files,
    _PathLike,
    _release_files,
    load_or_create_hash_key,
    load_or_create_tier_key,
)
from ._disk_io import _DiskRecordIO
from .record import FINGERPRINT_BYTES, TierStats, record_size
from .secret import TierSecret, load_tier_secret, open_private_dir, open_private_file, secret_for_config

__all__ = [
    "DiskStore",
    "load_or_create_hash_key",
    "load_or_create_tier_key",
    "SLOT_ALIGN",
    "SEGMENT_BYTES",
    "HASH_KEY_FILE",
    "TIER_KEY_FILE",
    "LOCK_FILE",
]

#: Slot size granularity: the file system's page, so a slot never shares a page with another.
SLOT_ALIGN = 4096
#: Target size of one segment file (at least one slot).
SEGMENT_BYTES = 256 << 20


def _check_int(field: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidConfigError(
            f"{field} must be an integer >= {minimum}, got {value!r}", field=field, value=value,
            reason=f"must be >= {minimum}",
        )
    return value


class DiskStore(_DiskRecordIO):
    """KV blocks of one layout (``fingerprint``) in the directory ``path``, at most ``capacity_bytes``.

    Args:
        path: The cache directory (created 0700).
        capacity_bytes: Disk space the segment files may take; at least one slot.
        fingerprint: :func:`pagedkv.tiers.fingerprint.fingerprint` of the engine's layout.
        block_bytes: Bytes of one block (``CacheSpec.bytes_per_block``); every payload has this size.
        secret: The fleet's tier secret (:func:`pagedkv.tiers.secret.load_tier_secret`); ``None``:
            ``PAGEDKV_TIER_SECRET`` if set, else the store's own, kept in the directory
            (:func:`load_or_create_tier_key`).
        threads: Worker threads for the I/O.
        max_tokens: Token ids a record may carry (the block size); sizes the slots.

    Raises:
        InvalidConfigError: A bad argument, or the directory is in use by another store.
        UnsafePathError: The directory or a file in it is not the user's own (module docs).
        CacheIOError: The directory or its files cannot be prepared (a full disk, ...).
    """

    def __init__(
        self,
        path: _PathLike,
        capacity_bytes: int,
        fingerprint: bytes,
        block_bytes: int,
        *,
        secret: Optional[TierSecret] = None,
        threads: int = 2,
        max_tokens: int = 256,
    ) -> None:
        capacity_bytes = _check_int("capacity_bytes", capacity_bytes, 0)
        self.block_bytes = _check_int("block_bytes", block_bytes, 1)
        threads = _check_int("threads", threads, 1)
        self.max_tokens = _check_int("max_tokens", max_tokens, 1)
        if not isinstance(fingerprint, (bytes, bytearray)) or len(fingerprint) != FINGERPRINT_BYTES:
            raise InvalidConfigError(
                f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {fingerprint!r}",
                field="fingerprint", value=fingerprint, reason="wrong length",
            )
        if secret is not None and not isinstance(secret, TierSecret):
            raise InvalidConfigError(
                f"secret must be a pagedkv.tiers.secret.TierSecret or None, got {type(secret).__name__}",
                field="secret", value=type(secret).__name__, reason="not a TierSecret",
            )
        self.fingerprint = bytes(fingerprint)
        need = record_size(self.max_tokens, self.block_bytes)
        self.slot_bytes = -(-need // SLOT_ALIGN) * SLOT_ALIGN
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots == 0:
            raise InvalidConfigError(
                f"capacity_bytes {capacity_bytes} is smaller than one block's slot "
                f"({self.slot_bytes} bytes for {self.block_bytes}-byte blocks)",
                field="capacity_bytes", value=capacity_bytes, reason=f"must be >= {self.slot_bytes}",
            )
        # The geometry in the file name is that of a full segment, which does not depend on the
        # capacity: a restart with another capacity keeps its blocks.
        self._geometry = max(1, SEGMENT_BYTES // self.slot_bytes)
        #: Slots of one full segment file.
        self.slots_per_segment = self._geometry
        self.path = os.fspath(path)

        self._lock = threading.Lock()
        self._seg_lock = threading.Lock()
        self._index: "OrderedDict[int, int]" = OrderedDict()
        self._free: List[int] = []
        self._pending: Dict[int, int] = {}
        self._pins: Dict[int, int] = {}
        self._dead: Set[int] = set()
        #: Hashes that left the index unasked since the last take_removed (an ordered set).
        self._removed: "OrderedDict[int, None]" = OrderedDict()
        self._removed_cap = max(4096, 2 * self.num_slots)
        self._files = _Files()
        self._segments = self._files.segments
        self._stats = TierStats()
        self._closed = False

        self._files.dir_fd = open_private_dir(self.path)
        try:
            self._files.lock_fd = open_private_file(self._files.dir_fd, self.path, LOCK_FILE, os.O_RDWR)
            try:
                fcntl.flock(self._files.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise InvalidConfigError(
                    f"cache directory {self.path!r} is in use by another DiskStore (its lock file is held)",
                    field="path", value=self.path, reason="locked",
                ) from None
            #: The key every record is authenticated with (``secret``, or the directory's own).
            if secret is None:
                secret = load_tier_secret() or load_or_create_tier_key(self.path)
            self.secret = secret
            try:
                self._scan()
            except OSError as exc:
                if isinstance(exc, (CacheIOError, UnsafePathError)):
                    raise
                raise CacheIOError(
                    f"cache directory {self.path!r} cannot be scanned: {exc.strerror or exc}",
                    path=self.path, errno=exc.errno, reason=str(exc),
                ) from None
        except BaseException:
            _release_files(self._files, None)
            raise
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pagedkv-disk")
        # The directory's lock goes with the store: a store nobody closed (an engine dropped
        # without shutdown) releases it when collected, not when the process exits.
        self._finalizer = weakref.finalize(self, _release_files, self._files, self._pool)

    def close(self) -> None:
        """Finish queued I/O, close the files and release the directory's lock. Idempotent.

        A store that is never closed releases them when it is garbage-collected."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._finalizer()

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"DiskStore({self.path!r}, slots={self.num_slots}, slot_bytes={self.slot_bytes}, "
            f"blocks={len(self)})"
        )

    # ------------------------------------------------- as a backend (pagedkv.tiers.store.BlockStore)

    #: The tier's name in the engine's figures, and its KV events' locality.
    name = "disk"
    locality = "LOCAL"

    # take_removed: with the eviction code above (it reports what this store evicted).

    @classmethod
    def from_config(cls, config: object, fingerprint: bytes, block_bytes: int) -> Optional["DiskStore"]:
        """The store ``config.disk_cache_dir`` / ``config.disk_cache_memory`` ask for, or None
        without a ``disk_cache_dir`` (the registry's factory, :mod:`pagedkv.tiers.store`); its
        records authenticated under :func:`~pagedkv.tiers.secret.secret_for_config`."""
        path = getattr(config, "disk_cache_dir", None)
        if path is None:
            return None
        return cls(path, int(getattr(config, "disk_cache_memory")), fingerprint, block_bytes,
                   secret=secret_for_config(config))
