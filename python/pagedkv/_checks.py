"""Argument checks shared by the torch-facing modules (step buffers, KV pool).

Owns the rules for three kinds of argument that used to slip through or escape as torch's own
exceptions:

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

from .errors import AllocationFailedError, InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = ["check_flag", "check_salt", "parse_device", "allocate"]

T = TypeVar("T")


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
