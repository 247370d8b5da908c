"""The identity of a KV layout: what namespaces every tier below the host.

Owns :func:`fingerprint`, a 16-byte digest of everything that decides what a block's bytes mean —
model identity, dtype, block size, layout dimensions, tensor-parallel rank and size, and the record
format version. Two engines share blocks through a tier exactly when their fingerprints are equal;
a record carrying another fingerprint is foreign and never served.

Also owns the model identity an engine passes in: :func:`weights_digest` (a digest of the
checkpoint's *contents* — weight files, ``config.json`` and the tokenizer files that decide token
ids — not of its path, so new weights saved at the same path never read the old KV) and
:func:`model_identity`. Each file's digest is cached by ``(path, size, mtime_ns, ctime_ns, inode,
device)`` in a small JSON file (:func:`default_digest_cache`), so a restart does not re-read
gigabytes; a file rewritten in place changes its ``ctime`` (which ``utime`` cannot set back), so
it is read again.

Invariants: :func:`fingerprint` is a pure function of its arguments (stable across processes,
machines and Python versions: fields are encoded explicitly, never through ``hash()`` or
``repr``); dtype spellings are normalised (``"bf16"`` and ``"bfloat16"`` give one fingerprint);
the digest cache is trusted only when it is a regular file owned by the user and not writable by
group or others (else it is ignored and not written), and a broken cache only costs a re-read.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import struct
from typing import Any, Dict, List, Optional, Tuple

import xxhash

from ..config import normalize_dtype
from ..errors import InvalidArgumentError, InvalidConfigError
from .record import FINGERPRINT_BYTES, FORMAT_VERSION
from .secret import check_private_fd

__all__ = [
    "fingerprint",
    "fingerprint_for_spec",
    "weights_digest",
    "model_identity",
    "default_digest_cache",
    "WEIGHT_SUFFIXES",
    "IDENTITY_FILES",
]

_log = logging.getLogger("pagedkv")

_DOMAIN = b"pagedkv.tiers.fingerprint\x00"


def _positive(what: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(
            f"{what} must be an integer >= {minimum}, got {value!r}", what=what, value=value,
            reason=f"must be >= {minimum}",
        )
    return value


def _text(what: str, value: Any) -> bytes:
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(
            f"{what} must be a non-empty string, got {value!r}", what=what, value=value, reason="empty"
        )
    raw = value.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def fingerprint(
    model: str,
    dtype: str,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> bytes:
    """The 16-byte fingerprint (XXH3-128) of one engine's KV layout on one tensor-parallel rank.

    ``model`` should name the weights exactly: :func:`model_identity` of the checkpoint (a digest
    of its contents), or a hub id with its revision. Two different checkpoints under one name would
    read each other's blocks.
    """
    try:
        dtype_name = normalize_dtype(dtype)
    except InvalidConfigError:
        raise InvalidArgumentError(
            f"dtype {dtype!r} is not a KV dtype pagedkv knows", what="dtype", value=dtype,
            reason="unknown dtype",
        ) from None
    tp_size = _positive("tp_size", tp_size)
    tp_rank = _positive("tp_rank", tp_rank, 0)
    if tp_rank >= tp_size:
        raise InvalidArgumentError(
            f"tp_rank must be < tp_size ({tp_size}), got {tp_rank}", what="tp_rank", value=tp_rank,
            reason=f"must be < {tp_size}",
        )
    dims = struct.pack(
        "<IIIIIII",
        FORMAT_VERSION,
        _positive("block_size", block_size),
        _positive("num_layers", num_layers),
        _positive("num_kv_heads", num_kv_heads),
        _positive("head_dim", head_dim),
        tp_rank,
        tp_size,
    )
    digest = xxhash.xxh3_128_digest(_DOMAIN + _text("model", model) + _text("dtype", dtype_name) + dims)
    assert len(digest) == FINGERPRINT_BYTES
    return digest


def fingerprint_for_spec(model: str, spec: Any, tp_rank: int = 0, tp_size: int = 1) -> bytes:
    """:func:`fingerprint` of a :class:`pagedkv.config.CacheSpec` (its dtype, block size, dims)
    for the checkpoint ``model``, named by its contents (:func:`model_identity`: a path holding
    weights is their digest; anything else is used as given).

    An MLA spec (one latent per token) is told apart from a K/V spec of the same dims.
    """
    fp = fingerprint(
        model_identity(model) if isinstance(model, str) and model else model, spec.dtype, spec.block_size, spec.num_layers, spec.num_kv_heads, spec.head_dim, tp_rank, tp_size
    )
    if getattr(spec, "mla", False):
        fp = xxhash.xxh3_128_digest(b"mla\x00" + fp)
    return fp


#: Files whose bytes are the weights (a directory's, or a ``.gguf`` file itself).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: Other files of a checkpoint directory that change what KV a token id gets: the model's config
#: and the tokenizer files that decide the ids (a chat template or generation settings do not).
IDENTITY_FILES = (
    "config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt",
    "added_tokens.json", "special_tokens_map.json", "spiece.model", "sentencepiece.bpe.model",
)
_DIGEST_DOMAIN = b"pagedkv.tiers.weights\x00"
_CACHE_VERSION = 1
_CACHE_MAX_ENTRIES = 4096
_CHUNK = 16 << 20


def default_digest_cache() -> str:
    """Where :func:`weights_digest` caches file digests: ``$XDG_CACHE_HOME/pagedkv/`` (else
    ``~/.cache/pagedkv/``) ``weight-digests.json``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pagedkv", "weight-digests.json")


