"""The tier secret and the file-safety rules of the tiers below the host.

Owns :class:`TierSecret` (the key that authenticates every disk and remote tier record: an
HMAC-SHA256 key derived from a fleet secret), :func:`load_tier_secret` (where a fleet secret comes
from: the ``PAGEDKV_TIER_SECRET`` environment variable or a file, never argv), and the checks every
file the tiers trust must pass (:func:`open_private_dir`, :func:`open_private_file`,
:func:`check_private_fd`).

The tier secret is not the prefix-hash key: routers hold the hash key (to compute the hashes
replicas publish), and a party that can compute hashes must still not be able to write a record a
replica would serve. Only engines hold the tier secret.

Invariants:

* a file or directory is trusted only if it is owned by the process's effective user, is not
  writable by group or others (a secret file: no group/other access at all), is not a symbolic
  link and, for files, has no other hard link (``st_nlink == 1``); anything else raises
  :class:`~pagedkv.errors.UnsafePathError` before a byte is read from it or written through it;
* checks are made on the open descriptor (``fstat``), and files inside a cache directory are
  opened relative to the directory's descriptor with ``O_NOFOLLOW``, so a path swapped between the
  check and the use is never followed;
* an ``OSError`` while preparing a cache directory or its files surfaces as
  :class:`~pagedkv.errors.CacheIOError` (a full disk, a read-only file system), never bare;
* a :class:`TierSecret` never shows its key (``repr`` gives the source and a key id: a one-way
  digest operators may compare across a fleet).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import stat
from typing import Mapping, Optional

from ..errors import CacheIOError, InvalidConfigError, TierSecretError, UnsafePathError

__all__ = [
    "ENV_VAR",
    "MIN_SECRET_BYTES",
    "TierSecret",
    "load_tier_secret",
    "secret_for_config",
    "open_private_dir",
    "open_private_file",
    "check_private_fd",
    "create_secret_file",
]

#: The environment variable a fleet secret is read from.
ENV_VAR = "PAGEDKV_TIER_SECRET"
#: Shortest accepted secret, in bytes (after surrounding whitespace is stripped). ``openssl rand
#: -hex 32`` gives 64.
MIN_SECRET_BYTES = 32
_MAX_SECRET_BYTES = 4096
_DERIVE = b"pagedkv.tiers.record-mac.v2"


class TierSecret:
    """An HMAC-SHA256 key for tier records, derived from a fleet secret.

    Args:
        secret: The fleet secret (at least :data:`MIN_SECRET_BYTES` bytes).
        source: Where it came from, for messages (``"env PAGEDKV_TIER_SECRET"``, a path).
    """

    __slots__ = ("_key", "source", "key_id")

    def __init__(self, secret: bytes, source: str = "argument") -> None:
        if not isinstance(secret, (bytes, bytearray)):
            raise TierSecretError(
                f"tier secret from {source} must be bytes, got {type(secret).__name__}",
                field="secret", value=source, reason="not bytes",
            )
        raw = bytes(secret).strip()
        if len(raw) < MIN_SECRET_BYTES:
            raise TierSecretError(
                f"tier secret from {source} has {len(raw)} bytes; at least {MIN_SECRET_BYTES} "
                f"are needed (e.g. `openssl rand -hex 32`)", field="secret", value=source,
                reason=f"shorter than {MIN_SECRET_BYTES} bytes",
            )
        self._key = hmac.digest(raw, _DERIVE, "sha256")
        self.source = source
        #: A one-way digest of the key, safe to log: engines of one fleet show the same id.
        self.key_id = hmac.digest(self._key, b"key id", "sha256")[:8].hex()

    def mac(self) -> "hmac.HMAC":
        """A fresh HMAC-SHA256 under this key (``update`` the record, then ``digest``)."""
        return hmac.new(self._key, digestmod=hashlib.sha256)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TierSecret):
            return NotImplemented
        return hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(self.key_id)

    def __repr__(self) -> str:
        return f"TierSecret(source={self.source!r}, key_id={self.key_id})"

    def __reduce__(self) -> object:
        # A secret is never pickled (a config object crossing a process boundary, a log dump).
        raise TypeError("a TierSecret cannot be pickled; load it in each process")


def _io_error(path: str, exc: OSError, what: str) -> CacheIOError:
    return CacheIOError(
        f"{what} {path!r}: {exc.strerror or exc}", path=path, errno=exc.errno,
        reason=errno.errorcode.get(exc.errno or 0, str(exc)),
    )


def check_private_fd(fd: int, path: str, *, kind: str = "file", secret: bool = False) -> os.stat_result:
    """``fstat(fd)`` if the open ``path`` is safe to trust (module docs), else UnsafePathError."""
    st = os.fstat(fd)
    want_dir = kind == "directory"
    if want_dir and not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{path!r} is not a directory", path=path, reason="not a directory")
    if not want_dir and not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(f"{path!r} is not a regular file", path=path, reason="not a regular file")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UnsafePathError(
            f"{path!r} is owned by uid {st.st_uid}, not by this process's user (uid {uid}): refused",
            path=path, reason=f"owned by uid {st.st_uid}",
        )
    mode = stat.S_IMODE(st.st_mode)
    forbidden = 0o077 if secret else 0o022
    if mode & forbidden:
        what = "accessible" if secret else "writable"
        raise UnsafePathError(
            f"{path!r} has mode {mode:04o}: {what} by group or others, refused "
            f"(chmod {'600' if not want_dir else '700'} it)", path=path,
            reason=f"mode {mode:04o}",
        )
    if not want_dir and st.st_nlink != 1:
        raise UnsafePathError(
            f"{path!r} has {st.st_nlink} hard links: a write would reach a file elsewhere, refused",
            path=path, reason=f"{st.st_nlink} hard links",
        )
    return st


def open_private_dir(path: str) -> int:
    """An ``O_DIRECTORY`` descriptor of ``path``, created 0700 (with missing parents) if absent.

    Refused (:class:`~pagedkv.errors.UnsafePathError`): a symbolic link, a directory not owned by
    this user or writable by group/others; a file in its place is an
    :class:`~pagedkv.errors.InvalidConfigError`. An existing safe directory is tightened to 0700. An
    ``OSError`` (a read-only file system, a full disk) raises :class:`~pagedkv.errors.CacheIOError`.
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # a file or a dangling link: the open below says which
    except OSError as exc:
        raise _io_error(path, exc, "cache directory cannot be created:") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            if os.path.islink(path):
                raise UnsafePathError(f"cache directory {path!r} is a symbolic link: refused",
                                      path=path, reason="symlink") from None
            raise InvalidConfigError(
                f"cache directory {path!r} is not a directory", field="path", value=path,
                reason="not a directory",
            ) from None
        raise _io_error(path, exc, "cache directory cannot be opened:") from None
    try:
        check_private_fd(fd, path, kind="directory")
        os.fchmod(fd, 0o700)
    except UnsafePathError:
        os.close(fd)
        raise
    except OSError as exc:
        os.close(fd)
        raise _io_error(path, exc, "cache directory cannot be made private (0700):") from None
    return fd


