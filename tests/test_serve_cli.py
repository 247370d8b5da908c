"""``pagedkv serve``'s command line: flags generated from EngineConfig, vLLM's aliases, ``--config``,
secrets off argv, and the port bound before the model loads.

Parser-level tests run ``main`` with the server's entry point replaced (nothing loads); the
end-to-end ones start a real ``python -m pagedkv serve`` subprocess over a tiny random Llama and
talk to it with the real ``openai`` client.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from pagedkv.cli import build_parser, main, serve_engine_fields, serve_flags_markdown
from pagedkv.engine.config import EngineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _serve_parser():
    return build_parser().subcommand_parsers["serve"]


@pytest.fixture
def captured(monkeypatch):
    """Runs `pagedkv serve` up to the server's entry point, which records its arguments."""
    pytest.importorskip("fastapi")
    import pagedkv.serve.app as app

    calls: list[dict] = []
    monkeypatch.setattr(app, "serve", lambda model, **kw: calls.append({"model": model, **kw}))
    for env in ("PAGEDKV_API_KEY", "VLLM_API_KEY", "PAGEDKV_HASH_SEED",
                "PAGEDKV_REMOTE_CACHE_URL"):
        monkeypatch.delenv(env, raising=False)

    def run(*argv: str) -> dict:
        calls.clear()
        assert main(["serve", *argv]) == 0
        (call,) = calls
        return call

    return run


# ------------------------------------------------------------------------------ generation

def test_every_engine_config_field_is_a_flag_or_marked_off():
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    flagged = {f.name for f, _kind in serve_engine_fields()}
    off = {name for name, f in fields.items() if f.metadata.get("cli") is False}
    assert flagged | off == set(fields) and not flagged & off
    options = _serve_parser()._option_string_actions
    for name in flagged:
        assert fields[name].metadata.get("help"), f"EngineConfig.{name} has no help"
        assert "--" + name.replace("_", "-") in options, name


def test_no_flags_is_engine_config_defaults(captured):
    call = captured()
    assert call["engine_config"] == EngineConfig()
    assert call["model"] is None and call["host"] == "127.0.0.1" and call["port"] == 8000
    assert call["api_key"] is None and call["log_level"] == "info"


#: Every engine flag `pagedkv serve` had before the flags were generated, with what it sets.
LEGACY = [
    (["--num-blocks", "64"], "num_blocks", 64),
    (["--kv-cache-memory", "4GiB"], "kv_cache_memory", 4 * 2**30),
    (["--block-size", "8"], "block_size", 8),
    (["--max-num-seqs", "3"], "max_num_seqs", 3),
    (["--max-num-batched-tokens", "512"], "max_num_batched_tokens", 512),
    (["--no-prefix-caching"], "enable_prefix_caching", False),
    (["--no-chunked-prefill"], "enable_chunked_prefill", False),
    (["--watermark-blocks", "2"], "watermark_blocks", 2),
    (["--swap-space", "1MiB"], "swap_space", 2**20),
    (["--preemption-mode", "swap"], "preemption_mode", "swap"),
    (["--no-cuda-graphs"], "cuda_graphs", False),
    (["--tensor-parallel-size", "2"], "tensor_parallel_size", 2),
    (["--hash-seed", "0x2a"], "hash_seed", 42),
    (["--host-cache-memory", "16MiB"], "host_cache_memory", 16 * 2**20),
    (["--host-cache-memory", "1MiB", "--host-cache-write-through"], "host_cache_write_through",
     True),
    (["--host-cache-memory", "1MiB", "--disk-cache-dir", "/tmp/x", "--disk-cache-memory", "2MiB"],
     "disk_cache_memory", 2 * 2**20),
    (["--host-cache-memory", "1MiB", "--remote-cache-url", "redis://127.0.0.1:1/0"],
     "remote_cache_url", "redis://127.0.0.1:1/0"),
    (["--kv-events-endpoint", "tcp://*:5557", "--kv-events-replay-endpoint", "tcp://*:5558"],
     "kv_events_replay_endpoint", "tcp://*:5558"),
    (["--kv-events-topic", "kv"], "kv_events_topic", "kv"),
    # vLLM's names.
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--no-enable-prefix-caching", "--enable-prefix-caching"], "enable_prefix_caching", True),
    (["--no-enable-chunked-prefill"], "enable_chunked_prefill", False),
    (["--enable-chunked-prefill"], "enable_chunked_prefill", True),
    (["--gpu-memory-utilization", "0.5"], "gpu_memory_utilization", 0.5),
    (["--seed", "7"], "seed", 7),
]


