"""What a new user meets first: the OpenMP wait policy of the Python API, the start-up summary
line, and progress bars that only a terminal gets."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Records OMP_WAIT_POLICY at the moment torch is first imported, then touches pagedkv.LLM.
_PROBE = r"""
import os, sys, importlib.abc
seen = []
class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("OMP_WAIT_POLICY"))
        return None
sys.meta_path.insert(0, Hook())
import pagedkv
pagedkv.LLM
print(seen[0] if seen else "torch not imported", os.environ.get("OMP_WAIT_POLICY"))
"""


def _probe(env_policy):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_llm_path_sets_passive_wait_before_torch_loads():
    pytest.importorskip("torch")
    assert _probe(None) == ["PASSIVE", "PASSIVE"]


def test_a_users_wait_policy_wins():
    pytest.importorskip("torch")
    assert _probe("ACTIVE") == ["ACTIVE", "ACTIVE"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tiny_llama import save_tiny_llama

    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny")))


def test_startup_summary_is_one_log_line(tiny_dir, caplog):
    from pagedkv.engine.llm import LLM

    with caplog.at_level("INFO", logger="pagedkv.engine"):
        llm = LLM(tiny_dir, device="cpu", num_blocks=48, block_size=16, max_num_seqs=4,
                  swap_space="1MiB", preemption_mode="recompute")
    lines = [r.getMessage() for r in caplog.records if r.name == "pagedkv.engine"
             and r.getMessage().startswith("pagedkv engine:")]
    assert len(lines) == 1, lines
    line = lines[0]
    engine = llm.llm_engine
    bpb = engine.runner.spec.bytes_per_block
    assert f"KV pool 48 blocks x 16 tokens = 768 tokens, {48 * bpb / 2**20:.1f} MiB" in line
    # The tiny model's context is 256 tokens: 768 / 256 = 3 requests of full length at once.
    assert "max concurrency 3.00x at 256 tokens per request" in line
    host = engine.runner.swap.host.num_blocks
    assert f"tiers: cpu pool, host {host} blocks" in line and "preemption recompute" in line
    assert "\n" not in line


def test_demo_json_is_clean_when_not_a_terminal(tiny_dir):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv", "demo", "--model", tiny_dir, "--json", "--max-tokens",
         "6", "--no-check"],
        env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    import json

    report = json.loads(out.stdout)  # stdout is the JSON object and nothing else
    assert report["generated_tokens"] > 0
    # No progress bar drew on stderr (neither pagedkv's nor transformers' loading bars).
    assert "\r" not in out.stderr and "it/s" not in out.stderr and "|" not in out.stderr, \
        out.stderr
