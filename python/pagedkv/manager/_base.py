"""What every part of :class:`~pagedkv.BlockManager` shares: its attributes and argument helpers.

Owns :class:`_ManagerBase`, which holds the slots of the instance attributes each concern's mixin
reads, the id normalisation :func:`_ids`, the count check :func:`_count`, the ``TokenIds``/``SeqIds``
type aliases and the ``pagedkv`` logger.
Invariant: the helpers only check and convert arguments; they never touch the manager's state, so a
rejected argument leaves the manager exactly as it was.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Tuple, Union

import numpy as np

from .. import _core
from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    import numpy.typing as npt

    from ..buffers import StepBuffers
    from ._types import CostModel

    TokenIds = Union[Sequence[int], npt.NDArray[np.integer], int, Any]
    SeqIds = Union[Sequence[int], npt.NDArray[np.integer]]

logger = logging.getLogger("pagedkv")

_new_tuple = tuple.__new__
_ndarray = np.ndarray


def _count(what: str, value: Any) -> int:
    """``value`` as an int >= 0, else a typed error naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        reason = "must be an int >= 0"
        raise InvalidArgumentError(f"invalid argument: {what} = {value!r}: {reason}",
                                   what=what, value=value, reason=reason)
    return int(value)


def _ids(x: Any) -> Any:
    """Normalises token or sequence ids to something the extension reads directly.

    Lists, tuples and numpy arrays pass through untouched (the extension reads them without a
    Python-level copy); ints and numpy integer scalars become a one-element list; anything else
    array-like (a CPU torch tensor, ``array.array``, ``range``) goes through ``np.asarray``, which
    shares memory where it can.
    """
    t = type(x)
    if t is _ndarray or t is list or t is tuple:
        return x
    if t is int:
        return [x]
    if t is bool:
        # An int to Python, but never an id: `append(seq, True)` is a bug, not token 1.
        reason = "must be an int, got bool"
        raise InvalidArgumentError(
            f"invalid argument: ids = {x!r}: {reason}", what="ids", value=x, reason=reason
        )
    if isinstance(x, np.integer):
        return [int(x)]
    try:
        return np.asarray(x)
    except (TypeError, RuntimeError) as exc:
        # A CUDA tensor lands here: it has no host memory to read.
        reason = f"cannot be read as a host integer array ({exc})"
        raise InvalidArgumentError(
            f"invalid argument: ids = {type(x).__name__}: {reason}",
            what="ids",
            value=type(x).__name__,
            reason=reason,
        ) from None


class _ManagerBase:
    """The attributes :class:`~pagedkv.BlockManager` sets in ``__init__``, declared for its mixins.

    The one class of the hierarchy with non-empty slots (every mixin and the manager declare
    ``__slots__ = ()``), so a manager has no ``__dict__`` and the mixins share one layout.
    """

    __slots__ = ("_core", "_buffers", "_append_batch", "_step", "cost_model")

    _core: _core.BlockManager
    _buffers: Optional[StepBuffers]
    _append_batch: Callable[[Any, Any], None]
    _step: Callable[[Any, Any], Tuple[int, int, int, int, int, int, int, int]]
    cost_model: Optional[CostModel]
