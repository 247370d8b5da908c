"""The disk tier's files outside the segments: its key files, its lock and the descriptors it holds.

Owns :func:`load_or_create_hash_key` / :func:`load_or_create_tier_key` (the directory's key files,
created once with ``O_EXCL`` and shared by every process that opens the directory), the names of the
directory's fixed files (:data:`HASH_KEY_FILE`, :data:`TIER_KEY_FILE`, :data:`LOCK_FILE`), the
descriptor set a :class:`~pagedkv.tiers.disk.DiskStore` holds (``_Files``) and its release, and the
preallocation and quiet unlinking of segment files.

**Invariants.** Every file is opened relative to the directory's descriptor through
:mod:`pagedkv.tiers.secret`'s ownership and link checks (``open_private_dir`` / ``open_private_file``;
none are repeated here). A key file that does not hold a key raises
:class:`~pagedkv.errors.InvalidConfigError`; one that cannot be read raises
:class:`~pagedkv.errors.CacheIOError`. ``_release_files`` closes each descriptor once and never waits
for the I/O pool (the collector may run it on one of the pool's threads).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Optional, Union

from ..errors import CacheIOError, InvalidConfigError
from .secret import TierSecret, create_secret_file, open_private_dir, open_private_file

__all__ = [
    "load_or_create_hash_key",
    "load_or_create_tier_key",
    "HASH_KEY_FILE",
    "TIER_KEY_FILE",
    "LOCK_FILE",
]

#: Name of the hash-key file :func:`load_or_create_hash_key` keeps in the cache directory.
HASH_KEY_FILE = "hash.key"
#: Name of the tier secret a store keeps in its directory when it is given none.
TIER_KEY_FILE = "tier.key"
#: Name of the file whose ``flock`` says which store owns the directory.
LOCK_FILE = "lock"
#: How long a reader waits for a key file another process has created but not yet written.
_KEY_WAIT_S = 1.0

_PathLike = Union[str, "os.PathLike[str]"]


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
