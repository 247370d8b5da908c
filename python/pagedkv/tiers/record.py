"""The block record: how one KV block is laid out on disk and on the wire, and how it is verified.

Owns the record format shared by every tier below the host (:mod:`pagedkv.tiers.disk`,
:mod:`pagedkv.tiers.remote`), :class:`BlockMeta` (a block's identity), :class:`Reason` (why a
record was refused), :class:`TierStats` (the counters both stores report) and
:class:`StoreClosedError` (a store used after ``close``). Every record is authenticated: a keyed
MAC under the fleet's :class:`~pagedkv.tiers.secret.TierSecret` (not the prefix-hash key) covers
its identity and its payload, so a party that can write to a tier but does not hold the secret
cannot make a reader serve anything it did not write.

A record is, little-endian::

    header (88 bytes)      magic b"PKVB", version u16, flags u16, fingerprint (16 bytes),
                           block_hash u128, parent_hash u128, salt_digest u128,
                           token_count u32, group u32, payload_len u64
    token ids              token_count x u32
    payload                payload_len bytes, the host block verbatim
    checksum               XXH3-128 of header + token ids + payload (16 bytes)
    mac                    HMAC-SHA256 of header + token ids + payload under the tier secret
                           (32 bytes)

``group`` is the KV cache group whose block the record holds (0 for a model with one kind of
attention layer; a one-group record is byte for byte what it was before the field was named: the
old ``reserved`` word, always 0). With several groups, group ``g``'s block of chain hash ``h`` is
stored under its group's key (``block_hash`` is ``h`` mixed with ``g``, as the prefix cache keys
it) *and* names ``g`` here, under the MAC: a reader asking for group ``g'`` refuses it
(``GROUP_MISMATCH``), so a block of one group is never served as another's, even by a party that
can write the store and move records between keys (pages of every group have one size, so the
payload alone would not tell).

The checksum tells accidental damage (a torn write, bit rot: ``corrupt``) from a record that is
intact but not written under this secret (re-encoded, swapped between keys, another fleet's:
``unauthenticated``); only the MAC protects.

Invariants:

* :func:`decode` never returns bytes that did not verify: magic, version, fingerprint, hash,
  group, salt digest, token ids, lengths, the checksum and the MAC must all match what the caller
  expects, or the answer is ``None`` with the :class:`Reason` for the caller's counters;
* :func:`decode` never raises on the record's content (any byte string is a valid input); only a
  malformed *expectation* (a hash outside u128, a token id outside u32) raises
  :class:`~pagedkv.errors.InvalidArgumentError`;
* the payload is never copied by :func:`encode_parts`: a writer sends the prefix, the caller's
  payload buffer and the trailer (checksum and MAC) as three pieces (``os.pwritev``);
* no record is written or read without a :class:`~pagedkv.tiers.secret.TierSecret`; the MAC is
  compared in constant time.
"""

from __future__ import annotations

import enum
import hmac
import struct
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
import xxhash

from ..errors import InvalidArgumentError, PagedKVError
from .secret import TierSecret

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "CHECKSUM_BYTES",
    "MAC_BYTES",
    "TRAILER_BYTES",
    "FINGERPRINT_BYTES",
    "BlockMeta",
    "Header",
    "Reason",
    "TierStats",
    "record_size",
    "encode",
    "encode_into",
    "encode_parts",
    "parse_header",
    "decode",
    "decode_checked",
    "verify_split",
    "as_byte_view",
    "StoreClosedError",
]

MAGIC = b"PKVB"
#: Bumped whenever the layout above changes; it is also hashed into every fingerprint, so a new
#: format never reads an old one's records as its own.
FORMAT_VERSION = 2
FINGERPRINT_BYTES = 16
CHECKSUM_BYTES = 16
MAC_BYTES = 32
#: Checksum and MAC, after the payload.
TRAILER_BYTES = CHECKSUM_BYTES + MAC_BYTES
_FLAG_HAS_PARENT = 1
_U128 = 1 << 128
_U32_MAX = (1 << 32) - 1
_U64 = 1 << 64

# magic, version, flags, fingerprint, hash lo/hi, parent lo/hi, salt lo/hi, tokens, group, len
_HEADER = struct.Struct("<4sHH16sQQQQQQIIQ")
HEADER_BYTES = _HEADER.size
assert HEADER_BYTES == 88

Buffer = Union[bytes, bytearray, memoryview, Any]


