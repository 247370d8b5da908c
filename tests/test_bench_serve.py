"""``pagedkv bench serve`` end to end: a real ``pagedkv serve`` subprocess on loopback with the tiny
model, the benchmark run through the CLI with vLLM's flags, and the saved result read back with
vLLM's keys; plus the flat-key arithmetic of :func:`pagedkv.serve.bench.summarize`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("httpx")
np = pytest.importorskip("numpy")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_process import ROOT, ServeProcess  # noqa: E402

from pagedkv.serve.bench import RequestResult, result_filename, summarize  # noqa: E402


def test_flat_keys_match_numpy():
    rs = []
    for i in range(5):
        r = RequestResult(prompt_len=10 + i, output_len=4, ok=True, sent=0.0, ttft=0.01 * (i + 1),
                          itl=[0.002, 0.003, 0.004], e2e=0.01 * (i + 1) + 0.009)
        rs.append(r)
    rs.append(RequestResult(prompt_len=3, status=503, error="queue full"))
    s = summarize(rs, 2.0, percentile_metrics=("ttft", "e2el"), metric_percentiles=(50, 99.9))
    ttft = np.array([0.01, 0.02, 0.03, 0.04, 0.05]) * 1e3
    assert s["completed"] == 5 and s["failed"] == 1 and s["errors"] == ["queue full"]
    assert s["total_input_tokens"] == 60 and s["total_output_tokens"] == 20
    assert s["request_throughput"] == pytest.approx(2.5)
    assert s["output_throughput"] == pytest.approx(10.0)
    assert s["mean_ttft_ms"] == pytest.approx(ttft.mean())
    assert s["median_ttft_ms"] == pytest.approx(np.median(ttft))
    assert s["std_ttft_ms"] == pytest.approx(ttft.std())
    assert s["p50_ttft_ms"] == pytest.approx(np.percentile(ttft, 50))
    assert s["p99.9_ttft_ms"] == pytest.approx(np.percentile(ttft, 99.9))
    assert "p50_e2el_ms" in s and "mean_itl_ms" not in s and "p99_ttft_ms" not in s
    assert s["input_lens"] == [10, 11, 12, 13, 14] and s["output_lens"] == [4] * 5


def test_result_filename_is_vllms_pattern():
    name = result_filename("vllm", {"model_id": "org/SmolLM2", "request_rate": 4.0}, now=0)
    assert name.startswith("vllm-4.0qps-SmolLM2-") and name.endswith(".json")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from tiny_llama import save_tiny_llama

    model = save_tiny_llama(str(tmp_path_factory.mktemp("tiny")))
    s = ServeProcess(model, ["--num-blocks", "64", "--max-num-seqs", "4",
                             "--max-num-batched-tokens", "128"])
    try:
        yield s
    finally:
        s.stop()


def test_bench_serve_cli_against_pagedkv_serve(server, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv", "bench", "serve", "--backend", "vllm",
         "--base-url", server.url, "--dataset-name", "random", "--random-input-len", "8",
         "--random-output-len", "5", "--num-prompts", "8", "--request-rate", "40",
         "--max-concurrency", "3", "--num-warmups", "2", "--seed", "3",
         "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
         "--extra-body", '{"ignore_eos": true}', "--save-result", "--result-dir",
         str(tmp_path / "results"), "--result-filename", "run.json"],
        env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert "request throughput" in out.stdout and "TTFT" in out.stdout
    assert "\r" not in out.stderr  # no progress bar off a terminal
    r = json.loads((tmp_path / "results" / "run.json").read_text())
    assert r["completed"] == 8 and r["failed"] == 0 and r["num_prompts"] == 8
    # --extra-body reached the server: ignore_eos made every request generate all 5 tokens.
    assert r["total_output_tokens"] == 40 and r["output_lens"] == [5] * 8
    assert r["total_input_tokens"] == 64
    assert r["backend"] == "vllm" and r["request_rate"] == 40.0 and r["max_concurrency"] == 3
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert r[f"{stat}_{metric}_ms"] >= 0
        assert r[f"p99_{metric}_ms"] >= r[f"p50_{metric}_ms"]
    assert r["p50_ttft_ms"] > 0 and r["p50_e2el_ms"] >= r["p50_ttft_ms"]
    assert r["request_throughput"] > 0 and r["output_throughput"] > 0
    # The warm-up requests were sent but not counted: the server finished 8 + 2, all by length.
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=5) as m:
        text = m.read().decode()
    done = [line for line in text.splitlines()
            if line.startswith("pagedkv_request_success_total{")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in done) == 10, done
    assert sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pagedkv_generation_tokens_total")) == 50


def test_bench_serve_bad_flags_are_usage_errors(capsys):
    from pagedkv.cli import main

    for argv, message in ((["--percentile-metrics", "ttft,nope"], "ttft, tpot, itl, e2el"),
                          (["--extra-body", "[1, 2]"], "expected a JSON object"),
                          (["--metric-percentiles", "0"], "must be in (0, 100]")):
        with pytest.raises(SystemExit) as exc:
            main(["bench", "serve", *argv])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
