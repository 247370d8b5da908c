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

    # `X as X`: an explicit re-export, which a user's `mypy --strict` (no implicit re-exports)
    # requires before it lets `pagedkv.X` through.
    from .buffers import StepBuffers as StepBuffers
    from .buffers import StepTensors as StepTensors
    from .config import CacheSpec as CacheSpec
    from .errors import (
        AllocationFailedError as AllocationFailedError,
        BufferInvalidError as BufferInvalidError,
        BuffersNotRegisteredError as BuffersNotRegisteredError,
        BufferTooSmallError as BufferTooSmallError,
        DuplicateSequenceError as DuplicateSequenceError,
        InvalidArgumentError as InvalidArgumentError,
        InvalidBlockError as InvalidBlockError,
        InvalidConfigError as InvalidConfigError,
        InvariantViolationError as InvariantViolationError,
        InvalidSequenceStateError as InvalidSequenceStateError,
        OutOfBlocksError as OutOfBlocksError,
        OutOfHostBlocksError as OutOfHostBlocksError,
        PagedKVError as PagedKVError,
        PrefixCollisionError as PrefixCollisionError,
        RefcountUnderflowError as RefcountUnderflowError,
        SequenceTooLongError as SequenceTooLongError,
        UnknownSequenceError as UnknownSequenceError,
        WatermarkReachedError as WatermarkReachedError,
    )
    from .manager import AdmitResult as AdmitResult
    from .manager import BlockManager as BlockManager
    from .manager import CostModel as CostModel
    from .manager import Decision as Decision
    from .manager import Stats as Stats
    from .manager import StepInfo as StepInfo
    from .engine.async_llm import AsyncLLM as AsyncLLM
    from .engine.llm import LLM as LLM
    from .engine.llm import LLMEngine as LLMEngine
    from .engine.outputs import CompletionOutput as CompletionOutput
    from .engine.outputs import Logprob as Logprob
    from .engine.outputs import RequestOutput as RequestOutput
    from .engine.sampling_params import RequestOutputKind as RequestOutputKind
    from .engine.sampling_params import SamplingParams as SamplingParams
    from .pool import KVPool as KVPool

    __version__: str

# Public name -> submodule defining it.
_EXPORTS = {
    "BlockManager": "manager",
    "AdmitResult": "manager",
    "StepInfo": "manager",
    "Stats": "manager",
    "CostModel": "manager",
    "Decision": "manager",
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
    "OutOfHostBlocksError": "errors",
    "InvalidSequenceStateError": "errors",
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm",
    "AsyncLLM": "engine.async_llm",
    "SamplingParams": "engine.sampling_params",
    "RequestOutputKind": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "Logprob": "engine.outputs",
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
