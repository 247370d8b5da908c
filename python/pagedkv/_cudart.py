"""The one CUDA runtime call PyTorch does not expose: a strided (2D) asynchronous copy.

Owns :func:`memcpy2d_async` and :func:`available`.

Why: a host-tier block holds all of its layers side by side (:mod:`pagedkv.tiers.host`), so one layer's
slice of a run of consecutive host blocks is ``height`` rows of ``width`` bytes, ``pitch`` bytes
apart. ``cudaMemcpy2DAsync`` moves such a slice in one DMA transfer, at the link's rate for rows of
tens of KiB; PyTorch's ``copy_`` of a non-contiguous pinned view first packs it on the host. The
layer-by-layer loads (:meth:`pagedkv.tiers.host.SwapEngine.swap_in` with ``by_layer``) need exactly this.

The runtime library is the one the process already loaded with torch (found through
``/proc/self/maps``), else the first of ``libcudart.so.13`` / ``.12`` / ``libcudart.so`` that
opens; :func:`available` is ``False`` when none does or it lacks the symbol, and callers then keep
the whole-block path. Nothing here allocates, synchronizes or touches a CUDA context before the
first call.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

__all__ = ["available", "memcpy2d_async", "HOST_TO_DEVICE", "DEVICE_TO_HOST", "DEVICE_TO_DEVICE"]

#: ``cudaMemcpyKind`` values (stable across CUDA 11, 12 and 13).
HOST_TO_DEVICE = 1
DEVICE_TO_HOST = 2
DEVICE_TO_DEVICE = 3

_CANDIDATES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")

_lock = threading.Lock()
_fn: Optional[ctypes._CFuncPtr] = None  # type: ignore[name-defined]
_err_name: Optional[ctypes._CFuncPtr] = None  # type: ignore[name-defined]
_loaded = False


def _loaded_path() -> Optional[str]:
    """The path of a libcudart this process has mapped already (torch's), if any."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rpartition(" ")[2].strip()
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    return None


def _load() -> None:
    global _fn, _err_name, _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True
        first = _loaded_path()
        for name in ((first,) if first else ()) + _CANDIDATES:
            try:
                lib = ctypes.CDLL(name)
                fn = lib.cudaMemcpy2DAsync
            except (OSError, AttributeError):
                continue
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                           ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            err = getattr(lib, "cudaGetErrorName", None)
            if err is not None:
                err.restype = ctypes.c_char_p
                err.argtypes = [ctypes.c_int]
            _fn, _err_name = fn, err
            return


def available() -> bool:
    """Whether :func:`memcpy2d_async` can be called (a CUDA runtime with the symbol loaded)."""
    _load()
    return _fn is not None


def memcpy2d_async(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                   kind: int, stream: int) -> None:
    """``cudaMemcpy2DAsync``: ``height`` rows of ``width`` bytes from ``src`` (rows ``spitch``
    bytes apart) to ``dst`` (rows ``dpitch`` apart), queued on the CUDA stream handle ``stream``.

    The caller owns the addresses' validity (they come from tensors it holds) and keeps both
    buffers alive until the copy has run.

    Raises:
        RuntimeError: No runtime library is loaded, or the call returned a CUDA error (named).
        ValueError: A pitch is smaller than ``width``, or a size is negative.
    """
    if width < 0 or height < 0 or dpitch < width or spitch < width:
        raise ValueError(f"memcpy2d_async: width {width}, height {height}, dpitch {dpitch}, "
                         f"spitch {spitch}: pitches must be >= width >= 0")
    if not available():
        raise RuntimeError("memcpy2d_async: no CUDA runtime library (libcudart) could be loaded")
    if width == 0 or height == 0:
        return
    code = _fn(dst, dpitch, src, spitch, width, height, kind, stream)  # type: ignore[misc]
    if code:
        name = _err_name(code).decode() if _err_name is not None else "cudaError"
        raise RuntimeError(f"cudaMemcpy2DAsync failed: {name} ({code})")
