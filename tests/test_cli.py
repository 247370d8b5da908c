"""The command line: help texts, dispatch, and one-line errors with exit status 2."""

import os
import subprocess
import sys

import pytest

from pagedkv.cli import SUBCOMMANDS, build_parser, main


def test_top_level_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in ("demo", "plan", "simulate", "serve", "bench"):
        assert name in out


#: What each subcommand's help must mention; `bench` is a group (`bench serve --help` has the flags).
HELP_WORDS = {
    "demo": ("--json", "--model"),
    "plan": ("--json", "--model", "--gpu-mem"),
    "simulate": ("--json", "--model", "--gpu-mem"),
    "serve": ("MODEL", "--model", "--host", "--port", "--max-queue-size", "--num-blocks",
              "--config", "--api-key-file", "--hash-seed-file", "--gpu-memory-utilization",
              "--max-model-len", "--enable-prefix-caching", "--no-prefix-caching"),
    "bench serve": ("--url", "--num-prompts", "--request-rate", "--dataset", "--json"),
    "router": ("--replica", "--events", "--replay", "--hash-seed", "--hash-seed-file", "--policy",
               "--model"),
}


@pytest.mark.parametrize("command", sorted(set(SUBCOMMANDS) - {"bench"}) + ["bench serve"])
def test_subcommand_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([*command.split(), "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for word in HELP_WORDS[command]:
        assert word in out, word


def test_bench_without_a_benchmark_prints_its_help(capsys):
    assert main(["bench"]) == 2
    assert "serve" in capsys.readouterr().err


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["frobnicate"], "invalid choice"),
        (["plan", "--gpu-mem", "lots"], "cannot parse size"),
        (["plan", "--block-size", "0"], "expected an integer >= 1"),
        (["simulate", "--requests", "many"], "expected an integer"),
        (["simulate", "--rate", "fast"], "expected a number"),
    ],
)
def test_bad_flags_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err


def test_simulate_config_errors_exit_2(capsys):
    # Rejected while building the workload, before any simulation.
    assert main(["simulate", "--num-blocks", "64", "--rate", "0"]) == 2
    err = capsys.readouterr().err
    assert "arrival_rate" in err and err.count("\n") == 1
    assert main(["simulate", "--num-blocks", "64", "--prefix-len", "8"]) == 2
    assert "num_prefixes" in capsys.readouterr().err


def test_parser_is_rebuildable():
    # Each call builds a fresh parser: no state leaks between invocations.
    a, b = build_parser(), build_parser()
    assert a is not b
    assert a.parse_args(["plan", "--model", "llama-3-8b"]).model == "llama-3-8b"


def _env():
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_python_dash_m_runs():
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "plan", "--model", "mistral-7b",
                           "--gpu-mem", "40GB", "--seq-lens", "2048"],
                          capture_output=True, text=True, env=_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "bytes per token   128.00 KiB (131,072 B)" in proc.stdout


def test_python_dash_m_bad_flag_exit_2():
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "plan", "--bogus"],
                          capture_output=True, text=True, env=_env(), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("pagedkv plan: error:")
    assert "Traceback" not in proc.stderr


def test_cli_does_not_import_torch():
    code = ("import sys; from pagedkv.cli import main; "
            "rc = main(['plan', '--model', 'llama-3-8b', '--seq-lens', '1k']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