class StoreClosedError(PagedKVError, RuntimeError):
    """A tier store (or fetcher) was used after :meth:`close`.

    Attributes: ``store`` (its ``repr``).
    """

    store: str

    field_names = ("store",)


class Reason(str, enum.Enum):
    """Why :func:`decode_checked` refused a record (``OK`` when it did not)."""

    OK = "ok"
    TRUNCATED = "truncated"
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    FOREIGN = "foreign"
    HASH_MISMATCH = "hash_mismatch"
    GROUP_MISMATCH = "group_mismatch"
    SALT_MISMATCH = "salt_mismatch"
    TOKENS_MISMATCH = "tokens_mismatch"
    LENGTH_MISMATCH = "length_mismatch"
    CHECKSUM = "checksum"
    UNAUTHENTICATED = "unauthenticated"

    @property
    def counter(self) -> str:
        """The :class:`TierStats` counter this reason increments."""
        if self is Reason.OK:
            return "hits"
        if self is Reason.FOREIGN:
            return "foreign"
        if self is Reason.UNAUTHENTICATED:
            return "unauthenticated"
        if self in (Reason.HASH_MISMATCH, Reason.GROUP_MISMATCH, Reason.SALT_MISMATCH,
                    Reason.TOKENS_MISMATCH):
            return "mismatched"
        return "corrupt"


