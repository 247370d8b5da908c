"""pagedkv's on-disk cache: converted models and measured rates, reused across runs.

Owns the cache root (:func:`cache_root`), the cheap digest of a model file (:func:`file_digest`),
atomic writes of whole directories (:func:`build_dir`) and of small JSON records
(:func:`write_json` / :func:`read_json`).

Where: ``$PAGEDKV_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/pagedkv``, else
``~/.cache/pagedkv``.

Invariants:

* every directory this module creates is mode 0700; a directory (the root or an entry) that is not
  owned by the current user, or that others may write, is never read from or written to — the
  caller falls back to working without the cache;
* an entry becomes visible only complete: it is built in a temporary sibling directory and renamed
  into place after its manifest (:data:`MANIFEST`, written last) records every file's size; an entry
  whose manifest is missing, unreadable, for another source, or whose files do not match it is
  deleted and rebuilt, never used;
* JSON records are written to a temporary file and renamed; a record that does not parse or does
  not validate reads as absent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
from typing import Any, Callable, Dict, Optional

__all__ = ["cache_root", "subdir", "file_digest", "build_dir", "read_json", "write_json", "MANIFEST",
           "CACHE_VERSION"]

log = logging.getLogger(__name__)

#: The file written last into a cache entry; its presence and content make the entry valid.
MANIFEST = "pagedkv-cache.json"
#: Bumped when the layout of entries changes: older entries are rebuilt.
CACHE_VERSION = 1

#: How much of a file :func:`file_digest` hashes: the first and last chunk, and this many between.
_CHUNK = 1 << 20
_SAMPLES = 8


def cache_root() -> str:
    """The cache's root directory (not created here)."""
    env = os.environ.get("PAGEDKV_CACHE_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pagedkv")


def _private(path: str) -> bool:
    """Whether ``path`` is a directory owned by this user that nobody else may write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return False
    return not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _ensure_private_dir(path: str) -> Optional[str]:
    """Creates ``path`` (mode 0700) if needed; returns it if it is private, else ``None``."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        log.warning("pagedkv cache: cannot create %s (%s); working without the cache", path, exc)
        return None
    if not _private(path):
        log.warning("pagedkv cache: %s is not a directory owned by this user and closed to others; "
                    "working without the cache", path)
        return None
    return path


def subdir(name: str) -> Optional[str]:
    """``cache_root()/name``, created private; ``None`` when the cache cannot be used."""
    root = _ensure_private_dir(cache_root())
    if root is None:
        return None
    return _ensure_private_dir(os.path.join(root, name))


def file_digest(path: str) -> str:
    """A cheap digest of a (large) file: its size, its mtime and a SHA-256 over its first and last
    MiB and :data:`_SAMPLES` MiB-sized chunks spread evenly between (the whole file when it is
    smaller than that). A file rewritten in place with the same size and mtime and different bytes
    only outside the sampled chunks would collide; a replaced or touched file does not."""
    st = os.stat(path)
    h = hashlib.sha256()
    h.update(f"{st.st_size}:{st.st_mtime_ns}:".encode())
    with open(path, "rb") as fh:
        size = st.st_size
        if size <= (_SAMPLES + 2) * _CHUNK:
            for block in iter(lambda: fh.read(_CHUNK), b""):
                h.update(block)
        else:
            step = (size - _CHUNK) // (_SAMPLES + 1)
            for i in range(_SAMPLES + 2):
                fh.seek(min(i * step, size - _CHUNK))
                h.update(fh.read(_CHUNK))
    return h.hexdigest()[:32]


def _valid_entry(path: str, source: str) -> bool:
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as fh:
            man = json.load(fh)
        if man.get("version") != CACHE_VERSION or man.get("source") != source:
            return False
        files = man["files"]
        if not isinstance(files, dict) or not files:
            return False
        for name, size in files.items():
            if os.path.basename(name) != name or not isinstance(size, int):
                return False
            if os.path.getsize(os.path.join(path, name)) != size:
                return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return _private(path)


def build_dir(kind: str, key: str, build: Callable[[str], None]) -> Optional[str]:
    """The cache entry ``cache_root()/kind/key``, built by ``build(tmp_dir)`` if it is absent or
    invalid; ``None`` when the cache cannot be used (then the caller works without it).

    ``build`` writes the entry's files into the directory it is given (flat, no subdirectories);
    the manifest is added after it returns and the directory renamed into place. An exception
    from ``build`` propagates, and nothing is left behind.
    """
    parent = subdir(kind)
    if parent is None:
        return None
    final = os.path.join(parent, key)
    if os.path.lexists(final):
        if _valid_entry(final, key):
            return final
        log.warning("pagedkv cache: %s is incomplete or corrupt; rebuilding it", final)
        _remove(final)
    tmp = tempfile.mkdtemp(prefix=f".{key}.", suffix=".tmp", dir=parent)  # mode 0700
    try:
        build(tmp)
        files = {n: os.path.getsize(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))
                 if os.path.isfile(os.path.join(tmp, n))}
        _write_file(os.path.join(tmp, MANIFEST), json.dumps(
            {"version": CACHE_VERSION, "source": key, "files": files}, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its own build into place first: use that one.
            if not _valid_entry(final, key):
                raise
            _remove(tmp)
    except BaseException:
        _remove(tmp)
        raise
    return final


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def _write_file(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def read_json(kind: str, key: str, validate: Callable[[Any], bool]) -> Optional[Dict[str, Any]]:
    """The record ``cache_root()/kind/key.json`` if it exists, parses and ``validate`` accepts it;
    else ``None`` (an invalid record is deleted)."""
    parent = subdir(kind)
    if parent is None:
        return None
    path = os.path.join(parent, f"{key}.json")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        data = None
    try:
        ok = isinstance(data, dict) and bool(validate(data))
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        log.warning("pagedkv cache: ignoring the invalid record %s", path)
        _remove(path)
        return None
    return data


def write_json(kind: str, key: str, data: Dict[str, Any]) -> Optional[str]:
    """Writes the record atomically; returns its path, or ``None`` when the cache is unusable."""
    parent = subdir(kind)
    if parent is None:
        return None
    path = os.path.join(parent, f"{key}.json")
    try:
        _write_file(path, json.dumps(data, indent=1, sort_keys=True))
    except OSError as exc:
        log.warning("pagedkv cache: cannot write %s (%s)", path, exc)
        return None
    return path
