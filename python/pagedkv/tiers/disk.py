"""The disk tier: KV blocks in preallocated segment files on a local file system.

Owns :class:`DiskStore` (one cache directory), :func:`load_or_create_hash_key` (the prefix-hash
key a restarted engine must reuse for its blocks to be found again) and
:func:`load_or_create_tier_key` (the directory's own tier secret, when the engine is given none).

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

import errno
import fcntl
import heapq
import os
import re
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

from ..errors import CacheIOError, InvalidArgumentError, InvalidConfigError, UnsafePathError
from .record import (
    FINGERPRINT_BYTES,
    HEADER_BYTES,
    BlockMeta,
    Buffer,
    Reason,
    StoreClosedError,
    TierStats,
    TRAILER_BYTES,
    as_byte_view,
    encode_parts,
    parse_header,
    record_size,
    verify_split,
)
from .secret import (
    TierSecret,
    create_secret_file,
    load_tier_secret,
    open_private_dir,
    open_private_file,
    secret_for_config,
)

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
#: Name of the hash-key file :func:`load_or_create_hash_key` keeps in the cache directory.
HASH_KEY_FILE = "hash.key"
#: Name of the tier secret a store keeps in its directory when it is given none.
TIER_KEY_FILE = "tier.key"
#: Name of the file whose ``flock`` says which store owns the directory.
LOCK_FILE = "lock"
#: How long a reader waits for a key file another process has created but not yet written.
_KEY_WAIT_S = 1.0

_SEGMENT_RE = re.compile(r"^seg-(\d+)x(\d+)-(\d{5})\.pkv$")
_PathLike = Union[str, "os.PathLike[str]"]


def _check_int(field: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidConfigError(
            f"{field} must be an integer >= {minimum}, got {value!r}", field=field, value=value,
            reason=f"must be >= {minimum}",
        )
    return value


def _load_or_create_key(path: str, name: str, make: bytes, pattern: str) -> str:
    """The text of the key file ``name`` in the cache directory ``path``, created with ``make``
    (``O_EXCL | O_NOFOLLOW``, 0600, one write) if absent. A racing creator's file that is still
    empty is waited for (up to a second); one that does not match ``pattern`` raises
    InvalidConfigError naming it (silently making a new key would turn every block into a miss)."""
    key_path = os.path.join(path, name)
    dir_fd = open_private_dir(path)
    try:
        create_secret_file(dir_fd, path, name, make)
        deadline = time.monotonic() + _KEY_WAIT_S
        while True:
            fd = open_private_file(dir_fd, path, name, os.O_RDONLY, create=False)
            try:
                text = os.read(fd, 256).decode("ascii", "replace").strip()
            except OSError as exc:
                raise CacheIOError(
                    f"key file {key_path!r} cannot be read: {exc.strerror or exc}", path=key_path,
                    errno=exc.errno, reason=str(exc),
                ) from None
            finally:
                os.close(fd)
            if text or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
    except FileNotFoundError:
        raise CacheIOError(f"key file {key_path!r} vanished while it was read", path=key_path,
                           errno=errno.ENOENT, reason="vanished") from None
    finally:
        os.close(dir_fd)
    if not re.fullmatch(pattern, text):
        raise InvalidConfigError(
            f"key file {key_path!r} does not hold a key (expected {pattern}), got {text[:32]!r}",
            field="path", value=key_path, reason="malformed key file",
        )
    return text


def load_or_create_hash_key(path: _PathLike) -> int:
    """The 64-bit prefix-hash key kept in the cache directory ``path``, created on first use.

    The key file (:data:`HASH_KEY_FILE`, 0600, 16 hex digits) is created with ``O_EXCL`` and
    written in one write, so two processes racing to create it agree on one key. A key file that
    does not hold a key raises :class:`~pagedkv.errors.InvalidConfigError` naming it: silently
    making a new key would turn every stored block into a miss. The directory and the file must
    pass the ownership checks (:class:`~pagedkv.errors.UnsafePathError`).
    """
    text = _load_or_create_key(os.fspath(path), HASH_KEY_FILE,
                               f"{secrets.randbits(64):016x}\n".encode(), r"[0-9a-f]{16}")
    return int(text, 16)


def load_or_create_tier_key(path: _PathLike) -> TierSecret:
    """The tier secret a :class:`DiskStore` keeps in ``path`` (:data:`TIER_KEY_FILE`, 0600, 64 hex
    digits) when the engine gives it none, created on first use like the hash key."""
    root = os.fspath(path)
    text = _load_or_create_key(root, TIER_KEY_FILE, f"{secrets.token_hex(32)}\n".encode(),
                               r"[0-9a-f]{64}")
    return TierSecret(text.encode("ascii"), source=f"file {os.path.join(root, TIER_KEY_FILE)}")


class _Files:
    """The descriptors a store holds (directory, lock, segments): what its finalizer releases."""

    def __init__(self) -> None:
        self.dir_fd = -1
        self.lock_fd = -1
        self.segments: Dict[int, int] = {}


def _release_files(files: _Files, pool: Optional[ThreadPoolExecutor]) -> None:
    """Close every descriptor and unlock the directory (``close``, or the store's collection)."""
    if pool is not None:
        # Never waits: the collector may run this on one of the pool's own threads.
        pool.shutdown(wait=False)
    for fd in files.segments.values():
        os.close(fd)
    files.segments.clear()
    if files.lock_fd >= 0:
        try:
            fcntl.flock(files.lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(files.lock_fd)
            files.lock_fd = -1
    if files.dir_fd >= 0:
        os.close(files.dir_fd)
        files.dir_fd = -1


class DiskStore:
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

    # ---------------------------------------------------------------- geometry and start-up scan

    def _segment_name(self, k: int) -> str:
        """The file name (relative to the directory) of segment ``k``."""
        return f"seg-{self.slot_bytes}x{self._geometry}-{k:05d}.pkv"

    def _segment_slots(self, k: int) -> int:
        return min(self._geometry, self.num_slots - k * self._geometry)

    def _locate(self, slot: int) -> Tuple[int, int]:
        """``(fd, offset)`` of ``slot``, creating (and preallocating) its segment on first use."""
        k, i = divmod(slot, self._geometry)
        fd = self._segments.get(k)
        if fd is None:
            with self._seg_lock:
                fd = self._segments.get(k)
                if fd is None:
                    fd = open_private_file(self._files.dir_fd, self.path, self._segment_name(k), os.O_RDWR)
                    try:
                        _preallocate(fd, self._segment_slots(k) * self.slot_bytes)
                    except OSError:
                        os.close(fd)
                        raise
                    self._segments[k] = fd
        return fd, i * self.slot_bytes

    def _scan(self) -> None:
        num_segments = -(-self.num_slots // self._geometry)
        found: Dict[int, str] = {}
        dir_fd = self._files.dir_fd
        for name in sorted(os.listdir(dir_fd)):
            m = _SEGMENT_RE.match(name)
            if not m:
                continue
            k = int(m.group(3))
            if int(m.group(1)) != self.slot_bytes or int(m.group(2)) != self._geometry or k >= num_segments:
                # Another block size's or capacity's files: their slots cannot be addressed here,
                # and they would count against the disk.
                self._stats.foreign += 1
                _unlink_quietly(dir_fd, name)
                continue
            found[k] = name
        indexed: Set[int] = set()
        for k, name in sorted(found.items()):
            try:
                # A link (symbolic or hard) or another user's file among the segments is refused
                # (UnsafePathError): writing through it would reach a file elsewhere.
                fd = open_private_file(dir_fd, self.path, name, os.O_RDWR, create=False)
            except FileNotFoundError:
                continue
            except CacheIOError:
                self._stats.errors += 1
                _unlink_quietly(dir_fd, name)
                continue
            want = self._segment_slots(k) * self.slot_bytes
            try:
                size = os.fstat(fd).st_size
                if size > want:
                    os.ftruncate(fd, want)
                elif size < want:
                    _preallocate(fd, want)
            except OSError:
                self._stats.errors += 1
                os.close(fd)
                _unlink_quietly(dir_fd, name)
                continue
            self._segments[k] = fd
            base = k * self._geometry
            for i in range(self._segment_slots(k)):
                slot = base + i
                try:
                    head = os.pread(fd, HEADER_BYTES, i * self.slot_bytes)
                except OSError:
                    self._stats.errors += 1
                    continue
                header = parse_header(head)
                if header is None:
                    continue
                if header.fingerprint != self.fingerprint:
                    self._stats.foreign += 1
                    continue
                if (
                    header.payload_len != self.block_bytes
                    or header.token_count > self.max_tokens
                    or header.block_hash in self._index
                    # A record past the end of a truncated file cannot be whole.
                    or i * self.slot_bytes + header.record_size > size
                ):
                    continue
                self._index[header.block_hash] = slot
                indexed.add(slot)
        self._free = [s for s in range(self.num_slots) if s not in indexed]
        heapq.heapify(self._free)

    # ---------------------------------------------------------------- argument checks

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self!r} is closed", store=repr(self))

    def _check_meta(self, meta: Any) -> BlockMeta:
        self._check_open()
        if not isinstance(meta, BlockMeta):
            raise InvalidArgumentError(
                f"meta must be a pagedkv.tiers.BlockMeta, got {type(meta).__name__}", what="meta",
                value=type(meta).__name__, reason="not a BlockMeta",
            )
        if len(meta.token_ids) > self.max_tokens:
            raise InvalidArgumentError(
                f"a block of {len(meta.token_ids)} token ids exceeds this store's max_tokens "
                f"{self.max_tokens}", what="token_ids", value=len(meta.token_ids),
                reason=f"must be <= {self.max_tokens}",
            )
        return meta

    def _check_payload(self, data: Buffer, what: str = "data") -> memoryview:
        view = as_byte_view(data, what)
        if view.nbytes != self.block_bytes:
            raise InvalidArgumentError(
                f"{what} holds {view.nbytes} bytes; this store's blocks are {self.block_bytes} bytes",
                what=what, value=view.nbytes, reason=f"must be {self.block_bytes} bytes",
            )
        return view

    def _check_hash(self, block_hash: Any) -> int:
        if isinstance(block_hash, bool) or not isinstance(block_hash, int) or not 0 <= block_hash < 1 << 128:
            raise InvalidArgumentError(
                f"block hash must be an integer in [0, 2**128), got {block_hash!r}", what="block_hash",
                value=block_hash, reason="out of range",
            )
        return block_hash

    # ---------------------------------------------------------------- slots (under self._lock)

    def _take_slot(self) -> Optional[int]:
        if self._free:
            return heapq.heappop(self._free)
        for block_hash, slot in self._index.items():
            if slot not in self._pins:
                del self._index[block_hash]
                self._stats.evictions += 1
                self._note_removed(block_hash)
                return slot
        return None

    def _note_removed(self, block_hash: int) -> None:
        """Remember a hash that left the index unasked, for :meth:`take_removed` (bounded: the
        oldest are dropped when nobody drains them)."""
        self._removed[block_hash] = None
        self._removed.move_to_end(block_hash)
        while len(self._removed) > self._removed_cap:
            self._removed.popitem(last=False)

    def take_removed(self) -> List[int]:
        """The hashes this store evicted (overwritten to make room) or dropped as bad bytes
        since the last call, oldest first; a hash stored again meanwhile is not among them (it
        is present). Blocks dropped by :meth:`remove` are the caller's own and not reported."""
        with self._lock:
            out = list(self._removed)
            self._removed.clear()
            return out

    def _release(self, slot: int) -> None:
        if slot in self._pins:
            self._dead.add(slot)
        else:
            heapq.heappush(self._free, slot)

    def _forget(self, block_hash: int, slot: int, *, report: bool = False) -> None:
        """Drop a bad or removed block: its magic is zeroed first, so no restart indexes it again.
        ``report``: it leaves unasked (bad bytes), so :meth:`take_removed` reports it."""
        if self._index.get(block_hash) != slot:
            return
        del self._index[block_hash]
        if report:
            self._note_removed(block_hash)
        k, i = divmod(slot, self._geometry)
        fd = self._segments.get(k)
        if fd is not None:
            try:
                os.pwrite(fd, b"\0" * 4, i * self.slot_bytes)
            except OSError:
                self._stats.errors += 1
        self._release(slot)

    # ---------------------------------------------------------------- writes

    def _put_work(self, meta: BlockMeta, view: memoryview) -> bool:
        h = meta.block_hash
        with self._lock:
            if h in self._index:
                self._index.move_to_end(h)
                return True
            if h in self._pending:
                return True
            slot = self._take_slot()
            if slot is None:
                self._stats.dropped += 1
                return False
            self._pending[h] = slot
        written = 0
        try:
            fd, offset = self._locate(slot)
            prefix, body, trailer = encode_parts(self.fingerprint, meta, view, secret=self.secret)
            total = len(prefix) + body.nbytes + len(trailer)
            written = os.pwritev(fd, [prefix, body, trailer], offset)
            ok = written == total
        except OSError:
            ok = False
        with self._lock:
            del self._pending[h]
            if ok:
                self._index[h] = slot
                self._removed.pop(h, None)  # present again: no longer removed
                self._stats.puts += 1
                self._stats.bytes_written += written
            else:
                self._stats.errors += 1
                self._stats.dropped += 1
                heapq.heappush(self._free, slot)
        return ok

    def put(self, meta: BlockMeta, data: Buffer) -> bool:
        """Store one block (on the caller's thread); ``True`` once it is on disk (or already was).

        ``False`` when it could not be stored (every slot pinned by reads, an I/O error): counted,
        never raised.
        """
        return self._put_work(self._check_meta(meta), self._check_payload(data))

    def put_async(self, meta: BlockMeta, data: Buffer) -> "Future[bool]":
        """:meth:`put` on the thread pool. ``data`` must stay unchanged until the future is done.

        Arguments are checked here, on the caller's thread; the future never holds an exception.
        """
        return self._pool.submit(self._put_work, self._check_meta(meta), self._check_payload(data))

    # ---------------------------------------------------------------- reads

    def _get_work(self, meta: BlockMeta, out: Optional[memoryview]) -> Optional[memoryview]:
        h = meta.block_hash
        with self._lock:
            slot = self._index.get(h)
            if slot is None:
                self._stats.misses += 1
                return None
            self._index.move_to_end(h)
            self._pins[slot] = self._pins.get(slot, 0) + 1
        body = out if out is not None else memoryview(bytearray(self.block_bytes))
        prefix = bytearray(HEADER_BYTES + 4 * len(meta.token_ids))
        trailer = bytearray(TRAILER_BYTES)
        reason: Optional[Reason]
        read = 0
        try:
            fd, offset = self._locate(slot)
            read = os.preadv(fd, [prefix, body, trailer], offset)
            if read < len(prefix) + body.nbytes + TRAILER_BYTES:
                reason = Reason.TRUNCATED
            else:
                reason = verify_split(
                    prefix, body, trailer, fingerprint=self.fingerprint, block_hash=h,
                    token_ids=meta.token_ids, salt_digest=meta.salt_digest, secret=self.secret,
                )
        except OSError:
            reason = None
        with self._lock:
            pins = self._pins[slot] - 1
            if pins:
                self._pins[slot] = pins
            else:
                del self._pins[slot]
                if slot in self._dead:
                    self._dead.discard(slot)
                    heapq.heappush(self._free, slot)
            self._stats.bytes_read += read
            if reason is Reason.OK:
                self._stats.hits += 1
                return body
            self._stats.misses += 1
            if reason is None:
                self._stats.errors += 1
            else:
                counter = reason.counter
                setattr(self._stats, counter, getattr(self._stats, counter) + 1)
                if counter != "mismatched":
                    # Corrupt, forged or foreign bytes under this hash: the slot is free space. A
                    # mismatch (another tenant's salt, a collision) is a valid block for someone else.
                    self._forget(h, slot, report=True)
        return None

    def get(self, meta: BlockMeta) -> Optional[bytes]:
        """The block's bytes if stored and verified, else ``None`` (on the caller's thread).

        One copy more than :meth:`get_into`, which reads into the caller's buffer.
        """
        return self._get_bytes(self._check_meta(meta))

    def get_async(self, meta: BlockMeta) -> "Future[Optional[bytes]]":
        """:meth:`get` on the thread pool; the future never holds an exception."""
        meta = self._check_meta(meta)
        return self._pool.submit(self._get_bytes, meta)

    def _get_bytes(self, meta: BlockMeta) -> Optional[bytes]:
        view = self._get_work(meta, None)
        return None if view is None else bytes(view)

    def get_into(self, meta: BlockMeta, out: Buffer) -> bool:
        """Read the block straight into the writable ``block_bytes`` buffer ``out`` (a host slot).

        ``True`` when ``out`` now holds the verified block; on ``False`` its contents are unspecified.
        """
        view = self._check_out(out)
        return self._get_work(self._check_meta(meta), view) is not None

    def get_into_async(self, meta: BlockMeta, out: Buffer) -> "Future[bool]":
        """:meth:`get_into` on the thread pool; ``out`` must not be touched until the future is done."""
        view = self._check_out(out)
        meta = self._check_meta(meta)
        return self._pool.submit(lambda: self._get_work(meta, view) is not None)

    def _check_out(self, out: Buffer) -> memoryview:
        view = self._check_payload(out, "out")
        if view.readonly:
            raise InvalidArgumentError(
                "out must be a writable buffer", what="out", value=type(out).__name__, reason="read-only"
            )
        return view

    # ---------------------------------------------------------------- lookups and maintenance

    def contains(self, block_hash: int) -> bool:
        """Whether the block is stored (its bytes are checked only when read)."""
        self._check_open()
        h = self._check_hash(block_hash)
        with self._lock:
            return h in self._index

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        """How many of the leading ``hashes`` are stored."""
        self._check_open()
        checked = [self._check_hash(h) for h in hashes]
        with self._lock:
            n = 0
            for h in checked:
                if h not in self._index:
                    break
                n += 1
            return n

    def remove(self, block_hash: int) -> bool:
        """Drop one block; ``True`` if it was stored."""
        self._check_open()
        h = self._check_hash(block_hash)
        with self._lock:
            slot = self._index.get(h)
            if slot is None:
                return False
            self._forget(h, slot)
            return True

    def stats(self) -> TierStats:
        """A snapshot of the counters, with the blocks held and the space they use."""
        with self._lock:
            blocks = len(self._index)
            return replace(
                self._stats,
                blocks=blocks,
                usage_bytes=blocks * self.slot_bytes,
                capacity_bytes=self.num_slots * self.slot_bytes,
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

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


def _preallocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes for ``fd`` (a file system without fallocate gets a sparse file)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


def _unlink_quietly(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
