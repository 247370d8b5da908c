"""Many host<->device copies in one CUDA driver call (``cuMemcpyBatchAsync``), for the offloading
copier's DMAs.

Owns :class:`BatchDMA`: the driver entry point found once per process, and one call that queues
a list of ``(dst, src, bytes)`` copies on a stream, each ordered after the stream's earlier work
(source access order *stream*: a copy never reads its source before the work queued before it
has written it). One driver call per list replaces one ``copy_`` per copy: on an H100 a list of
256 scattered 2 MiB copies ran at 97-99% of one 512 MiB copy's rate, against 93-95% for one
``copy_`` each (``benches/bench_dma_probe.py``), and the host thread issues it in microseconds
instead of ~20 us a copy.

The batch entry point exists in drivers for CUDA 12.8 and later (``cuMemcpyBatchAsync_v2``, the
CUDA 13 form, is preferred; the 12.8 form takes one more argument). Where it is missing (older
drivers, ROCm, CPU-only builds), where the calling thread has no current CUDA context, or where
``PAGEDKV_BATCH_DMA=0``, :meth:`BatchDMA.copy` returns False and the caller issues its copies
one by one. A call the driver refuses turns batching off for the process (with one warning) and
also returns False: re-issuing the whole list one copy at a time is safe, since a copy that did
run wrote the same bytes.

Invariants: nothing here allocates or frees memory or synchronizes; the caller guarantees that
every address is valid for its size until the stream has passed the copies.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from typing import Any, Optional

import numpy as np

__all__ = ["BatchDMA", "batch_dma"]

_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM


class _Attributes(ctypes.Structure):
    """``CUmemcpyAttributes``: the source access order, two location hints (unused: zero), the
    flags (none)."""

    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_type", ctypes.c_int),
                ("src_loc_id", ctypes.c_int), ("dst_loc_type", ctypes.c_int),
                ("dst_loc_id", ctypes.c_int), ("flags", ctypes.c_uint)]


class BatchDMA:
    """The driver's batched copy, or nothing (module docs). ``available`` says which."""

    def __init__(self) -> None:
        self.available = False
        self.reason = ""
        self._fn: Any = None
        self._with_fail_index = False
        self._ctx_current: Any = None
        if os.environ.get("PAGEDKV_BATCH_DMA", "1") == "0":
            self.reason = "PAGEDKV_BATCH_DMA=0"
            return
        try:
            cu = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            self.reason = f"no CUDA driver library ({exc})"
            return
        for name, fail_index in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
            fn = getattr(cu, name, None)
            if fn is not None:
                self._fn, self._with_fail_index = fn, fail_index
                break
        if self._fn is None:
            self.reason = "the CUDA driver has no cuMemcpyBatchAsync (needs CUDA 12.8 or later)"
            return
        args = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                ctypes.POINTER(_Attributes), ctypes.c_void_p, ctypes.c_size_t]
        if self._with_fail_index:
            args.append(ctypes.POINTER(ctypes.c_size_t))
        args.append(ctypes.c_void_p)
        self._fn.argtypes = args
        self._fn.restype = ctypes.c_int
        self._ctx_current = cu.cuCtxGetCurrent
        self._ctx_current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._ctx_current.restype = ctypes.c_int
        self._attrs = _Attributes(_ORDER_STREAM, 0, 0, 0, 0, 0)
        self._attr_index = (ctypes.c_size_t * 1)(0)
        self._fail = ctypes.c_size_t(0)
        self.available = True

    def copy(self, stream: int, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> bool:
        """Queues ``sizes[i]`` bytes from address ``srcs[i]`` to ``dsts[i]`` for every ``i`` on the
        CUDA stream handle ``stream``, in one driver call; False (nothing queued) where batching is
        not available (module docs). The three arrays are ``uint64`` and of one length."""
        if not self.available:
            return False
        n = int(sizes.size)
        if n == 0:
            return True
        ctx = ctypes.c_void_p()
        if self._ctx_current(ctypes.byref(ctx)) != 0 or not ctx.value:
            return False  # this thread has no current context: the caller's copy_ makes one
        d = np.ascontiguousarray(dsts, dtype=np.uint64)
        s = np.ascontiguousarray(srcs, dtype=np.uint64)
        z = np.ascontiguousarray(sizes, dtype=np.uint64)
        call = [d.ctypes.data, s.ctypes.data, z.ctypes.data, n, ctypes.byref(self._attrs),
                ctypes.addressof(self._attr_index), 1]
        if self._with_fail_index:
            call.append(ctypes.byref(self._fail))
        call.append(stream)
        rc = self._fn(*call)
        if rc != 0:
            self.available = False
            self.reason = f"cuMemcpyBatchAsync returned CUDA error {rc}"
            warnings.warn(f"pagedkv: batched DMAs turned off: {self.reason}; copying one by one",
                          RuntimeWarning, stacklevel=2)
            return False
        return True


_BATCH: Optional[BatchDMA] = None


def batch_dma() -> BatchDMA:
    """The process's :class:`BatchDMA` (found on first use)."""
    global _BATCH
    if _BATCH is None:
        _BATCH = BatchDMA()
    return _BATCH
