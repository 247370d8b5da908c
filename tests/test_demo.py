"""``pagedkv demo``: the workload, the report, the CLI.

The fast tests run the demo on a small random Llama checkpoint (no tokenizer: the demo's stand-in
prompt ids) through ``pagedkv.cli.main``; the ``slow`` test runs the real default,
SmolLM2-135M-Instruct from the embedded GGUF, as a subprocess exactly as a user would
(``pagedkv demo --json``), and asserts the JSON fields and that the greedy answers equal
transformers' dense-cache ``generate``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pagedkv.cli import main  # noqa: E402
from pagedkv.demo import demo_num_blocks  # noqa: E402

FIELDS = {
    "model", "device", "dtype", "block_size", "num_blocks", "kv_pool_bytes", "max_tokens",
    "num_requests", "num_sequences", "prompt_tokens", "generated_tokens", "load_time_s",
    "generate_time_s", "reference_time_s", "tokens_per_s", "total_tokens_per_s", "mean_ttft_s",
    "max_ttft_s", "peak_kv_utilization", "mean_kv_utilization", "prefix_hit_ratio",
    "prefix_hit_tokens", "preemptions", "preempted_requests", "cow_copies", "greedy_checked",
    "greedy_matching", "greedy_matches_transformers", "outputs",
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    torch.manual_seed(99)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   initializer_range=0.1, eos_token_id=None, bos_token_id=None,
                                   pad_token_id=None)
    path = str(tmp_path_factory.mktemp("demo-llama"))
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _check_report(r: dict, *, max_tokens: int) -> None:
    assert FIELDS <= set(r)
    assert r["num_requests"] == len(r["outputs"]) >= 4
    assert r["num_sequences"] > r["num_requests"]  # some requests ask for n = 2
    assert r["generated_tokens"] > 0 and r["tokens_per_s"] > 0
    assert 0 < r["mean_ttft_s"] <= r["max_ttft_s"]
    assert 0 < r["peak_kv_utilization"] <= 1 and 0 < r["mean_kv_utilization"] <= 1
    assert r["prefix_hit_ratio"] > 0.3  # the shared system prompt
    assert r["preemptions"] >= 1 and r["preempted_requests"]
    assert r["cow_copies"] >= 1
    assert r["greedy_checked"] >= 3
    assert r["greedy_matches_transformers"] is True
    assert r["greedy_matching"] == r["greedy_checked"]
    for row in r["outputs"]:
        assert len(row["answers"]) == row["n"]
        for a in row["answers"]:
            assert 1 <= len(a["token_ids"]) <= max_tokens
            assert a["finish_reason"] in ("stop", "length")


def test_demo_num_blocks_forces_preemption_but_fits_one():
    lens, ns = [120, 122, 125], [1, 2, 1]
    blocks = demo_num_blocks(lens, ns, 40, 16, shared_prefix=100)
    peak = sum(n * -(-(p + 40) // 16) for p, n in zip(lens, ns))
    assert blocks < peak
    assert blocks >= -(-(125 + 40) // 16) + 2


def test_demo_json_on_a_tiny_model(tiny_model, capsys):
    assert main(["demo", "--model", tiny_model, "--json", "--quiet", "--max-tokens", "24"]) == 0
    r = json.loads(capsys.readouterr().out)
    _check_report(r, max_tokens=24)
    assert r["device"] == "cpu" and r["dtype"] == "float32"
    # The KV cache groups stage: a Gemma-3-27B-shaped run (5 full, 26 sliding groups) holds more
    # requests at once than full-attention accounting in the same memory, and its shared
    # documents still hit.
    k = r["kv_groups"]
    assert (k["full_groups"], k["windowed_groups"]) == (5, 26)
    assert k["concurrency_groups"] > 1.5 * k["concurrency_full"]
    assert k["hit_ratio_full"] > 0.1
    assert k["hit_ratio_groups"] >= 0.85 * k["hit_ratio_full"]


def test_demo_text_report(tiny_model, capsys):
    assert main(["demo", "--model", tiny_model, "--quiet", "--max-tokens", "8", "--no-check"]) == 0
    out = capsys.readouterr().out
    for needle in ("KV pool:", "throughput", "time to first token", "KV utilization",
                   "prefix cache", "preemptions", "not checked", "demo ran in",
                   "KV cache groups (gemma-3-27b: 5 full and 26 sliding groups", "counted as full "
                   "attention"):
        assert needle in out
    assert main(["demo", "--model", tiny_model, "--quiet", "--max-tokens", "8", "--no-check",
                 "--no-kv-groups"]) == 0
    assert "KV cache groups" not in capsys.readouterr().out


def test_demo_serves_metrics(tiny_model, capsys, monkeypatch):
    """``--metrics-port 0``: the endpoint is up while the demo serves, and reports its figures."""
    pytest.importorskip("prometheus_client")
    import urllib.request

    import pagedkv.demo as demo
    import pagedkv.metrics as metrics

    servers, scraped = [], []
    real_start, real_serve = metrics.start_metrics_server, demo._serve

    def start(*a, **kw):
        servers.append(real_start(*a, **kw))
        return servers[-1]

    def serve(*a, **kw):
        out = real_serve(*a, **kw)
        port = servers[0][0].server_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            scraped.append(r.read().decode())
        return out

    monkeypatch.setattr(metrics, "start_metrics_server", start)
    monkeypatch.setattr(demo, "_serve", serve)
    assert main(["demo", "--model", tiny_model, "--json", "--quiet", "--max-tokens", "8",
                 "--no-check", "--metrics-port", "0"]) == 0
    cap = capsys.readouterr()
    r = json.loads(cap.out)
    assert f"metrics: http://127.0.0.1:{servers[0][0].server_port}/metrics" in cap.err
    text = scraped[0]
    assert "pagedkv_kv_cache_usage_ratio" in text
    assert f"pagedkv_num_blocks {float(r['num_blocks'])}" in text
    total = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("pagedkv_preemptions_total{"))
    assert total == r["preemptions"]


def test_demo_bad_model_is_one_line_error(tmp_path, capsys):
    assert main(["demo", "--model", str(tmp_path / "missing"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pagedkv demo: error:")


@pytest.mark.slow
def test_demo_default_model_end_to_end():
    pytest.importorskip("gguf")
    from pagedkv.engine.loader import default_model_path

    try:
        default_model_path()
    except Exception as exc:  # the wheel is not installed here
        pytest.skip(str(exc))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "demo", "--json", "--quiet"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    _check_report(r, max_tokens=r["max_tokens"])
    assert r["model"].startswith("SmolLM2-135M-Instruct")
    # Real text came out of the real tokenizer.
    assert all(a["text"].strip() for row in r["outputs"] for a in row["answers"])
