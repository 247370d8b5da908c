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
    assert str(err) == "--plot needs matplotlib, which is not installed: pip install 'pagedkv[plot]'"
    assert "pagedkv[metrics]" in str(_optional.missing("prometheus_client"))
    assert "pagedkv[gpu]" in str(_optional.missing("torch"))
    assert "pagedkv[engine]" in str(_optional.missing("transformers"))


def test_require_and_check(monkeypatch):
    assert _optional.require("json").__name__ == "json"
    _optional.check_available("json")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError, match=r"pagedkv\[plot\]"):
        _optional.require("matplotlib")
    with pytest.raises(MissingDependencyError, match=r"pagedkv\[plot\]"):
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
                            "installed: pip install 'pagedkv[plot]'\n")
    assert not (tmp_path / "p.png").exists()


def test_plot_timeline_without_matplotlib(monkeypatch):
    from pagedkv.simulate import SimConfig, WorkloadConfig, plot_timeline, simulate

    pytest.importorskip("torch")  # the step buffers need it until numpy buffers land
    result = simulate(WorkloadConfig(num_requests=3, max_model_len=256, seed=1), SimConfig(num_blocks=256),
                      progress=False, record_timeline=True)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError, match=r"pagedkv\[plot\]"):
        plot_timeline(result, "unused.png")


def test_simulate_without_torch_is_one_line(monkeypatch, capsys):
    # The step buffers import torch; a fresh import of pagedkv.buffers must find it missing.
    monkeypatch.delitem(sys.modules, "pagedkv.buffers", raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)
    rc = main(["simulate", "--requests", "3", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == ("pagedkv simulate: error: torch is needed, which is not installed: "
                   "pip install 'pagedkv[gpu]'\n")