def _identity_files(path: str) -> List[str]:
    """The files :func:`weights_digest` reads for ``path`` (real paths, sorted); [] if none holds
    weights."""
    if os.path.isfile(path):
        return [path] if path.lower().endswith(WEIGHT_SUFFIXES) else []
    if not os.path.isdir(path):
        return []
    names = sorted(os.listdir(path))
    files = [os.path.join(path, n) for n in names
             if (n.lower().endswith(WEIGHT_SUFFIXES) or n in IDENTITY_FILES)
             and os.path.isfile(os.path.join(path, n))]
    if not any(f.lower().endswith(WEIGHT_SUFFIXES) for f in files):
        return []
    return files


def _stat_key(st: os.stat_result) -> List[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _file_digest(path: str) -> Tuple[str, List[int]]:
    """XXH3-128 of the file's bytes (hex) and the stat it was read under. A file that changes
    while it is read (its stat before and after differ) is read again."""
    for _ in range(3):
        with open(path, "rb") as fh:
            before = _stat_key(os.fstat(fh.fileno()))
            digest = xxhash.xxh3_128()
            while True:
                chunk = fh.read(_CHUNK)
                if not chunk:
                    break
                digest.update(chunk)
            after = _stat_key(os.fstat(fh.fileno()))
        if before == after:
            return digest.hexdigest(), after
    raise OSError(errno.EAGAIN, f"{path} keeps changing while it is read")


def _load_cache(cache_file: str) -> Optional[Dict[str, Any]]:
    """The cache's entries, ``{}`` if it does not exist, ``None`` if it must not be used."""
    try:
        fd = os.open(cache_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        _log.warning("weight digest cache %s not used: %s", cache_file, exc)
        return None
    try:
        check_private_fd(fd, cache_file)
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = json.loads(fh.read(64 << 20))
    except Exception as exc:  # noqa: BLE001 - an unusable cache only costs a re-read
        _log.warning("weight digest cache %s not used: %s", cache_file, exc)
        return None
    finally:
        os.close(fd)
    if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _save_cache(cache_file: str, entries: Dict[str, Any]) -> None:
    """Replace the cache file atomically (a private temporary file renamed over it)."""
    directory = os.path.dirname(cache_file) or "."
    tmp = os.path.join(directory, f".{os.path.basename(cache_file)}.{secrets.token_hex(6)}")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        while len(entries) > _CACHE_MAX_ENTRIES:
            entries.pop(next(iter(entries)))
        body = json.dumps({"version": _CACHE_VERSION, "entries": entries}).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        os.replace(tmp, cache_file)
    except OSError as exc:
        _log.debug("weight digest cache %s not written: %s", cache_file, exc)
        try:
            os.unlink(tmp)
        except OSError:
            pass


def weights_digest(path: str, *, cache_file: Optional[str] = None) -> Optional[bytes]:
    """A 16-byte digest of the checkpoint at ``path`` (a directory or a ``.gguf`` file): its
    weight files (:data:`WEIGHT_SUFFIXES`) and :data:`IDENTITY_FILES`, by name, size and content.

    ``None`` when ``path`` holds no weight file (the caller falls back to the name). File digests
    are cached in ``cache_file`` (default :func:`default_digest_cache`; ``""``: no cache) under
    each file's real path, size, mtime, ctime, inode and device.
    """
    if not isinstance(path, str) or not path:
        raise InvalidArgumentError(
            f"path must be a non-empty string, got {path!r}", what="path", value=path, reason="empty"
        )
    files = _identity_files(os.path.realpath(path))
    if not files:
        return None
    cache_path = default_digest_cache() if cache_file is None else cache_file
    cache = _load_cache(cache_path) if cache_path else None
    writable = cache is not None
    entries: Dict[str, Any] = cache if cache is not None else {}
    changed = False
    top = xxhash.xxh3_128()
    top.update(_DIGEST_DOMAIN)
    for f in files:
        real = os.path.realpath(f)  # a hub snapshot links each file to its blob
        st = _stat_key(os.stat(real))
        entry = entries.get(real)
        if isinstance(entry, dict) and entry.get("stat") == st and isinstance(entry.get("digest"), str):
            digest = entry["digest"]
        else:
            digest, st = _file_digest(real)
            entries.pop(real, None)
            entries[real] = {"stat": st, "digest": digest}
            changed = True
        name = os.path.basename(f).encode("utf-8")
        top.update(struct.pack("<IQ", len(name), st[0]) + name + bytes.fromhex(digest))
    if changed and writable and cache_path:
        _save_cache(cache_path, entries)
    return top.digest()


def model_identity(model: str, *, cache_file: Optional[str] = None) -> str:
    """What :func:`fingerprint` should get as ``model`` for the checkpoint ``model``: the digest of
    its contents (``"weights:<hex>"``, the path left out, so one checkpoint at two paths shares
    blocks and two at one path do not), or ``model`` itself when it holds no weight file."""
    digest = weights_digest(model, cache_file=cache_file)
    return model if digest is None else f"weights:{digest.hex()}"
