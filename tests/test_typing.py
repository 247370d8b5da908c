"""The package as a user's type checker sees it: ``mypy --strict`` on user code, and stubtest.

- ``tests/typing/user_check.py`` (every public name, used as the README does) and every ``python``
  code block of ``README.md`` must pass ``mypy --strict``. Errors *inside* pagedkv are not the
  user's: as for any installed package, mypy is told to ignore them (``ignore_errors`` for
  ``pagedkv.*``), but every type the user touches still comes from pagedkv's sources and stubs.
- ``reveal_type`` probes check the check is not vacuous: the revealed types must be the real ones
  (``builtins.int``), not ``Any`` (which a broken re-export behind the module ``__getattr__`` would
  give).
- ``python -m mypy.stubtest pagedkv._core``: the stub ``_core.pyi`` matches the built extension.

These need mypy (pinned in ``requirements/dev.txt``). Without it they skip — except under CI
(``CI`` set), where a missing mypy is a failure, not a silent skip.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pagedkv

pytestmark = pytest.mark.typing

ROOT = Path(__file__).resolve().parent.parent
USER_CHECK = ROOT / "tests" / "typing" / "user_check.py"

try:
    import mypy  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise RuntimeError("mypy is not installed: CI runs the typing checks (requirements/dev.txt)")
    pytest.skip("mypy is not installed (pip install -r requirements/dev.txt)", allow_module_level=True)

MYPY_INI = """\
[mypy]
strict = True
warn_unused_configs = True

[mypy-pagedkv.*]
# The library's own internals are not the user's to fix (an installed package's never are).
ignore_errors = True
"""

# Each probe: an expression, and a regex the type mypy reveals for it must match in full (mypy
# writes "int" or "builtins.int" depending on its version; "Any" must never match).
PROBES = {
    "pagedkv.BlockManager(4).admit(1, [1, 2]).cached_tokens": r"(builtins\.)?int",
    "pagedkv.BlockManager(4).step([1], 1)": r".*\bpagedkv\.buffers\.StepInfo\b.*",
    "pagedkv.BlockManager(4).stats().kv_utilization": r"(builtins\.)?float",
    "pagedkv.UnknownSequenceError('x').seq_id": r"(builtins\.)?int",
    "pagedkv.InvalidConfigError('x').field": r"(builtins\.)?str \| None|Union\[(builtins\.)?str, None\]",
    "pagedkv.CacheSpec(1, 1, 8).bytes_per_token": r"(builtins\.)?int",
    "pagedkv.__version__": r"(builtins\.)?str",
}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # The sources of this checkout, not whatever copy of pagedkv the interpreter has installed.
    env["MYPYPATH"] = str(ROOT / "python")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.fixture(scope="module")
def mypy_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict[str, Path]]:
    """One mypy run over every file (a cold run parses torch's annotations once: ~30 s)."""
    work = tmp_path_factory.mktemp("mypy")
    (work / "mypy.ini").write_text(MYPY_INI)
    files = {"user_check": USER_CHECK}
    for i, block in enumerate(readme_python_blocks()):
        path = work / f"readme_block_{i}.py"
        path.write_text(block)
        files[f"readme_block_{i}"] = path
    probe = work / "probes.py"
    probe.write_text("import pagedkv\n\n" + "".join(f"reveal_type({expr})\n" for expr in PROBES))
    files["probes"] = probe
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(work / "mypy.ini"),
         "--cache-dir", str(work / "cache"), "--python-executable", sys.executable,
         "--no-error-summary", "--hide-error-context", *map(str, files.values())],
        capture_output=True, text=True, env=_env(), cwd=work, timeout=600,
    )
    return proc.returncode, proc.stdout + proc.stderr, files


def _lines_for(output: str, path: Path) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(str(path)) or
            line.startswith(path.name)]


def test_user_check_passes_strict(mypy_run: tuple[int, str, dict[str, Path]]) -> None:
    _, output, files = mypy_run
    errors = [l for l in _lines_for(output, files["user_check"]) if ": error:" in l]
    assert errors == [], "\n".join(errors)


def test_readme_python_blocks_pass_strict(mypy_run: tuple[int, str, dict[str, Path]]) -> None:
    _, output, files = mypy_run
    blocks = [p for name, p in files.items() if name.startswith("readme_block_")]
    assert blocks, "README.md has no ```python block"
    errors = [l for p in blocks for l in _lines_for(output, p) if ": error:" in l]
    assert errors == [], "\n".join(errors)


def test_revealed_types_are_real(mypy_run: tuple[int, str, dict[str, Path]]) -> None:
    code, output, files = mypy_run
    notes = [l for l in _lines_for(output, files["probes"]) if "Revealed type is" in l]
    revealed = [l.split('Revealed type is "', 1)[1].rsplit('"', 1)[0] for l in notes]
    assert len(revealed) == len(PROBES), output
    for (expr, pattern), got in zip(PROBES.items(), revealed):
        assert re.fullmatch(pattern, got), f"{expr}: revealed {got!r}, expected {pattern!r}"
    assert code == 0, output


def test_user_check_names_every_public_name() -> None:
    used = set(re.findall(r"\bpagedkv\.(\w+)", USER_CHECK.read_text(encoding="utf-8")))
    missing = sorted(set(pagedkv.__all__) - used)
    assert missing == [], f"tests/typing/user_check.py does not use: {', '.join(missing)}"


def test_user_check_runs() -> None:
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(USER_CHECK)], capture_output=True, text=True,
                          env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_stubtest_core_extension() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy.stubtest", "pagedkv._core"],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
