"""pagedkv: a paged KV cache for LLM serving.

The package root only names things; it imports nothing heavy. Every public name is resolved on first
access (module ``__getattr__``), so ``import pagedkv`` stays fast, loads neither torch nor the Rust
extension, and ``import pagedkv.kernels`` / ``import pagedkv.config`` work on a machine where the
extension ``pagedkv._core`` is not built. ``pagedkv.BlockManager`` loads the extension the first
time it is touched.
"""

from __future__ import annotations

import importlib

# Not `from typing import TYPE_CHECKING`: importing typing would double the cost of `import pagedkv`.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .buffers import StepBuffers, StepTensors
    from .config import CacheSpec
    from .errors import (
        AllocationFailedError,
        BufferInvalidError,
        BuffersNotRegisteredError,
        BufferTooSmallError,
        DuplicateSequenceError,
        InvalidArgumentError,
        InvalidBlockError,
        InvalidConfigError,
        InvariantViolationError,
        OutOfBlocksError,
        PagedKVError,
        PrefixCollisionError,
        RefcountUnderflowError,
        SequenceTooLongError,
        UnknownSequenceError,
        WatermarkReachedError,
    )
    from .manager import AdmitResult, BlockManager, Stats, StepInfo
    from .engine.llm import LLM, LLMEngine
    from .engine.outputs import CompletionOutput, RequestOutput
    from .engine.sampling_params import SamplingParams
    from .pool import KVPool

# Public name -> submodule defining it.
_EXPORTS = {
    "BlockManager": "manager",
    "AdmitResult": "manager",
    "StepInfo": "manager",
    "Stats": "manager",
    "StepBuffers": "buffers",
    "StepTensors": "buffers",
    "CacheSpec": "config",
    "KVPool": "pool",
    "PagedKVError": "errors",
    "InvalidConfigError": "errors",
    "AllocationFailedError": "errors",
    "InvalidArgumentError": "errors",
    "UnknownSequenceError": "errors",
    "DuplicateSequenceError": "errors",
    "OutOfBlocksError": "errors",
    "WatermarkReachedError": "errors",
    "SequenceTooLongError": "errors",
    "BufferTooSmallError": "errors",
    "BufferInvalidError": "errors",
    "BuffersNotRegisteredError": "errors",
    "InvalidBlockError": "errors",
    "RefcountUnderflowError": "errors",
    "PrefixCollisionError": "errors",
    "InvariantViolationError": "errors",
    "AllocationFailedError": "errors",
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        # The extension carries the crate version; without it, fall back to the installed metadata.
        try:
            from ._core import __version__ as version
        except ImportError:
            from importlib.metadata import PackageNotFoundError, version as _dist_version

            try:
                version = _dist_version("pagedkv")
            except PackageNotFoundError:
                version = "0+unknown"
        globals()["__version__"] = version
        return version
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    # Cache it so later lookups are plain module attribute reads.
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__")})
