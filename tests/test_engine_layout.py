"""The engine's units import only what their seams allow (docs/architecture.md draws them).

* input processing and output processing never import each other, nor the engine core: they share
  the :class:`~pagedkv.engine.request.Request` record alone;
* chat rendering (:mod:`pagedkv.chat`) is neutral: importing it (as the router does) imports no
  part of the engine;
* the block manager is built by the engine core, not by the model runner.

Each check imports in a fresh interpreter, so what an earlier test imported cannot hide an edge.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _loaded_after(module: str) -> set[str]:
    code = (f"import sys, {module}\n"
            "print('\\n'.join(m for m in sys.modules if m.startswith('pagedkv')))\n")
    env_path = str(ROOT / "python")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return set(proc.stdout.split())


@pytest.mark.parametrize("module, forbidden", [
    ("pagedkv.engine.input_processor",
     {"pagedkv.engine.output_processor", "pagedkv.engine.core", "pagedkv.engine.llm_engine"}),
    ("pagedkv.engine.output_processor",
     {"pagedkv.engine.input_processor", "pagedkv.engine.core", "pagedkv.engine.llm_engine"}),
    ("pagedkv.engine.request",
     {"pagedkv.engine.input_processor", "pagedkv.engine.output_processor", "pagedkv.engine.core"}),
    ("pagedkv.chat", {"pagedkv.engine"}),
])
def test_units_do_not_import_across_their_seams(module, forbidden):
    loaded = _loaded_after(module)
    assert module in loaded
    crossed = {m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)}
    assert crossed == set(), f"{module} imports {sorted(crossed)}"


def test_the_engine_core_builds_the_block_manager():
    from pagedkv.engine.core import build_block_manager
    from pagedkv.engine.model_runner import ModelRunner

    assert callable(build_block_manager)
    assert not hasattr(ModelRunner, "new_block_manager")