def _check_u128(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(
            f"{what} must be an integer in [0, 2**128), got {value!r}", what=what, value=value,
            reason="not an integer",
        )
    number = int(value)
    if not 0 <= number < _U128:
        raise InvalidArgumentError(
            f"{what} must be in [0, 2**128), got {number}", what=what, value=number, reason="out of range"
        )
    return number


def _check_group(value: Any) -> int:
    """A KV cache group index (a u32), or InvalidArgumentError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not 0 <= int(value) <= _U32_MAX:
        raise InvalidArgumentError(
            f"group must be an integer in [0, {_U32_MAX}], got {value!r}", what="group",
            value=value, reason="not a u32",
        )
    return int(value)


def _token_array(token_ids: Any) -> np.ndarray:
    """``token_ids`` as a little-endian u32 array, or InvalidArgumentError naming the bad id."""
    try:
        arr = np.asarray(token_ids)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgumentError(
            f"token_ids must be a sequence of integers: {exc}", what="token_ids", value=token_ids,
            reason="not integers",
        ) from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgumentError(
            f"token_ids must be a flat sequence of integers, got dtype {arr.dtype} shape {arr.shape}",
            what="token_ids", value=token_ids, reason="not a flat integer sequence",
        )
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > _U32_MAX:
            bad = lo if lo < 0 else hi
            raise InvalidArgumentError(
                f"token id {bad} is outside [0, {_U32_MAX}]", what="token_ids", value=bad,
                reason="outside u32",
            )
    return np.ascontiguousarray(arr, dtype="<u4")


@dataclass(frozen=True, eq=False)
class BlockMeta:
    """A block's identity: its key (chained hash, mixed with its group's for a group other than
    0), its parent's, the tenant's salt digest, its tokens and its KV cache group.

    ``token_ids`` is normalised to a read-only little-endian u32 array. Two metas are equal when all
    five fields are.
    """

    block_hash: int
    parent_hash: Optional[int]
    salt_digest: int
    token_ids: np.ndarray = field(repr=False)
    #: The KV cache group whose block it is (0 without groups): a u32, written into the record.
    group: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_hash", _check_u128("block_hash", self.block_hash))
        if self.parent_hash is not None:
            object.__setattr__(self, "parent_hash", _check_u128("parent_hash", self.parent_hash))
        object.__setattr__(self, "salt_digest", _check_u128("salt_digest", self.salt_digest))
        object.__setattr__(self, "group", _check_group(self.group))
        tokens = _token_array(self.token_ids)
        if tokens is self.token_ids or tokens.base is not None:
            tokens = tokens.copy()
        tokens.setflags(write=False)
        object.__setattr__(self, "token_ids", tokens)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockMeta):
            return NotImplemented
        return (
            self.block_hash == other.block_hash
            and self.parent_hash == other.parent_hash
            and self.salt_digest == other.salt_digest
            and self.group == other.group
            and np.array_equal(self.token_ids, other.token_ids)
        )

    def __hash__(self) -> int:
        return hash((self.block_hash, self.parent_hash, self.salt_digest, self.group))


@dataclass(frozen=True)
class Header:
    """The fixed header of a record, as :func:`parse_header` reads it (no checksum checked)."""

    version: int
    fingerprint: bytes
    block_hash: int
    parent_hash: Optional[int]
    salt_digest: int
    token_count: int
    payload_len: int
    #: The KV cache group of the record's block (0 without groups).
    group: int = 0

    @property
    def record_size(self) -> int:
        return record_size(self.token_count, self.payload_len)


@dataclass
class TierStats:
    """Counters of one store since it was opened.

    ``hits``/``misses`` count lookups (``get``); a miss is also counted in ``corrupt`` (bad magic,
    version, lengths or checksum, truncated), ``foreign`` (another model's or layout's record),
    ``mismatched`` (hash, salt digest or token ids differ from the request's), ``errors`` (an I/O or
    server error), ``timeouts`` (the remote did not answer in time) or ``unauthenticated`` (an intact
    record whose MAC does not verify under this store's tier secret: forged, re-encoded, moved
    between keys, or another fleet's) when that is why.
    ``unavailable`` counts operations skipped without I/O while a failed remote backs off.
    ``usage_bytes``/``capacity_bytes`` are ``None`` where the store cannot know them (remote).
    """

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    foreign: int = 0
    mismatched: int = 0
    unauthenticated: int = 0
    errors: int = 0
    timeouts: int = 0
    unavailable: int = 0
    puts: int = 0
    dropped: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks: Optional[int] = None
    usage_bytes: Optional[int] = None
    capacity_bytes: Optional[int] = None


def record_size(token_count: int, payload_len: int) -> int:
    """Bytes of a record holding ``token_count`` tokens and a ``payload_len``-byte payload."""
    return HEADER_BYTES + 4 * token_count + payload_len + TRAILER_BYTES


def as_byte_view(data: Buffer, what: str = "data") -> memoryview:
    """A flat, C-contiguous byte view of ``data`` (bytes, bytearray, memoryview, numpy array...)."""
    try:
        view = memoryview(data)
    except TypeError:
        raise InvalidArgumentError(
            f"{what} must support the buffer protocol (bytes, bytearray, numpy array), got "
            f"{type(data).__name__}", what=what, value=type(data).__name__, reason="not a buffer",
        ) from None
    if not view.c_contiguous:
        raise InvalidArgumentError(
            f"{what} must be C-contiguous", what=what, value=type(data).__name__, reason="not contiguous"
        )
    return view.cast("B") if (view.format != "B" or view.ndim != 1) else view


def _fingerprint_bytes(fingerprint: bytes) -> bytes:
    if not isinstance(fingerprint, (bytes, bytearray)) or len(fingerprint) != FINGERPRINT_BYTES:
        raise InvalidArgumentError(
            f"fingerprint must be {FINGERPRINT_BYTES} bytes (pagedkv.tiers.fingerprint), got "
            f"{fingerprint!r}", what="fingerprint", value=fingerprint, reason="wrong length",
        )
    return bytes(fingerprint)


def _lohi(value: int) -> Tuple[int, int]:
    return value & (_U64 - 1), value >> 64


def _check_secret(secret: Any) -> TierSecret:
    if not isinstance(secret, TierSecret):
        raise InvalidArgumentError(
            f"secret must be a pagedkv.tiers.secret.TierSecret (records are authenticated), got "
            f"{type(secret).__name__}", what="secret", value=type(secret).__name__,
            reason="not a TierSecret",
        )
    return secret


def _trailer(secret: TierSecret, prefix: Buffer, body: Buffer) -> bytes:
    """Checksum and MAC of a record's prefix and payload."""
    digest = xxhash.xxh3_128()
    digest.update(prefix)
    digest.update(body)
    mac = secret.mac()
    mac.update(prefix)
    mac.update(body)
    return digest.digest() + mac.digest()


def encode_parts(
    fingerprint: bytes, meta: BlockMeta, payload: Buffer, *, secret: TierSecret
) -> Tuple[bytes, memoryview, bytes]:
    """``(prefix, payload, trailer)``: the record in three pieces, the payload not copied.

    ``prefix`` is the header and token ids, ``trailer`` the checksum and the MAC under ``secret``.
    Writing the three pieces back to back gives the record.
    """
    fp = _fingerprint_bytes(fingerprint)
    key = _check_secret(secret)
    if not isinstance(meta, BlockMeta):
        raise InvalidArgumentError(
            f"meta must be a pagedkv.tiers.BlockMeta, got {type(meta).__name__}", what="meta",
            value=type(meta).__name__, reason="not a BlockMeta",
        )
    body = as_byte_view(payload, "payload")
    tokens = meta.token_ids
    flags = 0 if meta.parent_hash is None else _FLAG_HAS_PARENT
    h_lo, h_hi = _lohi(meta.block_hash)
    p_lo, p_hi = _lohi(meta.parent_hash or 0)
    s_lo, s_hi = _lohi(meta.salt_digest)
    prefix = (
        _HEADER.pack(
            MAGIC, FORMAT_VERSION, flags, fp, h_lo, h_hi, p_lo, p_hi, s_lo, s_hi, len(tokens),
            meta.group, body.nbytes,
        )
        + tokens.tobytes()
    )
    return prefix, body, _trailer(key, prefix, body)


def encode_into(out: Buffer, fingerprint: bytes, meta: BlockMeta, payload: Buffer, *,
                secret: TierSecret) -> int:
    """Write the record at the start of the writable buffer ``out``; returns its size in bytes."""
    prefix, body, trailer = encode_parts(fingerprint, meta, payload, secret=secret)
    view = as_byte_view(out, "out")
    size = len(prefix) + body.nbytes + TRAILER_BYTES
    if view.readonly or view.nbytes < size:
        raise InvalidArgumentError(
            f"out must be a writable buffer of at least {size} bytes, got {view.nbytes} "
            f"({'read-only' if view.readonly else 'writable'})", what="out", value=view.nbytes,
            reason="too small or read-only",
        )
    n = len(prefix)
    view[:n] = prefix
    view[n : n + body.nbytes] = body
    view[n + body.nbytes : size] = trailer
    return size


def encode(fingerprint: bytes, meta: BlockMeta, payload: Buffer, *, secret: TierSecret) -> bytes:
    """The record as one byte string (one copy of the payload)."""
    prefix, body, trailer = encode_parts(fingerprint, meta, payload, secret=secret)
    return b"".join((prefix, body, trailer))


def parse_header(buf: Buffer) -> Optional[Header]:
    """The header at the start of ``buf``, or ``None`` if it is short or its magic/version is wrong.

    Nothing beyond the header is checked: a start-up scan uses this to rebuild its index, and the
    full check happens when the block is read (:func:`decode`).
    """
    view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf
    if view.nbytes < HEADER_BYTES:
        return None
    (magic, version, flags, fp, h_lo, h_hi, p_lo, p_hi, s_lo, s_hi, ntok, group, plen) = (
        _HEADER.unpack_from(view, 0)
    )
    if magic != MAGIC or version != FORMAT_VERSION:
        return None
    return Header(
        version=version,
        fingerprint=fp,
        block_hash=h_lo | (h_hi << 64),
        parent_hash=(p_lo | (p_hi << 64)) if flags & _FLAG_HAS_PARENT else None,
        salt_digest=s_lo | (s_hi << 64),
        token_count=ntok,
        payload_len=plen,
        group=group,
    )


def decode_checked(
    buf: Buffer,
    *,
    fingerprint: bytes,
    block_hash: int,
    token_ids: Union[Sequence[int], np.ndarray],
    salt_digest: int,
    payload_len: int,
    secret: TierSecret,
    group: int = 0,
) -> Tuple[Optional[memoryview], Reason]:
    """Verify the record at the start of ``buf`` against what the caller expects (``group``: the
    KV cache group whose block the caller asks for).

    Returns ``(payload, Reason.OK)`` with ``payload`` a view into ``buf``, or ``(None, reason)``.
    ``buf`` may be longer than the record (a disk slot's tail is ignored).
    """
    fp = _fingerprint_bytes(fingerprint)
    key = _check_secret(secret)
    block_hash = _check_u128("block_hash", block_hash)
    salt_digest = _check_u128("salt_digest", salt_digest)
    tokens = _expected_tokens(token_ids)
    view = as_byte_view(buf, "buf")
    reason = _check_prefix(view, fp, block_hash, salt_digest, tokens, payload_len,
                           _check_group(group))
    if reason is not None:
        return None, reason
    tok_end = HEADER_BYTES + 4 * len(tokens)
    end = tok_end + payload_len
    if view.nbytes < end + TRAILER_BYTES:
        return None, Reason.TRUNCATED
    reason = _check_trailer(key, view[:tok_end], view[tok_end:end], view[end : end + TRAILER_BYTES])
    return (view[tok_end:end], reason) if reason is Reason.OK else (None, reason)


def _check_trailer(secret: TierSecret, head: memoryview, body: memoryview, tail: memoryview) -> Reason:
    """Checksum first (accidental damage is ``corrupt``), then the MAC (constant-time compare)."""
    digest = xxhash.xxh3_128()
    digest.update(head)
    digest.update(body)
    if digest.digest() != bytes(tail[:CHECKSUM_BYTES]):
        return Reason.CHECKSUM
    mac = secret.mac()
    mac.update(head)
    mac.update(body)
    if not hmac.compare_digest(mac.digest(), bytes(tail[CHECKSUM_BYTES:TRAILER_BYTES])):
        return Reason.UNAUTHENTICATED
    return Reason.OK


def verify_split(
    prefix: Buffer,
    payload: Buffer,
    trailer: Buffer,
    *,
    fingerprint: bytes,
    block_hash: int,
    token_ids: Union[Sequence[int], np.ndarray],
    salt_digest: int,
    secret: TierSecret,
    group: int = 0,
) -> Reason:
    """Verify a record read in three pieces (header and tokens, payload, checksum and MAC).

    The reader that scatters a record's payload straight into its destination (``os.preadv`` into a
    host block) checks it here; the payload is trusted only on ``Reason.OK``.
    """
    fp = _fingerprint_bytes(fingerprint)
    key = _check_secret(secret)
    tokens = _expected_tokens(token_ids)
    head = as_byte_view(prefix, "prefix")
    body = as_byte_view(payload, "payload")
    tail = as_byte_view(trailer, "trailer")
    reason = _check_prefix(
        head, fp, _check_u128("block_hash", block_hash), _check_u128("salt_digest", salt_digest),
        tokens, body.nbytes, _check_group(group),
    )
    if reason is not None:
        return reason
    if head.nbytes != HEADER_BYTES + 4 * len(tokens) or tail.nbytes != TRAILER_BYTES:
        return Reason.TRUNCATED
    return _check_trailer(key, head, body, tail)


def _expected_tokens(token_ids: Union[Sequence[int], np.ndarray]) -> np.ndarray:
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.dtype("<u4") and token_ids.ndim == 1:
        return np.ascontiguousarray(token_ids)
    return _token_array(token_ids)


def _check_prefix(
    view: memoryview, fp: bytes, block_hash: int, salt_digest: int, tokens: np.ndarray,
    payload_len: int, group: int = 0,
) -> Optional[Reason]:
    """Why the header and token ids at the start of ``view`` are not the expected ones (or None)."""
    if view.nbytes < HEADER_BYTES:
        return Reason.TRUNCATED
    (magic, version, _flags, rec_fp, h_lo, h_hi, _p_lo, _p_hi, s_lo, s_hi, ntok, rec_group, plen) = (
        _HEADER.unpack_from(view, 0)
    )
    if magic != MAGIC:
        return Reason.BAD_MAGIC
    if version != FORMAT_VERSION:
        return Reason.BAD_VERSION
    if rec_fp != fp:
        return Reason.FOREIGN
    if (h_lo | (h_hi << 64)) != block_hash:
        return Reason.HASH_MISMATCH
    if rec_group != group:
        return Reason.GROUP_MISMATCH
    if (s_lo | (s_hi << 64)) != salt_digest:
        return Reason.SALT_MISMATCH
    if ntok != len(tokens):
        return Reason.TOKENS_MISMATCH
    if plen != payload_len:
        return Reason.LENGTH_MISMATCH
    tok_end = HEADER_BYTES + 4 * ntok
    if view.nbytes < tok_end:
        return Reason.TRUNCATED
    if view[HEADER_BYTES:tok_end] != tokens.tobytes():
        return Reason.TOKENS_MISMATCH
    return None


def decode(
    buf: Buffer,
    *,
    fingerprint: bytes,
    block_hash: int,
    token_ids: Union[Sequence[int], np.ndarray],
    salt_digest: int,
    payload_len: int,
    secret: TierSecret,
    group: int = 0,
) -> Optional[memoryview]:
    """The verified payload of the record in ``buf`` (a view into it), or ``None``.

    :func:`decode_checked` says why a record was refused.
    """
    payload, _reason = decode_checked(
        buf, fingerprint=fingerprint, block_hash=block_hash, token_ids=token_ids,
        salt_digest=salt_digest, payload_len=payload_len, secret=secret, group=group,
    )
    return payload
