"""EngineConfig and the one block-size rule.

The engine's settings are validated once, in ``EngineConfig.__post_init__``; ``LLM`` and
``LLMEngine`` keep their typed keywords (with the config's defaults) and build one. A bad block
size raises the same class (``ConfigArgumentError``, both an ``InvalidConfigError`` and an
``InvalidArgumentError``) at every layer: a KV pool takes a power of two the kernels take, the
block manager alone any integer the core stores.
"""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest

import pagedkv
from pagedkv._checks import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, check_block_size
from pagedkv.config import CacheSpec
from pagedkv.engine.config import EngineConfig
from pagedkv.errors import ConfigArgumentError, InvalidArgumentError, InvalidConfigError
from pagedkv.simulate import SimConfig

POOL_BAD = [0, -16, 12, 24, 3, MAX_BLOCK_SIZE * 2, True, 16.0, "16", None]
MANAGER_BAD = [0, -1, 2**32, True, 4.0, "4"]


def _field_defaults() -> dict:
    return {f.name: f.default for f in dataclasses.fields(EngineConfig)}


# ------------------------------------------------------------------------------ block sizes


@pytest.mark.parametrize("bad", POOL_BAD)
def test_every_pool_layer_refuses_a_bad_block_size_with_one_class(bad):
    layers = {
        "check_block_size": lambda: check_block_size(bad),
        "CacheSpec": lambda: CacheSpec(2, 2, 16, "float16", block_size=bad),
        "EngineConfig": lambda: EngineConfig(block_size=bad),
        # The runner and the engines validate their config before touching the model.
        "ModelRunner": lambda: _runner_class()(None, block_size=bad),
        "LLMEngine": lambda: pagedkv.LLMEngine("/nonexistent", block_size=bad, device="cpu"),
        "LLM": lambda: pagedkv.LLM("/nonexistent", block_size=bad, device="cpu", progress=False),
    }
    for name, build in layers.items():
        with pytest.raises(ConfigArgumentError) as info:
            build()
        err = info.value
        assert isinstance(err, InvalidConfigError) and isinstance(err, InvalidArgumentError), name
        assert err.field == err.what == "block_size" and err.value == bad, name
        assert repr(bad) in str(err), name


@pytest.mark.parametrize("bad", MANAGER_BAD)
def test_the_manager_and_the_simulator_refuse_a_bad_block_size_with_the_same_class(bad):
    for build in (lambda: pagedkv.BlockManager(64, bad), lambda: SimConfig(64, block_size=bad)):
        with pytest.raises(ConfigArgumentError) as info:
            build()
        assert info.value.field == "block_size" and info.value.value == bad


def test_the_manager_counts_tokens_so_it_takes_any_block_size_a_pool_refuses():
    m = pagedkv.BlockManager(64, 12)
    assert m.block_size == 12
    assert check_block_size(12, pool=False) == 12
    with pytest.raises(ConfigArgumentError, match="power of two"):
        CacheSpec(2, 2, 16, "float16", block_size=12)


def test_pool_block_sizes_run_from_one_to_the_kernels_bound():
    for b in (1, 2, 4, 16, 256, MAX_BLOCK_SIZE):
        assert check_block_size(b) == b
        assert CacheSpec(1, 1, 16, "float16", b).block_size == b
        assert EngineConfig(block_size=b).block_size == b


def test_one_default_block_size_everywhere():
    assert DEFAULT_BLOCK_SIZE == 16
    assert CacheSpec(2, 2, 16).block_size == DEFAULT_BLOCK_SIZE
    assert pagedkv.BlockManager(8).block_size == DEFAULT_BLOCK_SIZE
    assert SimConfig(8).block_size == DEFAULT_BLOCK_SIZE
    assert EngineConfig().block_size == DEFAULT_BLOCK_SIZE


# ------------------------------------------------------------------------------ EngineConfig


def test_engine_and_llm_keywords_are_the_config_fields():
    """LLMEngine and LLM take every config knob by keyword, each with the field's default: their
    signatures are generated from EngineConfig, not a second list (LLM shows its loading bar by
    default)."""
    defaults = _field_defaults()
    engine = inspect.signature(pagedkv.LLMEngine.__init__).parameters
    knobs = {n: p.default for n, p in engine.items() if n not in ("self", "model", "device",
                                                                  "dtype")}
    assert knobs == defaults
    assert all(engine[n].kind is inspect.Parameter.KEYWORD_ONLY for n in knobs)
    llm = inspect.signature(pagedkv.LLM.__init__).parameters
    assert set(defaults) <= set(llm)
    for name, p in llm.items():
        if name in defaults and name != "progress":  # LLM shows its loading bar by default
            assert p.default == defaults[name], name
    assert llm["progress"].default is True


def test_every_config_field_has_help_and_the_engine_documents_it():
    """Each knob's description lives once, on its field (``metadata["help"]``, plain text for
    command-line help); LLMEngine's docstring lists them all, generated from the fields."""
    doc = pagedkv.LLMEngine.__doc__ or ""
    for f in dataclasses.fields(EngineConfig):
        text = f.metadata.get("help")
        assert isinstance(text, str) and len(text) > 10 and "``" not in text, f.name
        assert f"{f.name} (default {f.default!r}): " in doc, f.name


