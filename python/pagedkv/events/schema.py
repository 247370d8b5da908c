"""The KV-event wire schema: msgpack structs laid out as vLLM 0.33 lays out its KV events.

Owns :class:`KVEventBatch`, :class:`BlockStored`, :class:`BlockRemoved`, :class:`AllBlocksCleared`,
the hash representation on the wire (:func:`hash_to_wire`, :func:`hash_from_wire`) and the
encoder/decoder pair (:func:`encode_batch`, :func:`decode_batch`).

Invariants:

* the layout equals vLLM 0.33.0's ``vllm.distributed.kv_events``: a batch is a msgpack array
  ``[ts, events, data_parallel_rank?]`` (array-like, defaults omitted); an event is a msgpack map
  tagged ``"type": "<class name>"`` holding every required field and the optional ones that differ
  from their defaults. Field names, order, defaults and tags are vLLM's, so vLLM's own decoder reads
  these bytes field for field and this decoder reads vLLM's (``tests/test_kv_events_vllm_interop.py``);
* a block hash travels as 16 bytes, big-endian, of the 128-bit prefix hash
  (``docs/prefix-hash.md``): msgpack integers stop at 64 bits and vLLM's ``ExternalBlockHash`` is
  ``bytes | int``. The decoder also accepts ints (what vLLM publishes for 64-bit hashes), so a
  consumer reads both;
* only msgpack: nothing here can be made to build arbitrary objects (no pickle).
"""

from __future__ import annotations

import sys
from typing import Any, List, Optional, Tuple, Union

import msgspec

__all__ = [
    "KVEventBatch",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVEvent",
    "MEDIUM_GPU",
    "MEDIUM_CPU",
    "MEDIUM_STORAGE",
    "LOCALITY_LOCAL",
    "LOCALITY_REMOTE",
    "WireHash",
    "hash_to_wire",
    "hash_from_wire",
    "encode_batch",
    "decode_batch",
]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCALITY_LOCAL = "LOCAL"
LOCALITY_REMOTE = "REMOTE"

#: A hash as it travels: 16 big-endian bytes from pagedkv, or an int from a 64-bit publisher.
WireHash = Union[bytes, int]

_HASH_BYTES = 16
_HASH_LIMIT = 1 << 128


def hash_to_wire(h: int) -> bytes:
    """The 16 big-endian bytes of a 128-bit block hash.

    Raises:
        InvalidArgumentError: ``h`` is not an int in ``[0, 2**128)``.
    """
    if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < _HASH_LIMIT:
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(
            f"invalid argument: block_hash = {h!r}: must be an int in [0, 2**128)",
            what="block_hash", value=h, reason="must be an int in [0, 2**128)")
    return h.to_bytes(_HASH_BYTES, "big")


def hash_from_wire(h: WireHash) -> int:
    """A wire hash as an int: bytes are read big-endian (any length), ints pass through."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        return int.from_bytes(h, "big")
    return int(h)


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the tagged events (the tag is the class name, as vLLM's)."""


class BlockStored(_Event, tag="BlockStored"):  # type: ignore[call-arg]
    """Blocks entered a cache tier: ``block_hashes`` in chain order, ``parent_block_hash`` the hash
    of the block before the first (None at a prompt's start), ``token_ids`` every token of those
    blocks (``len(block_hashes) * block_size``)."""

    block_hashes: List[WireHash]
    parent_block_hash: Optional[WireHash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None
    lookahead_token_ids: Optional[List[List[int]]] = None


class BlockRemoved(_Event, tag="BlockRemoved"):  # type: ignore[call-arg]
    """Blocks left a cache tier (evicted, or the tier dropped them)."""

    block_hashes: List[WireHash]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(_Event, tag="AllBlocksCleared"):  # type: ignore[call-arg]
    """The publisher dropped every cached block (of every tier it reports)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True,  # type: ignore[call-arg]
                   gc=False):
    """The events of one engine step, in the order they happened; ``ts`` is wall-clock seconds."""

    ts: float
    events: List[KVEvent]
    data_parallel_rank: Optional[int] = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack bytes of ``batch`` (what the PUB socket's payload frame carries)."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack bytes.

    Raises:
        InvalidArgumentError: The bytes are not a KV-event batch (malformed msgpack, a wrong
            field type, an unknown event tag, ``Any``-typed fields nested past the recursion
            limit).
    """
    try:
        return _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        from ..errors import InvalidArgumentError

        reason = str(exc)
        if isinstance(exc, RecursionError):  # msgspec's: deeper than Python's recursion limit
            reason = f"nested deeper than the recursion limit ({sys.getrecursionlimit()})"
        raise InvalidArgumentError(
            f"invalid argument: payload = <{len(payload)} bytes>: not a KV-event batch: {reason}",
            what="payload", value=len(payload), reason=reason) from None
