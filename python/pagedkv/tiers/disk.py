"""The disk tier: KV blocks in preallocated segment files on a local file system.

Owns :class:`DiskStore` (one cache directory) and :func:`load_or_create_hash_key` (the prefix-hash
key a restarted engine must reuse for its blocks to be found again).

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

**Invariants.** I/O errors, corruption, truncation and foreign records are misses counted in
:meth:`DiskStore.stats`, never exceptions; bad arguments raise
:class:`~pagedkv.errors.InvalidConfigError` / :class:`~pagedkv.errors.InvalidArgumentError` and
change nothing. The directory is 0700 and every file in it 0600. One store at a time owns a
directory (an exclusive ``flock`` on its ``lock`` file); tensor-parallel ranks use one directory each.
"""

from __future__ import annotations

import errno
import fcntl
import heapq
import os
import re
import secrets
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

from ..errors import InvalidArgumentError, InvalidConfigError
from .record import (
    CHECKSUM_BYTES,
    FINGERPRINT_BYTES,
    HEADER_BYTES,
    BlockMeta,
    Buffer,
    Reason,
    StoreClosedError,
    TierStats,
    as_byte_view,
    encode_parts,
    parse_header,
    record_size,
    verify_split,
)

__all__ = ["DiskStore", "load_or_create_hash_key", "SLOT_ALIGN", "SEGMENT_BYTES", "HASH_KEY_FILE"]

#: Slot size granularity: the file system's page, so a slot never shares a page with another.
SLOT_ALIGN = 4096
#: Target size of one segment file (at least one slot).
SEGMENT_BYTES = 256 << 20
#: Name of the hash-key file :func:`load_or_create_hash_key` keeps in the cache directory.
HASH_KEY_FILE = "hash.key"

_SEGMENT_RE = re.compile(r"^seg-(\d+)x(\d+)-(\d{5})\.pkv$")
_PathLike = Union[str, "os.PathLike[str]"]


