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
    from .buffers import StepInfo as StepInfo
    from .buffers import StepTensors as StepTensors
    from .config import CacheSpec as CacheSpec
    # A star import re-exports exactly `errors.__all__` (mypy treats it as explicit), so the
    # exception names are listed once, there.
    from .errors import *  # noqa: F401,F403
    from .groups import KVCacheGroup as KVCacheGroup
    from .manager import AdmitResult as AdmitResult
    from .manager import BlockManager as BlockManager
    from .manager import CostModel as CostModel
    from .manager import Decision as Decision
    from .manager import Stats as Stats
    from .engine.async_llm import AsyncLLM as AsyncLLM
    from .engine.llm import LLM as LLM
    from .engine.llm_engine import LLMEngine as LLMEngine
    from .engine.outputs import CompletionOutput as CompletionOutput
    from .engine.outputs import Logprob as Logprob
    from .engine.outputs import RequestOutput as RequestOutput
    from .engine.sampling_params import RequestOutputKind as RequestOutputKind
    from .engine.sampling_params import SamplingParams as SamplingParams
    from .kv_pool import KVPool as KVPool
    from .hashing import hash_prompt as hash_prompt

    __version__: str

# Public name -> submodule defining it. The exception classes are not listed here: their one list is
# `errors.__all__`, read when an exception (or `__all__`) is first asked for.
_EXPORTS = {
    "BlockManager": "manager",
    "AdmitResult": "manager",
    "Stats": "manager",
    "CostModel": "manager",
    "Decision": "manager",
    "KVCacheGroup": "groups",
    "StepBuffers": "buffers",
    "StepInfo": "buffers",
    "StepTensors": "buffers",
    "CacheSpec": "config",
    "KVPool": "kv_pool",
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "AsyncLLM": "engine.async_llm",
    "SamplingParams": "engine.sampling_params",
    "RequestOutputKind": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "Logprob": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "hash_prompt": "hashing",
}

def _error_names() -> list[str]:
    return list(importlib.import_module(".errors", __name__).__all__)

def __getattr__(name: str) -> Any:
    if name == "__all__":
        # Built on first use, not at import: reading `errors.__all__` means importing `errors`.
        names = ["__version__", *_EXPORTS, *_error_names()]
        globals()["__all__"] = names
        return names
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
    if module is None and not name.startswith("_") and name in _error_names():
        module = "errors"
    if module is None:
        raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    # Cache it so later lookups are plain module attribute reads.
    globals()[name] = value
    return value

def __dir__() -> list[str]:
    return sorted(set(__getattr__("__all__")) | {n for n in globals() if n.startswith("__")})
