"""Argument checks shared across the package: block sizes, flags, devices, allocations.

Owns the one rule for block sizes (:func:`check_block_size`, with :data:`DEFAULT_BLOCK_SIZE`, the
default every layer uses): whatever lays out a KV pool (``CacheSpec``, the pool, the model runner,
the engine's config) takes a power of two in ``[1, MAX_BLOCK_SIZE]``, because the Triton kernels
check exactly that (slot arithmetic and the in-block offset are a shift and a mask); the block
manager alone, which only counts tokens, takes what the core stores (any integer in
``[1, MAX_MANAGER_BLOCK_SIZE]``). A bad block size raises
:class:`~pagedkv.errors.ConfigArgumentError` at every layer.

It also owns the rules for three kinds of argument that used to slip through or escape as torch's
own exceptions:

* a flag is a ``bool`` and nothing else (``"false"`` is truthy, so ``bool(x)`` would turn it on);
* a device is a ``str`` or :class:`torch.device` naming ``cpu`` or an existing CUDA device; anything
  else raises :class:`~pagedkv.errors.InvalidArgumentError` with ``what="device"`` before torch is
  asked to allocate there (which would raise a bare ``RuntimeError``);
* a cache salt is ``None`` (no salt) or non-empty: an empty one is refused rather than hashed as
  no salt.

It also turns a failed torch allocation into :class:`~pagedkv.errors.AllocationFailedError`.

torch is imported by the two functions that need it, not by the module: the block manager uses
:func:`check_flag` and must stay importable without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar, Union

from .errors import AllocationFailedError, ConfigArgumentError, InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_BLOCK_SIZE", "MAX_BLOCK_SIZE", "MAX_MANAGER_BLOCK_SIZE", "check_block_size",
           "check_flag", "check_salt", "parse_device", "allocate"]

T = TypeVar("T")

#: Tokens per KV block when none is given (every layer's default).
DEFAULT_BLOCK_SIZE = 16
#: Largest block size a KV pool may have: the bound of the attention kernels' own shape check.
MAX_BLOCK_SIZE = 1 << 16
#: Largest block size the block manager takes (the core keeps it as a ``u32``).
MAX_MANAGER_BLOCK_SIZE = 2**32 - 1


def check_block_size(value: Any, *, pool: bool = True) -> int:
    """``value`` if it is a block size the caller's layer can use; ConfigArgumentError otherwise.

    Args:
        value: The block size (tokens per block).
        pool: The caller lays out a KV pool that the kernels read: a power of two in
            ``[1, MAX_BLOCK_SIZE]``. ``False`` (the block manager, which only counts tokens):
            any integer in ``[1, MAX_MANAGER_BLOCK_SIZE]``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        reason = f"must be an int, got {type(value).__name__}"
    elif pool and not (1 <= value <= MAX_BLOCK_SIZE and value & (value - 1) == 0):
        reason = f"must be a power of two in [1, {MAX_BLOCK_SIZE}] (the attention kernels' tiling)"
    elif not 1 <= value <= MAX_MANAGER_BLOCK_SIZE:
        reason = f"must be in [1, {MAX_MANAGER_BLOCK_SIZE}]"
    else:
        return value
    raise ConfigArgumentError(
        f"invalid config: block_size = {value!r}: {reason}", field="block_size", value=value,
        reason=reason,
    )


def check_flag(name: str, value: Any) -> bool:
    """``value`` if it is a bool; InvalidArgumentError naming ``name`` otherwise."""
    if value is True or value is False:
        return value
    reason = f"must be a bool, got {type(value).__name__}"
    raise InvalidArgumentError(
        f"invalid argument: {name} = {value!r}: {reason}", what=name, value=value, reason=reason
    )


def check_salt(name: str, salt: Any) -> Any:
    """``salt`` unless it is an empty str, bytes or bytearray; InvalidArgumentError otherwise.

    The prefix hash treats an empty salt as no salt (``docs/prefix-hash.md``), so a caller whose
    per-tenant salt came out empty would silently share the unsalted cache; ``None`` is the one
    spelling of "no salt". Any other type is left for the extension to refuse.
    """
    if salt is not None and type(salt) in (str, bytes, bytearray) and not salt:
        reason = "must not be empty (an empty salt would share the unsalted cache); pass None for no salt"
        raise InvalidArgumentError(
            f"invalid argument: {name} = {salt!r}: {reason}", what=name, value=salt, reason=reason
        )
    return salt


def _bad_device(device: Any, reason: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"invalid argument: device = {device!r}: {reason}", what="device", value=device, reason=reason
    )


def parse_device(device: Union[str, "torch.device"]) -> "torch.device":
    """The :class:`torch.device` for ``device``, checked to exist: ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        InvalidArgumentError: Not a str or torch.device, not a device torch can parse, a device
            type pagedkv does not run on, CUDA asked for without CUDA, or no such CUDA device.
    """
    import torch

    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise _bad_device(device, f"not a device ({exc})") from None
    else:
        raise _bad_device(device, f"must be a str or torch.device, got {type(device).__name__}")
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise _bad_device(device, f"unsupported device type {dev.type!r}: use 'cpu' or 'cuda'")
    if not torch.cuda.is_available():
        raise _bad_device(device, "CUDA is not available")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise _bad_device(device, f"no CUDA device {dev.index} ({count} present)")
    return dev


def allocate(what: str, nbytes: int, fn: Callable[[], T]) -> T:
    """``fn()``, with a refused allocation raised as AllocationFailedError(``what``, ``nbytes``)."""
    import torch

    try:
        return fn()
    except AllocationFailedError:
        raise
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise AllocationFailedError(
            f"allocation failed: {what} needs {nbytes} bytes ({exc})", what=what, bytes=nbytes
        ) from None
    except RuntimeError as exc:
        # torch's CPU allocator reports a refused request as a plain RuntimeError.
        text = str(exc)
        if "alloc" not in text.lower() and "out of memory" not in text.lower():
            raise
        raise AllocationFailedError(
            f"allocation failed: {what} needs {nbytes} bytes ({text})", what=what, bytes=nbytes
        ) from None