@pytest.mark.parametrize("argv, name, value", LEGACY, ids=[" ".join(a) for a, _n, _v in LEGACY])
def test_engine_flags_set_their_field(captured, argv, name, value):
    config = captured(*argv)["engine_config"]
    assert getattr(config, name) == value
    untouched = {f.name for f in dataclasses.fields(EngineConfig)} - {name}
    default = EngineConfig()
    changed = [n for n in untouched if getattr(config, n) != getattr(default, n)]
    assert len(changed) <= 2, changed  # only the flags given


def test_server_flags_and_aliases(captured):
    call = captured("m", "--host", "0.0.0.0", "--port", "0", "--served-model-name", "x",
                    "--max-queue-size", "3", "--uvicorn-log-level", "debug", "--device", "cpu",
                    "--dtype", "bfloat16", "--kv-cache-dtype", "bf16", "--max-model-len", "100",
                    "--tokenizer", "/tok")
    assert call["model"] == "m" and call["host"] == "0.0.0.0" and call["port"] == 0
    assert call["served_model_name"] == "x" and call["max_queue_size"] == 3
    assert call["log_level"] == "debug" and call["device"] == "cpu" and call["dtype"] == "bfloat16"
    assert call["max_model_len"] == 100 and call["tokenizer"] == "/tok"
    assert captured("--model", "m2")["model"] == "m2"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: pagedkv keeps the KV cache"),
        (["--dtype", "float16", "--kv-cache-dtype", "bf16"], "--kv-cache-dtype bf16"),
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization = 1.5"),
        (["--gpu-memory-utilization", "0.5", "--num-blocks", "4"], "exclusive"),
        (["--num-blocks", "4", "--kv-cache-memory", "1MiB"], "exclusive with kv_cache_memory"),
        (["m", "--model", "m"], "give the model once"),
        (["--max-num-seqs", "0"], "max_num_seqs = 0"),
        (["--api-key", "k", "--api-key-file", "/f"], "--api-key or --api-key-file, not both"),
        (["--hash-seed", "1", "--hash-seed-file", "/f"], "not both"),
        (["--api-key-file", "/no/such/file"], "--api-key-file /no/such/file"),
    ],
)
def test_bad_serve_flags_exit_2_before_serving(captured, capsys, argv, message):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.startswith("pagedkv serve: error:") and err.count("\n") == 1, err


def test_kv_cache_dtype_auto_and_same_as_dtype(captured):
    captured("--kv-cache-dtype", "auto")
    captured("--dtype", "float16", "--kv-cache-dtype", "fp16")


# ---------------------------------------------------------------------------------- --config

