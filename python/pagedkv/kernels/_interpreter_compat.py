"""Compatibility fix for Triton's CPU interpreter (TRITON_INTERPRET=1) under numpy >= 2.4.

Owns one narrowly scoped patch, applied only when the interpreter is active: Triton 3.6's
interpreter turns a scalar into a Python int with `int(array)` on a one-element 1-D array, which
numpy 2.4 rejects, so any loop with a bound loaded at run time (`range(start, seq_len, ...)`) fails
there. Upstream fixed this (triton-lang/triton#9171, PR #9172) by squeezing first; this module
installs the same behaviour for releases that predate the fix. Compiled GPU kernels are never
affected: the patched function is part of the interpreter only.
"""

from __future__ import annotations

import os

_applied = False


def apply() -> None:
    global _applied
    if _applied or os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    import numpy as np

    try:
        int(np.zeros(1, dtype=np.int32))
        _applied = True
        return  # this numpy still converts size-1 arrays; nothing to fix
    except TypeError:
        pass
    from triton.runtime import interpreter as interp

    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None:
        _applied = True
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    _applied = True
