"""KV cache groups: the attention kind of each group of a model's layers, and sizing arithmetic.

Owns :class:`KVCacheGroup` (one group's attention kind and window or chunk), the conversion of a
manager's ``groups=`` argument to what the extension takes, and the core's sizing helpers as
plain functions (:func:`bytes_per_token`, :func:`page_bytes`, :func:`live_blocks`,
:func:`peak_decode_blocks`). The arithmetic is the core's (``rust/core/src/groups.rs``); see
``docs/architecture.md``, "KV cache groups".

Invariants:

* A :class:`KVCacheGroup` is immutable; ``size`` is 0 exactly for a full group and ``>= 1``
  otherwise (a sliding window or chunk of 0 tokens is refused when built).
* A manager's group 0 is full whenever any group is (it carries the prefix-hash chain); only a
  manager whose every group is windowed (a model without a full layer) has a windowed group 0,
  which releases like the others. Without ``groups`` a manager has one full group and behaves
  exactly as before groups existed.
* A query at position ``p`` reads ``[0, p]`` in a full group, ``[p - window + 1, p]`` in a sliding
  one and ``[p // chunk * chunk, p]`` in a chunked one; blocks no later query reads are released
  when a step is built and show as ``-1`` in that group's block table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, List, Literal, Optional, Sequence, Tuple, Union

from . import _core
from .errors import InvalidArgumentError

__all__ = [
    "AttentionKind",
    "KVCacheGroup",
    "bytes_per_token",
    "page_bytes",
    "live_blocks",
    "peak_decode_blocks",
]

#: The attention kinds a KV cache group can have.
AttentionKind = Literal["full", "sliding", "chunked"]

_KINDS: Tuple[str, ...] = ("full", "sliding", "chunked")


def _bad(what: str, value: Any, reason: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"invalid argument: {what} = {value!r}: {reason}", what=what, value=value, reason=reason
    )


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV cache group: the attention kind its layers share.

    Build with :meth:`full`, :meth:`sliding` or :meth:`chunked`.

    Attributes:
        kind: ``"full"``, ``"sliding"`` or ``"chunked"``.
        size: The sliding window or the chunk, in tokens (``>= 1``); 0 for a full group.

    Raises:
        InvalidArgumentError: An unknown kind, a size that is not an int, a full group with a
            size, or a sliding window or chunk below 1.
    """

    kind: AttentionKind
    size: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise _bad("kind", self.kind, f"must be one of {', '.join(map(repr, _KINDS))}")
        if isinstance(self.size, bool) or not isinstance(self.size, int):
            raise _bad("size", self.size, "must be an int")
        if self.kind == "full":
            if self.size != 0:
                raise _bad("size", self.size, "a full group has no window or chunk (give 0)")
        elif not 1 <= self.size <= 2**32 - 1:
            what = "window" if self.kind == "sliding" else "chunk"
            raise _bad(what, self.size, "must be in [1, 2**32 - 1] tokens")

    @classmethod
    def full(cls) -> KVCacheGroup:
        """A group whose queries read every earlier position."""
        return cls("full")

    @classmethod
    def sliding(cls, window: int) -> KVCacheGroup:
        """A group whose query at ``p`` reads the ``window`` positions ``[p - window + 1, p]``."""
        if isinstance(window, bool) or not isinstance(window, int):
            raise _bad("window", window, "must be an int")
        return cls("sliding", window)

    @classmethod
    def chunked(cls, chunk: int) -> KVCacheGroup:
        """A group whose query at ``p`` reads from the start of its chunk, ``p // chunk * chunk``."""
        if isinstance(chunk, bool) or not isinstance(chunk, int):
            raise _bad("chunk", chunk, "must be an int")
        return cls("chunked", chunk)

    def as_tuple(self) -> Tuple[str, int]:
        """``(kind, size)``, the form the extension takes and gives."""
        return (self.kind, self.size)


#: What a group argument may be: a :class:`KVCacheGroup`, or a tuple ``("full",)``,
#: ``("sliding", window)``, ``("chunked", chunk)``.
GroupLike = Union[KVCacheGroup, Tuple[str], Tuple[str, int], Sequence[Any]]


def as_group(value: Any, what: str = "groups") -> KVCacheGroup:
    """A :class:`KVCacheGroup` from one group argument (see :data:`GroupLike`).

    Raises:
        InvalidArgumentError: ``value`` is none of those forms, or an invalid group.
    """
    if isinstance(value, KVCacheGroup):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], str):
        if len(value) == 1:
            return KVCacheGroup(value[0])  # type: ignore[arg-type]
        if len(value) == 2:
            return KVCacheGroup(value[0], value[1])  # type: ignore[arg-type]
    raise _bad(
        what, value,
        "a KV cache group is a KVCacheGroup or ('full',), ('sliding', window), ('chunked', chunk)",
    )


def groups_arg(groups: Optional[Iterable[Any]]) -> Optional[List[Tuple[str, int]]]:
    """A manager's ``groups=`` as the extension takes it (``None`` stays ``None``: one full group).

    Group 0 being full is the core's rule (``InvalidConfigError`` from the manager).

    Raises:
        InvalidArgumentError: ``groups`` is not a sequence of groups, or one is invalid.
    """
    if groups is None:
        return None
    if isinstance(groups, (str, bytes, KVCacheGroup)) or not hasattr(groups, "__iter__"):
        raise _bad("groups", groups, "must be a list of KV cache groups")
    return [as_group(g).as_tuple() for g in groups]


def bytes_per_token(kv_heads: int, head_dim: int, dtype_bytes: int, layers: int) -> int:
    """KV bytes one token takes in one layer group: ``2 * kv_heads * head_dim * dtype_bytes * layers``.

    Raises:
        InvalidArgumentError: A value is negative or not an int, or the product exceeds 64 bits.
    """
    return _core.bytes_per_token(kv_heads, head_dim, dtype_bytes, layers)


def page_bytes(group_bytes_per_token: Sequence[int], block_size: int) -> int:
    """Bytes of the one page size all groups share: ``max(group_bytes_per_token) * block_size``.

    Raises:
        InvalidArgumentError: A value is negative or not an int, ``block_size`` is 0, or the
            product exceeds 64 bits.
    """
    return _core.page_bytes(list(group_bytes_per_token), block_size)


def live_blocks(group: GroupLike, seq_len: int, num_new: int, block_size: int) -> int:
    """Blocks a group's table holds (``-1`` entries not counted) once a step computing the last
    ``num_new`` of ``seq_len`` tokens is built.

    Raises:
        InvalidArgumentError: An invalid group, ``seq_len < 1``, ``num_new`` outside
            ``[1, seq_len]``, or ``block_size < 1``.
    """
    return _core.live_blocks(as_group(group, "group").as_tuple(), seq_len, num_new, block_size)


def peak_decode_blocks(group: GroupLike, max_len: int, block_size: int) -> int:
    """Most blocks a group's table holds over a decode run up to ``max_len`` tokens: the group's
    per-sequence block need at that context (exact for full and sliding groups, an upper bound for
    chunked ones).

    Raises:
        InvalidArgumentError: An invalid group, a negative ``max_len``, or ``block_size < 1``.
    """
    return _core.peak_decode_blocks(as_group(group, "group").as_tuple(), max_len, block_size)