@pytest.mark.parametrize("cls", ["LLMEngine", "LLM"])
def test_unknown_engine_keyword_is_a_typed_error_naming_it(cls):
    """A keyword that is no EngineConfig field is refused (before any model is loaded) with an
    InvalidArgumentError naming it, and the closest field when there is one."""
    with pytest.raises(InvalidArgumentError, match=r"unknown keyword 'num_block'.*'num_blocks'") as e:
        getattr(pagedkv, cls)(None, device="cpu", num_block=8)
    assert e.value.what == "num_block"
    with pytest.raises(InvalidArgumentError, match=r"unknown keyword 'frobnicate'") as e:
        getattr(pagedkv, cls)(None, device="cpu", frobnicate=True)
    assert e.value.what == "frobnicate"
    # A bad value of a real field is still the config's own error.
    with pytest.raises(ConfigArgumentError, match="num_blocks"):
        getattr(pagedkv, cls)(None, device="cpu", num_blocks=0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_blocks=8, kv_cache_memory=2**20), "num_blocks"),
        (dict(swap_space="1GiB", num_host_blocks=4), "num_host_blocks"),
        (dict(num_blocks=0), "num_blocks"),
        (dict(num_blocks=True), "num_blocks"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=1.5), "max_num_batched_tokens"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(watermark_blocks=-1), "watermark_blocks"),
        (dict(num_host_blocks=-2), "num_host_blocks"),
        (dict(kv_cache_memory="lots"), "kv_cache_memory"),
        (dict(swap_space=-5), "swap_space"),
        (dict(preemption_mode="never"), "preemption_mode"),
        (dict(attention_backend="cuda"), "attention_backend"),
        (dict(host_link_bytes_per_s=0.0), "host_link_bytes_per_s"),
        (dict(prefill_tokens_per_s=float("inf")), "prefill_tokens_per_s"),
        (dict(step_floor_s=-1.0), "step_floor_s"),
        (dict(tp_timeout_s=None), "tp_timeout_s"),
        (dict(cuda_graphs="false"), "cuda_graphs"),
        (dict(cuda_graph_pieces=0), "cuda_graph_pieces"),
        (dict(cuda_graph_pieces=2.0), "cuda_graph_pieces"),
        (dict(enable_chunked_prefill=1), "enable_chunked_prefill"),
    ],
)
def test_config_refuses_bad_fields_naming_them(kwargs, field):
    with pytest.raises(ConfigArgumentError) as info:
        EngineConfig(**kwargs)
    assert info.value.field == info.value.what == field
    assert info.value.value == kwargs[field]
    assert field in str(info.value)


@pytest.mark.parametrize("name, value", [("small_batch_gemv", 1), ("small_batch_gemv", 0),
                                         ("layerwise_loads", True), ("layerwise_loads", False)])
def test_removed_settings_are_unknown_keywords(name, value):
    """Settings removed after measurement (the GEMV is the one-row default with no setting;
    layer-by-layer loads are gone) are not fields: every entry point refuses them as unknown
    keywords, before loading anything."""
    assert name not in {f.name for f in dataclasses.fields(EngineConfig)}
    for make in (EngineConfig, lambda **kw: dataclasses.replace(EngineConfig(), **kw)):
        with pytest.raises(TypeError, match=name):
            make(**{name: value})
    # The engines' keywords are checked against the fields: the package's typed error, naming it.
    for engine in (pagedkv.LLMEngine, pagedkv.LLM):
        with pytest.raises(InvalidArgumentError, match=f"unknown keyword '{name}'") as info:
            engine(**{name: value})
        assert info.value.what == name


def test_config_normalises_byte_sizes_is_frozen_and_revalidates_on_replace():
    c = EngineConfig(kv_cache_memory="2MiB", swap_space="1KiB", block_size=4)
    assert c.kv_cache_memory == 2 * 2**20 and c.swap_space == 1024
    assert c.host_blocks(256) == 4 and EngineConfig(num_host_blocks=3).host_blocks(256) == 3
    assert EngineConfig().host_blocks(256) == 0
    assert EngineConfig(max_num_seqs=300, max_num_batched_tokens=64).step_token_budget == 300
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_size = 8  # type: ignore[misc]
    with pytest.raises(ConfigArgumentError):
        dataclasses.replace(c, block_size=6)
    # Spawned tensor-parallel ranks receive it pickled.
    assert pickle.loads(pickle.dumps(c)) == c


def test_from_config_refuses_anything_but_a_config():
    with pytest.raises(InvalidArgumentError):
        pagedkv.LLMEngine.from_config({"block_size": 4})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        pagedkv.LLM.from_config(None)  # type: ignore[arg-type]


def _runner_class():
    pytest.importorskip("torch")
    from pagedkv.engine.model_runner import ModelRunner

    return ModelRunner


def test_distributed_never_imports_the_engine():
    """engine -> distributed, one way: the launcher reaches the engine only through the builder
    its WorkerSpec carries."""
    pytest.importorskip("torch")
    import subprocess
    import sys

    code = ("import sys, pagedkv.distributed, pagedkv.distributed.launch; "
            "print(sorted(m for m in sys.modules if m.startswith('pagedkv.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
