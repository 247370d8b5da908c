"""The disk tier's record I/O: block writes and verified reads, on the caller's thread or the pool.

Owns ``_DiskRecordIO``: ``put`` / ``put_async`` and ``get`` / ``get_async`` / ``get_into`` /
``get_into_async``, with the checks of their arguments (a :class:`~pagedkv.tiers.record.BlockMeta`
within ``max_tokens``, a payload of exactly ``block_bytes``, a writable ``out``).

**Invariants.** Arguments are checked on the caller's thread; the futures never hold an exception.
A block's I/O (``os.pwritev`` / ``os.preadv``, no intermediate copy) runs outside the index lock; a
slot being written is in no index entry until its write completed, and a slot being read is pinned.
A record that does not verify is a counted miss; corrupt, forged or foreign bytes free their slot,
while a mismatch (another tenant's salt) keeps it.
"""

from __future__ import annotations

import heapq
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from ..errors import InvalidArgumentError
from ._disk_index import _DiskIndex
from .record import (
    HEADER_BYTES,
    TRAILER_BYTES,
    BlockMeta,
    Buffer,
    Reason,
    as_byte_view,
    encode_parts,
    verify_split,
)


class _DiskRecordIO(_DiskIndex):
    """Writes and verified reads of a :class:`~pagedkv.tiers.disk.DiskStore`'s blocks."""

    _pool: ThreadPoolExecutor

    # ---------------------------------------------------------------- argument checks

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
                    group=meta.group,
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