def test_config_file_flags_and_command_line_override(captured, tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("model: /from/file\nport: 9001\nmax_num_seqs: 8\nblock-size: 4\n"
                    "enable_prefix_caching: false\nno_chunked_prefill: true\n"
                    "cuda-graphs: false\nswap_space: 1MiB\nseed: 3\n")
    call = captured("--config", str(path))
    c = call["engine_config"]
    assert call["model"] == "/from/file" and call["port"] == 9001
    assert (c.max_num_seqs, c.block_size, c.seed, c.swap_space) == (8, 4, 3, 2**20)
    assert not c.enable_prefix_caching and not c.enable_chunked_prefill and not c.cuda_graphs
    call = captured("cli-model", f"--config={path}", "--block-size", "8",
                    "--enable-prefix-caching", "--port", "9002")
    c = call["engine_config"]
    assert call["model"] == "cli-model" and call["port"] == 9002
    assert c.block_size == 8 and c.enable_prefix_caching and c.max_num_seqs == 8


def test_config_false_for_a_negative_name(captured, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("no-prefix-caching: false\nenable_chunked_prefill: true\n")
    c = captured("--config", str(path), "--no-chunked-prefill")["engine_config"]
    assert c.enable_prefix_caching and not c.enable_chunked_prefill


@pytest.mark.parametrize(
    "text, message",
    [
        ("bogus_knob: 1\n", "unknown key 'bogus_knob'"),
        ("- a\n- b\n", "expected a mapping"),
        ("max_num_seqs: [1, 2]\n", "max_num_seqs takes one value"),
        ("enable_prefix_caching: maybe\n", "takes true or false"),
        ("config: other.yaml\n", "unknown key 'config'"),
        ("max_num_seqs: many\n", "expected an integer"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_config_file_errors(tmp_path, capsys, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--config", str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_config_file_missing(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--config", "/no/such.yaml"])
    assert info.value.code == 2
    assert "--config /no/such.yaml: No such file" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- secrets

def test_secret_flags_on_argv_warn_once_each(captured, capsys):
    call = captured("--api-key", "k1", "--hash-seed", "5", "--host-cache-memory", "1MiB",
                    "--remote-cache-url", "redis://:pw@127.0.0.1:1/0")
    assert call["api_key"] == "k1" and call["engine_config"].hash_seed == 5
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3, err
    for flag in ("--api-key", "--hash-seed", "--remote-cache-url"):
        (line,) = [e for e in err if e.startswith(f"pagedkv serve: warning: {flag} ")]
        assert "/proc/PID/cmdline" in line
    # Abbreviated as argparse allows: still warned.
    captured("--host-cache-memory", "1MiB", "--remote-cache-u=redis://:pw@127.0.0.1:1/0")
    assert "warning: --remote-cache-url" in capsys.readouterr().err
    # A URL without a password is no secret.
    captured("--host-cache-memory", "1MiB", "--remote-cache-url", "redis://127.0.0.1:1/0")
    assert capsys.readouterr().err == ""


def test_secrets_from_the_environment(captured, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    monkeypatch.setenv("PAGEDKV_HASH_SEED", "0x10")
    monkeypatch.setenv("PAGEDKV_REMOTE_CACHE_URL", "redis://:pw@127.0.0.1:1/0")
    call = captured("--host-cache-memory", "1MiB")
    assert call["api_key"] == "vllm-key"
    assert call["engine_config"].hash_seed == 16
    assert call["engine_config"].remote_cache_url == "redis://:pw@127.0.0.1:1/0"
    monkeypatch.delenv("PAGEDKV_REMOTE_CACHE_URL")
    monkeypatch.setenv("PAGEDKV_API_KEY", "pagedkv-key")  # wins over vLLM's
    assert captured()["api_key"] == "pagedkv-key"
    assert captured("--api-key", "flag")["api_key"] == "flag"  # the flag wins (and warns)
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "--api-key" in err
    # The secrets stay out of the config's repr.
    assert "0x10" not in repr(call["engine_config"]) and "pw@" not in repr(call["engine_config"])


def test_config_errors_do_not_echo_secrets(captured, capsys, monkeypatch):
    monkeypatch.setenv("PAGEDKV_REMOTE_CACHE_URL", "redis://:hunter2@127.0.0.1:1/0")
    assert main(["serve"]) == 2  # no host tier: refused, without the password
    err = capsys.readouterr().err
    assert "remote_cache_url" in err and "hunter2" not in err and "redis://:***@" in err, err
    monkeypatch.delenv("PAGEDKV_REMOTE_CACHE_URL")
    with pytest.raises(Exception) as info:
        EngineConfig(hash_seed=2**64 + 12345)
    assert "12345" not in str(info.value)


def test_secrets_from_files(captured, capsys, tmp_path, monkeypatch):
    key, seed = tmp_path / "key", tmp_path / "seed"
    key.write_text("file-key\n")
    seed.write_text("12345\n")
    monkeypatch.setenv("PAGEDKV_API_KEY", "env-key")  # a file wins over the environment
    call = captured("--api-key-file", str(key), "--hash-seed-file", str(seed))
    assert call["api_key"] == "file-key" and call["engine_config"].hash_seed == 12345
    assert capsys.readouterr().err == ""
    seed.write_text("not a number")
    assert main(["serve", "--hash-seed-file", str(seed)]) == 2
    err = capsys.readouterr().err
    assert "--hash-seed-file: not an integer" in err and "not a number" not in err
    monkeypatch.setenv("PAGEDKV_HASH_SEED", str(2**64 + 4242))
    assert main(["serve"]) == 2  # out of range: refused by the config, without the value
    err = capsys.readouterr().err
    assert "hash_seed" in err and "4242" not in err, err


def test_router_hash_seed_from_env_or_file(monkeypatch, capsys, tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("zmq")
    import pagedkv.router.app as router_app

    seen: list = []
    monkeypatch.setattr(router_app, "run", lambda replicas, **kw: seen.append(kw["hash_seed"]))
    monkeypatch.delenv("PAGEDKV_HASH_SEED", raising=False)
    base = ["router", "--replica", "http://127.0.0.1:1"]
    assert main(base) == 2
    assert "$PAGEDKV_HASH_SEED, --hash-seed-file or --hash-seed" in capsys.readouterr().err
    monkeypatch.setenv("PAGEDKV_HASH_SEED", "77")
    assert main(base) == 0 and seen[-1] == 77
    seed = tmp_path / "seed"
    seed.write_text("0x63")
    assert main([*base, "--hash-seed-file", str(seed)]) == 0 and seen[-1] == 99
    assert capsys.readouterr().err == ""
    assert main([*base, "--hash-seed", "5"]) == 0 and seen[-1] == 5
    assert "pagedkv router: warning: --hash-seed on the command line" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- docs

def test_docs_flag_tables_match_the_parser():
    with open(os.path.join(ROOT, "docs", "serve.md"), encoding="utf-8") as fh:
        text = fh.read()
    m = re.search(r"<!-- serve-flags:start -->\n(.*?)<!-- serve-flags:end -->", text, re.S)
    assert m, "docs/serve.md lost its serve-flags markers"
    assert m.group(1) == serve_flags_markdown(), (
        "docs/serve.md's flag tables are stale: paste the output of python -c 'from pagedkv.cli "
        "import serve_flags_markdown; print(serve_flags_markdown(), end=\"\")' between the markers")


# ------------------------------------------------------------------------ end to end (real)

def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PAGEDKV_API_KEY", "VLLM_API_KEY", "PAGEDKV_HASH_SEED")}
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    env["HF_HUB_OFFLINE"] = "1"
    env.update(extra)
    return env


class _Proc:
    """A `python -m pagedkv serve` subprocess whose stderr is collected line by line."""

    def __init__(self, argv: list, env: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedkv", "serve", *argv],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=env)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            assert self.proc.poll() is None, "\n".join(self.lines)
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in:\n" + "\n".join(self.lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.reader.join(10)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_llama import save_tiny_llama

    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny")))


ENGINE_ARGV = ["--device", "cpu", "--num-blocks", "64", "--block-size", "4",
               "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--port", "0"]


@pytest.mark.parametrize("source", ["file", "env"])
def test_api_key_off_argv_end_to_end(tiny_dir, tmp_path, source):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    key = f"sk-test-{source}-5f1e2d"
    argv = [tiny_dir, *ENGINE_ARGV, "--served-model-name", "tiny"]
    if source == "file":
        path = tmp_path / "api-key"
        path.write_text(key + "\n")
        path.chmod(0o600)
        argv += ["--api-key-file", str(path)]
        env = _env()
    else:
        env = _env(VLLM_API_KEY=key)
    server = _Proc(argv, env)
    try:
        port = int(server.wait_for(r"serving on http://127\.0\.0\.1:(\d+)").group(1))
        with open(f"/proc/{server.proc.pid}/cmdline", "rb") as fh:
            cmdline = fh.read()
        assert key.encode() not in cmdline and b"pagedkv" in cmdline
        url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 30
        while True:  # uvicorn may still be starting
            try:
                models = openai.OpenAI(base_url=url, api_key=key, max_retries=0).models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert [m.id for m in models.data] == ["tiny"]
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        out = client.completions.create(model="tiny", prompt="w5 w6", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        bound = next(i for i, line in enumerate(server.lines) if "bound 127.0.0.1:" in line)
        loading = next(i for i, line in enumerate(server.lines) if "pagedkv.serve: loading" in line)
        assert bound < loading  # the port first, then the model
        assert not any("warning: --api-key" in line for line in server.lines)
    finally:
        server.stop()


def test_port_in_use_fails_before_the_model_loads(tiny_dir):
    pytest.importorskip("fastapi")
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pagedkv", "serve", tiny_dir, *ENGINE_ARGV[:-2],
             "--port", str(port)],
            capture_output=True, text=True, env=_env(), timeout=120)
    finally:
        holder.close()
    err = proc.stderr
    assert proc.returncode == 2, err
    assert f"pagedkv serve: error: cannot listen on 127.0.0.1:{port}: address already in use" \
        in err, err
    # Nothing was loaded: no load log line (ours or transformers') before the error, or after.
    for line in ("bound ", "pagedkv.serve: loading", "Loading weights"):
        assert line not in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err


def test_gpu_memory_utilization_on_the_cpu_refused_before_loading(capsys):
    pytest.importorskip("fastapi")
    pytest.importorskip("torch")
    # The model path does not exist: the refusal must come before any load is tried.
    assert main(["serve", "/no/such/model", "--device", "cpu", "--port", "0",
                 "--gpu-memory-utilization", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "gpu_memory_utilization = 0.5" in err and "--kv-cache-memory" in err, err
    assert "no such file" not in err


def test_gpu_memory_utilization_engine_refuses_cpu(tiny_dir):
    from pagedkv import LLM
    from pagedkv.errors import ConfigArgumentError

    with pytest.raises(ConfigArgumentError, match="gpu_memory_utilization.*CUDA"):
        LLM(tiny_dir, device="cpu", gpu_memory_utilization=0.5, progress=False)


def test_max_model_len_and_seed(tiny_dir):
    """--max-model-len caps the context the server reports; --seed makes unseeded sampling
    repeatable (the engine's own knob, read from EngineConfig)."""
    pytest.importorskip("fastapi")
    from pagedkv.errors import ConfigArgumentError
    from pagedkv.serve.launch import build_async_llm

    from pagedkv import SamplingParams

    cfg = EngineConfig(num_blocks=64, block_size=4, seed=11)
    llm = build_async_llm(tiny_dir, config=cfg, device="cpu", max_model_len=100)
    try:
        assert llm.engine.max_model_len == 100
    finally:
        llm.shutdown()
    with pytest.raises(ConfigArgumentError, match="above the model's context of 256"):
        build_async_llm(tiny_dir, config=cfg, device="cpu", max_model_len=257)

    from pagedkv import LLM

    params = SamplingParams(temperature=1.0, max_tokens=8)
    runs = []
    for seed in (11, 11, 12):
        with LLM(tiny_dir, device="cpu", num_blocks=64, block_size=4, seed=seed,
                 progress=False) as llm:
            runs.append([o.outputs[0].token_ids for o in llm.generate(["w5 w6"] * 2, params)])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_gpu_memory_utilization_sizes_the_cuda_pool(monkeypatch):
    """The CUDA branch of the pool sizing, with the device's free memory faked: the pool is the
    given share of it, less the reserve (the default share without the knob)."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from pagedkv.engine import model_runner as mr

    free = 40 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    runner = SimpleNamespace(spec=SimpleNamespace(bytes_per_block=2**20),
                             device=torch.device("cuda"))
    size = mr.ModelRunner._size_pool
    assert size(runner, None, None, 0.5) == (free // 2 - mr.DEFAULT_GPU_RESERVE) // 2**20
    assert size(runner, None, None, None) == \
        (int(free * mr.DEFAULT_GPU_FRACTION) - mr.DEFAULT_GPU_RESERVE) // 2**20
    assert size(runner, 7, None, None) == 7
    with pytest.raises(mr.CapacityError):
        size(runner, None, None, 0.1)  # 4 GiB of 40 is all reserve


def test_bind_socket_errors_are_typed():
    from pagedkv.errors import InvalidConfigError
    from pagedkv.serve.launch import bind_socket

    with pytest.raises(InvalidConfigError, match="cannot listen on no.such.host.invalid:0"):
        bind_socket("no.such.host.invalid", 0)
    with pytest.raises(InvalidConfigError, match="cannot listen on 192.0.2.1:0"):
        bind_socket("192.0.2.1", 0)  # TEST-NET-1: not an address of this machine
    sock = bind_socket("127.0.0.1", 0)
    try:
        sock.listen(1)
        with pytest.raises(InvalidConfigError, match="address already in use") as info:
            bind_socket("127.0.0.1", sock.getsockname()[1])
        assert info.value.field == "port"
    finally:
        sock.close()


def test_client_limit_flags_reach_serve(monkeypatch):
    """--max-logprobs and the connection limits reach serve() under its keyword names; the ones
    not given keep serve()'s own defaults (they are not passed)."""
    from pagedkv import cli

    seen = {}
    monkeypatch.setattr("pagedkv.serve.app.serve", lambda model, **kw: seen.update(kw))
    args = build_parser().parse_args(
        ["serve", "some-model", "--max-logprobs", "5", "--max-connections", "7",
         "--header-timeout", "2.5", "--timeout-keep-alive", "3"])
    assert cli._serve_limits(args) == {"max_logprobs": 5, "max_connections": 7,
                                       "header_timeout_s": 2.5, "keep_alive_s": 3}
    for bad in (["--max-logprobs", "-1"], ["--header-timeout", "0"], ["--max-connections", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "m", *bad])
