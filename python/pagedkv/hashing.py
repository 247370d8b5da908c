"""The prefix hash of ``docs/prefix-hash.md``, computed in pure Python (``xxhash``).

Owns :func:`hash_prompt`: the chained block hashes an external reader (a router, an indexer)
computes for a prompt to look it up among the hashes replicas publish (``docs/kv-events.md``). It
is written from the specification alone, not from the core's code, so its agreement with
``_core.hash_blocks`` (``tests/test_hash_prompt.py``) tests the specification. Invariants: the
result equals the core's hashes for the same tokens, block size, key and salt; only full blocks
are hashed; hashes are 128-bit unsigned ints.
"""

from __future__ import annotations

import struct
from typing import List, Optional, Sequence, Union

__all__ = ["hash_prompt", "HASH_DOMAIN"]

#: The domain tag the root hash starts with (its version changes with the layout).
HASH_DOMAIN = b"pagedkv/prefix/v1"

_U32 = 1 << 32
_U64 = 1 << 64


def _bad(what: str, value: object, reason: str) -> Exception:
    from .errors import InvalidArgumentError

    return InvalidArgumentError(f"invalid argument: {what} = {value!r}: {reason}", what=what,
                                value=value, reason=reason)


def hash_prompt(tokens: Sequence[int], block_size: int, key: int,
                salt: Union[str, bytes, None] = None) -> List[int]:
    """The prefix hashes of every full block of ``tokens``: ``h_0, h_1, ...`` under hash key
    ``key`` (the replicas' ``hash_seed``) and ``salt`` (the request's ``cache_salt``; a string is
    its UTF-8 bytes, as the engine hashes it).

    Raises:
        InvalidArgumentError: ``block_size`` is not in ``[1, 2**32)``, ``key`` not in
            ``[0, 2**64)``, a token not in ``[0, 2**32)``, or ``salt`` is empty (the engine
            refuses an empty salt: pass None for none) or not a string or bytes.
    """
    import xxhash

    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 0 < block_size < _U32:
        raise _bad("block_size", block_size, "must be an int in [1, 2**32)")
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < _U64:
        raise _bad("key", key, "must be an int in [0, 2**64)")
    if salt is None:
        salt_bytes = b""
    elif isinstance(salt, str):
        salt_bytes = salt.encode("utf-8")
    elif isinstance(salt, (bytes, bytearray)):
        salt_bytes = bytes(salt)
    else:
        raise _bad("salt", salt, "must be a string, bytes or None")
    if salt is not None and not salt_bytes:
        raise _bad("salt", salt, "an empty salt is refused (None means no salt)")
    ids = [int(t) for t in tokens]
    for t in ids:
        if not 0 <= t < _U32:
            raise _bad("tokens", t, "token ids must be in [0, 2**32)")
    prev = xxhash.xxh3_128_intdigest(HASH_DOMAIN + struct.pack("<I", len(salt_bytes)) + salt_bytes,
                                     key)
    block = struct.Struct(f"<{block_size}I")
    out: List[int] = []
    for lo in range(0, len(ids) - block_size + 1, block_size):
        prev = xxhash.xxh3_128_intdigest(prev.to_bytes(16, "little")
                                         + block.pack(*ids[lo:lo + block_size]), key)
        out.append(prev)
    return out