def open_private_file(dir_fd: int, dir_path: str, name: str, flags: int, *, create: bool = True) -> int:
    """Open ``name`` inside the directory ``dir_fd``: created 0600 with ``O_EXCL`` if absent (and
    ``create``), else opened with ``O_NOFOLLOW`` and checked (:func:`check_private_fd`).

    ``FileNotFoundError`` passes through when ``create`` is false and the file is absent.
    """
    path = os.path.join(dir_path, name)
    base = flags | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = -1
    try:
        if create:
            try:
                fd = os.open(name, base | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
            except FileExistsError:
                fd = -1
        if fd < 0:
            fd = os.open(name, base & ~os.O_CREAT, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
        raise _io_error(path, FileNotFoundError(errno.ENOENT, "vanished while opened"), "cannot open")
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"{path!r} is a symbolic link: refused", path=path,
                                  reason="symlink") from None
        raise _io_error(path, exc, "cannot open") from None
    try:
        check_private_fd(fd, path)
        os.fchmod(fd, 0o600)
    except UnsafePathError:
        os.close(fd)
        raise
    except OSError as exc:
        os.close(fd)
        raise _io_error(path, exc, "cannot make private (0600):") from None
    return fd


def create_secret_file(dir_fd: int, dir_path: str, name: str, data: bytes) -> bool:
    """Write ``data`` to a new 0600 file ``name`` in ``dir_fd`` (``O_EXCL | O_NOFOLLOW``), in one
    write; ``False`` if it already exists (another process created it first)."""
    path = os.path.join(dir_path, name)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=dir_fd)
    except FileExistsError:
        return False
    except OSError as exc:
        raise _io_error(path, exc, "cannot create") from None
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, "short write")
    except OSError as exc:
        os.close(fd)
        # A half-written key must not be read as a key by the next start.
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass
        raise _io_error(path, exc, "cannot write") from None
    os.close(fd)
    return True


def _read_secret_file(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"tier secret file {path!r} is a symbolic link: refused",
                                  path=path, reason="symlink") from None
        raise TierSecretError(
            f"tier secret file {path!r} cannot be opened: {exc.strerror or exc}",
            field="tier_secret_file", value=path, reason=str(exc.strerror or exc),
        ) from None
    try:
        check_private_fd(fd, path, secret=True)
        data = os.read(fd, _MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_SECRET_BYTES:
        raise TierSecretError(
            f"tier secret file {path!r} is larger than {_MAX_SECRET_BYTES} bytes",
            field="tier_secret_file", value=path, reason="too large",
        )
    return data


def load_tier_secret(path: Optional[str] = None, *,
                     environ: Optional[Mapping[str, str]] = None) -> Optional[TierSecret]:
    """The fleet's tier secret: from the file ``path`` if given (owned by this user, mode 0600 or
    0400, not a link), else from the environment variable :data:`ENV_VAR`; ``None`` if neither.

    Raises :class:`~pagedkv.errors.TierSecretError` (unreadable, too short) or
    :class:`~pagedkv.errors.UnsafePathError` (the file's owner, mode or links).
    """
    if path is not None:
        return TierSecret(_read_secret_file(os.fspath(path)), source=f"file {path}")
    env = os.environ if environ is None else environ
    value = env.get(ENV_VAR)
    if value is None or value == "":
        return None
    return TierSecret(value.encode("utf-8", "surrogateescape"), source=f"env {ENV_VAR}")


def secret_for_config(config: object) -> Optional[TierSecret]:
    """:func:`load_tier_secret` of an engine config's ``tier_secret_file`` (the environment
    without one): what a store built from a config authenticates its records with."""
    return load_tier_secret(getattr(config, "tier_secret_file", None))
