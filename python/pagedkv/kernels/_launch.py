"""Cached kernel launches: the host side of an eager call in a few microseconds.

Owns `LaunchCache`, `tensor_key` and `Launch`. A public kernel entry point validates its arguments
and computes its launch configuration once per *call signature* — the shapes, strides, dtypes,
devices and 16-byte alignment of its tensors plus its host scalars — and stores the result, a
`Launch`, under that signature. A later call with the same signature skips the checks (they
depend on nothing else, so they would pass again) and launches the compiled kernel directly,
bypassing `JITFunction.run`'s argument binding and specialization.

Why that is safe: Triton specializes a compiled kernel on the dtypes and 16-byte alignment of
its pointer arguments and on the values of its integer arguments (== 1, divisible by 16). Every
integer a `Launch` passes is derived from the signature, and the signature holds each tensor's
dtype and `data_ptr() % 16`, so a signature maps to exactly one specialization: the kernel the
first call compiled is the one `JITFunction.run` would pick again. The bounds contract does not
depend on the cache either: it is enforced inside the kernels, from the index values.

Invariants: entries hold strong references to the objects their signature names by identity
(workspaces, plans), so an `id()` in a key cannot be reused while its entry lives; the cache is
bounded (cleared when full). Under the interpreter (TRITON_INTERPRET=1), or when a Triton launch
hook is installed (profilers), a `Launch` goes through `kernel[grid](...)` every time, so the
cached path and the plain one compute the same thing.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch

__all__ = ["LaunchCache", "tensor_key", "Launch", "interpreting"]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tensor_key(t: torch.Tensor) -> tuple:
    """What validation and specialization read from a tensor (raises AttributeError for a
    non-tensor, which sends the caller down its checking path)."""
    return (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15)


class LaunchCache:
    """A bounded dict from call signatures to prepared launches."""

    def __init__(self, maxsize: int = 128):
        self.maxsize = maxsize
        self._d: dict = {}

    def get(self, key):
        return self._d.get(key)

    def put(self, key, value) -> None:
        if len(self._d) >= self.maxsize:
            self._d.clear()
        self._d[key] = value

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)


def _hooks_installed() -> bool:
    try:
        from triton import knobs

        rt = knobs.runtime
        return bool(getattr(rt.launch_enter_hook, "calls", rt.launch_enter_hook)) or bool(
            getattr(rt.launch_exit_hook, "calls", rt.launch_exit_hook)
        )
    except Exception:  # an older or newer Triton without knobs: take the plain path
        return True


class Launch:
    """One kernel launch with everything but the per-call tensors bound.

    `fn` is the `@triton.jit` function, `tail` the positional values after the per-call ones
    (host scalars derived from the signature), `kwargs` the constexprs (the kernel's last
    parameters) and launch options. `__call__(grid, *dynamic)` passes `dynamic` as the kernel's
    leading arguments (the tensors, in parameter order). The first call launches through
    `fn[grid](...)` (compiling if needed) and keeps the compiled kernel; later calls launch it
    directly, through the C launch function when the kernel needs no scratch memory.
    """

    __slots__ = ("fn", "tail", "kwargs", "ordered_tail", "compiled", "plain", "raw")

    def __init__(self, fn, tail: Sequence[Any], kwargs: dict):
        self.fn = fn
        self.tail = tuple(tail)
        self.kwargs = dict(kwargs)
        self.compiled = None
        self.plain = interpreting()
        self.ordered_tail = None
        self.raw = None

    def __call__(self, grid: tuple, *dynamic) -> None:
        k = self.compiled
        if k is not None and not (_RT is not None and (_RT.launch_enter_hook.calls
                                                      or _RT.launch_exit_hook.calls)):
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1
            dev = _DEV()
            raw = self.raw
            if raw is not None:
                # The C launch function itself (CudaLauncher.__call__ only adds scratch
                # allocation, which these kernels do not use).
                raw[0](grid[0], g1, g2, _RAW(dev), k.function, raw[1], raw[2], None, None,
                       k.packed_metadata, None, None, None, *dynamic, *self.ordered_tail)
                return
            k.run(grid[0], g1, g2, _RAW(dev), k.function, k.packed_metadata, None, None, None,
                  *dynamic, *self.ordered_tail)
            return
        ret = self.fn[grid](*dynamic, *self.tail, **self.kwargs)
        if self.ordered_tail is None:
            # The launcher takes every parameter positionally, constexprs included, in order.
            names = list(self.fn.arg_names) if hasattr(self.fn, "arg_names") else []
            rest = names[len(dynamic) + len(self.tail):]
            if not all(n in self.kwargs for n in rest):
                return  # a parameter left to its default: keep launching through the JIT
            self.ordered_tail = self.tail + tuple(self.kwargs[n] for n in rest)
        if not self.plain and _RT is not None and not _hooks_installed() and hasattr(
            ret, "function"
        ):
            self.compiled = ret
            r = ret.run
            if (getattr(r, "global_scratch_size", 1) == 0 and getattr(r, "profile_scratch_size", 1)
                    == 0 and getattr(r, "num_ctas", 2) == 1 and hasattr(r, "launch")):
                self.raw = (r.launch, r.launch_cooperative_grid, r.launch_pdl)


def _raw_stream(dev: int) -> int:  # pragma: no cover - only without the private accessor
    return torch.cuda.current_stream(dev).cuda_stream


# The current device and raw stream, as Triton's own CUDA driver reads them.
_DEV: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_RAW: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", _raw_stream)

try:
    from triton import knobs as _knobs

    _RT = _knobs.runtime if hasattr(_knobs.runtime.launch_enter_hook, "calls") else None
except Exception:  # pragma: no cover - a Triton without knobs: never cache
    _RT = None