def _check_int(field: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidConfigError(
            f"{field} must be an integer >= {minimum}, got {value!r}", field=field, value=value,
            reason=f"must be >= {minimum}",
        )
    return value


def _make_private_dir(path: str) -> None:
    """Create ``path`` (and parents) if needed and make it 0700; InvalidConfigError if impossible."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        if not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
        os.chmod(path, 0o700)
    except OSError as exc:
        raise InvalidConfigError(
            f"cache directory {path!r} cannot be created or made private (0700): {exc.strerror or exc}",
            field="path", value=path, reason=str(exc),
        ) from None


def _open_private(path: str, flags: int) -> int:
    fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
    except OSError:
        os.close(fd)
        raise
    return fd


def load_or_create_hash_key(path: _PathLike) -> int:
    """The 64-bit prefix-hash key kept in the cache directory ``path``, created on first use.

    The key file (:data:`HASH_KEY_FILE`, 0600, 16 hex digits) is written to a temporary name and
    linked into place, so two processes racing to create it agree on one key. A key file that does
    not hold a key raises :class:`~pagedkv.errors.InvalidConfigError` naming it: silently making a
    new key would turn every stored block into a miss.
    """
    root = os.fspath(path)
    _make_private_dir(root)
    key_path = os.path.join(root, HASH_KEY_FILE)
    if not os.path.exists(key_path):
        tmp = os.path.join(root, f".{HASH_KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = _open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.write(fd, f"{secrets.randbits(64):016x}\n".encode())
        finally:
            os.close(fd)
        try:
            os.link(tmp, key_path)
        except FileExistsError:
            pass  # another process linked its key first; everyone reads that one
        finally:
            os.unlink(tmp)
    try:
        fd = os.open(key_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, 0o600)
            text = os.read(fd, 64).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
    except OSError as exc:
        raise InvalidConfigError(
            f"hash key file {key_path!r} cannot be read: {exc.strerror or exc}", field="path",
            value=key_path, reason=str(exc),
        ) from None
    if not re.fullmatch(r"[0-9a-f]{16}", text):
        raise InvalidConfigError(
            f"hash key file {key_path!r} does not hold a key (16 hex digits), got {text[:32]!r}",
            field="path", value=key_path, reason="malformed key file",
        )
    return int(text, 16)


class DiskStore:
    """KV blocks of one layout (``fingerprint``) in the directory ``path``, at most ``capacity_bytes``.

    Args:
        path: The cache directory (created 0700).
        capacity_bytes: Disk space the segment files may take; at least one slot.
        fingerprint: :func:`pagedkv.tiers.fingerprint.fingerprint` of the engine's layout.
        block_bytes: Bytes of one block (``CacheSpec.bytes_per_block``); every payload has this size.
        threads: Worker threads for the I/O.
        max_tokens: Token ids a record may carry (the block size); sizes the slots.
    """

    def __init__(
        self,
        path: _PathLike,
        capacity_bytes: int,
        fingerprint: bytes,
        block_bytes: int,
        *,
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
        _make_private_dir(self.path)

        self._lock = threading.Lock()
        self._seg_lock = threading.Lock()
        self._index: "OrderedDict[int, int]" = OrderedDict()
        self._free: List[int] = []
        self._pending: Dict[int, int] = {}
        self._pins: Dict[int, int] = {}
        self._dead: Set[int] = set()
        self._segments: Dict[int, int] = {}
        self._stats = TierStats()
        self._closed = False

        self._lock_fd = _open_private(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise InvalidConfigError(
                f"cache directory {self.path!r} is in use by another DiskStore (its lock file is held)",
                field="path", value=self.path, reason="locked",
            ) from None
        try:
            self._scan()
        except BaseException:
            self._close_files()
            raise
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pagedkv-disk")

    # ---------------------------------------------------------------- geometry and start-up scan

    def _segment_name(self, k: int) -> str:
        return os.path.join(self.path, f"seg-{self.slot_bytes}x{self._geometry}-{k:05d}.pkv")

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
                    fd = _open_private(self._segment_name(k), os.O_RDWR | os.O_CREAT)
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
        for name in sorted(os.listdir(self.path)):
            m = _SEGMENT_RE.match(name)
            if not m:
                continue
            full = os.path.join(self.path, name)
            k = int(m.group(3))
            if int(m.group(1)) != self.slot_bytes or int(m.group(2)) != self._geometry or k >= num_segments:
                # Another block size's or capacity's files: their slots cannot be addressed here,
                # and they would count against the disk.
                self._stats.foreign += 1
                _unlink_quietly(full)
                continue
            found[k] = full
        indexed: Set[int] = set()
        for k, full in sorted(found.items()):
            try:
                fd = _open_private(full, os.O_RDWR)
            except OSError:
                self._stats.errors += 1
                _unlink_quietly(full)
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
                _unlink_quietly(full)
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
                return slot
        return None

    def _release(self, slot: int) -> None:
        if slot in self._pins:
            self._dead.add(slot)
        else:
            heapq.heappush(self._free, slot)

    def _forget(self, block_hash: int, slot: int) -> None:
        """Drop a bad or removed block: its magic is zeroed first, so no restart indexes it again."""
        if self._index.get(block_hash) != slot:
            return
        del self._index[block_hash]
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
            prefix, body, checksum = encode_parts(self.fingerprint, meta, view)
            total = len(prefix) + body.nbytes + len(checksum)
            written = os.pwritev(fd, [prefix, body, checksum], offset)
            ok = written == total
        except OSError:
            ok = False
        with self._lock:
            del self._pending[h]
            if ok:
                self._index[h] = slot
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
        checksum = bytearray(CHECKSUM_BYTES)
        reason: Optional[Reason]
        read = 0
        try:
            fd, offset = self._locate(slot)
            read = os.preadv(fd, [prefix, body, checksum], offset)
            if read < len(prefix) + body.nbytes + CHECKSUM_BYTES:
                reason = Reason.TRUNCATED
            else:
                reason = verify_split(
                    prefix, body, checksum, fingerprint=self.fingerprint, block_hash=h,
                    token_ids=meta.token_ids, salt_digest=meta.salt_digest,
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
                    # Corrupt or foreign bytes under this hash: the slot is free space. A mismatch
                    # (another tenant's salt, a collision) is a valid block for someone else.
                    self._forget(h, slot)
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
        """Finish queued I/O, close the files and release the directory's lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._close_files()

    def _close_files(self) -> None:
        for fd in self._segments.values():
            os.close(fd)
        self._segments.clear()
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(self._lock_fd)

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

    def take_removed(self) -> List[int]:
        """Hashes of the blocks evicted since the last call (not recorded yet: ``[]``)."""
        return []

    @classmethod
    def from_config(cls, config: object, fingerprint: bytes, block_bytes: int) -> Optional["DiskStore"]:
        """The store ``config.disk_cache_dir`` / ``config.disk_cache_memory`` ask for, or None
        without a ``disk_cache_dir`` (the registry's factory, :mod:`pagedkv.tiers.store`)."""
        path = getattr(config, "disk_cache_dir", None)
        if path is None:
            return None
        return cls(path, int(getattr(config, "disk_cache_memory")), fingerprint, block_bytes)


def _preallocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes for ``fd`` (a file system without fallocate gets a sparse file)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
