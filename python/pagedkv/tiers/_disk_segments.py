"""The disk tier's segment files: slot geometry, locating a slot, and the start-up scan.

Owns ``_DiskSegments``, the base of :class:`~pagedkv.tiers.disk.DiskStore`: the store's state
(declared here, set by ``DiskStore.__init__``), segment naming (``seg-<slot bytes>x<slots>-<index>.pkv``),
``_locate`` (a slot's descriptor and offset, creating and preallocating its segment on first use) and
``_scan`` (the index rebuilt from the slots' headers when a store opens its directory).

**Invariants.** A segment is opened through the ownership and link checks of
:mod:`pagedkv.tiers.secret` and preallocated at its full size; segments of another slot geometry or
beyond the capacity are deleted at start-up (counted ``foreign``); a slot whose header is unreadable,
of another fingerprint or of another block size is free space. Segment descriptors are created under
``_seg_lock`` and never closed before the store is.
"""

from __future__ import annotations

import heapq
import os
import re
import threading
from collections import OrderedDict
from typing import Dict, List, Set, Tuple

from ..errors import CacheIOError
from ._disk_files import _Files, _preallocate, _unlink_quietly
from .record import HEADER_BYTES, TierStats, parse_header
from .secret import TierSecret, open_private_file

_SEGMENT_RE = re.compile(r"^seg-(\d+)x(\d+)-(\d{5})\.pkv$")


class _DiskSegments:
    """The store's state and its segment files (geometry, location, start-up scan)."""

    # The store's state, set by DiskStore.__init__ (declared here for the mixins that use it).
    path: str
    fingerprint: bytes
    block_bytes: int
    max_tokens: int
    slot_bytes: int
    num_slots: int
    secret: TierSecret
    _geometry: int
    _lock: threading.Lock
    _seg_lock: threading.Lock
    _index: "OrderedDict[int, int]"
    _free: List[int]
    _pending: Dict[int, int]
    _pins: Dict[int, int]
    _dead: Set[int]
    _removed: "OrderedDict[int, None]"
    _removed_cap: int
    _files: _Files
    _segments: Dict[int, int]
    _stats: TierStats
    _closed: bool

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
