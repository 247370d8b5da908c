"""The engine's units and their seams (docs/architecture.md draws them).

* input processing and output processing never import each other, nor the engine core: they share
  the :class:`~pagedkv.engine.request.Request` record alone;
* chat rendering (:mod:`pagedkv.chat`) is neutral: importing it (as the router does) imports no
  part of the engine;
* the block manager is built by the engine core, not by the model runner;
* a server reads the engine's signals through one engine method (``metrics_collector``), not
  its parts.

Each import check runs in a fresh interpreter, so what an earlier test imported cannot hide an
edge.
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


def test_the_server_gets_its_metrics_from_the_engine(tmp_path):
    """``LLMEngine.metrics_collector`` exports the engine's manager, queues and tiers (what the
    server registers), and keeps collecting after shutdown closed the tiers."""
    pytest.importorskip("prometheus_client")
    pytest.importorskip("torch")
    from prometheus_client import CollectorRegistry, generate_latest

    import pagedkv
    from tiny_llama import save_tiny_llama

    model = save_tiny_llama(str(tmp_path / "model"), 256)
    engine = pagedkv.LLMEngine(model, device="cpu", num_blocks=24, block_size=16,
                               host_cache_memory=64 * 2 * 2 * 16 * 2 * 16 * 4)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(engine.metrics_collector(labels={"model_name": "tiny"}, max_age_s=0.0,
                                               step_wait_s=0.0))
    engine.add_request(None, list(range(3, 40)),
                       pagedkv.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    text = generate_latest(registry).decode()
    assert 'pagedkv_num_blocks{model_name="tiny"} 24.0' in text
    assert 'pagedkv_tier_usage_bytes{model_name="tiny",tier="host"}' in text
    engine.shutdown()
    text = generate_latest(registry).decode()
    assert 'pagedkv_num_blocks{model_name="tiny"} 24.0' in text
    assert "pagedkv_tier_usage_bytes" not in text
