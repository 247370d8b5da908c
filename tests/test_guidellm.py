"""A third-party load generator, GuideLLM, against a real ``pagedkv serve`` on loopback.

GuideLLM is not in the project venv: ``scripts/test_guidellm.sh`` installs the pins of
``requirements/guidellm.txt`` with ``--no-deps`` into ``./.guidellm/site`` (``PAGEDKV_GUIDELLM_SITE``
moves it) and runs this file; without that directory the test skips. GuideLLM runs as a subprocess
with that directory first on its path, so its pins (click 8.4) never meet the venv's.

The load: 6 streaming ``/v1/completions`` requests, 2 at a time, 16 synthetic prompt tokens and 8
output tokens each (``ignore_eos``), on the tiny model. Synthetic prompts are English text cut to
length by a tokenizer: a byte-level one is built here (any text round-trips), while the server
tokenizes the same text with its own. GuideLLM sends ``stream_options.continuous_usage_stats`` and
``stop: null`` with every streaming request: the server must accept both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_process import ROOT, ServeProcess  # noqa: E402

SITE = os.environ.get("PAGEDKV_GUIDELLM_SITE", os.path.join(ROOT, ".guidellm", "site"))
REQUESTS = 6


def _byte_tokenizer(directory: str) -> str:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(directory)
    return directory


def _refusal(url: str) -> str:
    """The server's error for the body GuideLLM sends (``""`` if it accepts it)."""
    body = {"model": "tiny", "prompt": "w3 w4", "max_tokens": 2, "stream": True, "stop": None,
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            return ""
    except urllib.error.HTTPError as exc:
        return exc.read().decode(errors="replace")


def test_guidellm_against_pagedkv_serve(tmp_path):
    if not os.path.isdir(os.path.join(SITE, "guidellm")):
        pytest.skip(f"GuideLLM is not installed in {SITE} (scripts/test_guidellm.sh installs it)")
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    from tiny_llama import save_tiny_llama

    model = save_tiny_llama(str(tmp_path / "tiny"))
    tokenizer = _byte_tokenizer(str(tmp_path / "bytes"))
    server = ServeProcess(model, ["--served-model-name", "tiny", "--num-blocks", "64",
                                  "--max-num-seqs", "4"])
    try:
        out = tmp_path / "guidellm.json"
        scenario = {"spec": {
            "backend": {"kind": "openai_http", "target": server.url, "model": "tiny",
                        "request_format": "/v1/completions"},
            "profile": {"kind": "concurrent", "streams": 2},
            "tokenizer": {"kind": "hf_auto", "model": tokenizer},
            "data": [{"kind": "synthetic_text", "prompt_tokens": 16, "output_tokens": 8}],
            "constraints": [{"kind": "max_requests", "count": REQUESTS}],
            "outputs": [{"kind": "json", "path": str(out)}],
        }}
        (tmp_path / "scenario.json").write_text(json.dumps(scenario))
        env = dict(os.environ, PYTHONPATH=SITE, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        run = subprocess.run(
            [sys.executable, "-m", "guidellm", "run", "--scenario", "scenario.json",
             "--disable-console-interactive"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
            stdin=subprocess.DEVNULL)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        bench = json.loads(out.read_text())["benchmarks"][0]
        totals = bench["metrics"]["request_totals"]
        # On failure, what the server answers GuideLLM's request shape says why.
        assert totals == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                          "total": REQUESTS}, (totals, _refusal(server.url))
        tokens = bench["metrics"]["output_token_count"]["successful"]
        assert tokens["total_sum"] == REQUESTS * 8, tokens
    finally:
        server.stop()
