"""Bad input at the binding and Python layers raises a typed ``pagedkv.errors`` exception.

Covers what used to slip through or escape as a built-in exception: bools taken as ids or counts,
big-endian numpy arrays, a salt that is not encodable, non-bool flags, a bad ``device=``, an
unreadable ``--hf-config``, and failed allocations. Every rejected call leaves the manager as it was.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagedkv import BlockManager, StepBuffers, _core
from pagedkv import errors
from pagedkv.errors import (
    InvalidArgumentError,
    InvalidConfigError,
    PagedKVError,
)


def _state(m: BlockManager) -> tuple:
    return (m.stats(), len(m), m.num_free_blocks)


@pytest.fixture
def m() -> BlockManager:
    mgr = BlockManager(64, 4, watermark_blocks=0)
    mgr.admit(0, [1, 2, 3])
    mgr.admit(1, [4, 5, 6, 7, 8])
    mgr.attach_buffers(StepBuffers(4, 32, mgr.max_blocks_per_seq, device="cpu"))
    return mgr


# ---------------------------------------------------------------------------------------- bools


@pytest.mark.parametrize("flag", [True, False])
@pytest.mark.parametrize(
    "call",
    [
        lambda m, b: m.free(b),
        lambda m, b: m.seq_len(b),
        lambda m, b: m.block_table(b),
        lambda m, b: m.block_hashes(b),
        lambda m, b: m.append(b, [1]),
        lambda m, b: m.admit(b, [1, 2]),
        lambda m, b: m.fork(b, 10),
        lambda m, b: m.fork(1, b),
        lambda m, b: m.block_refcount(b),
        lambda m, b: m.can_admit(b),
        lambda m, b: m.step([1], b),
        lambda m, b: m.step([b], 1),
        lambda m, b: m.step([1], [b]),
        lambda m, b: m.append_batch([b], [1]),
        lambda m, b: m.append_batch([1], [b]),
        lambda m, b: m.admit(9, [1, b, 2]),
        lambda m, b: m.admit(9, (b,)),
        lambda m, b: m.append(1, [b]),
        lambda m, b: m.admit(9, [1, 2], adapter_id=b),
        lambda m, b: m.admit(9, [1, 2, 3], mm_inputs=[(b, 2, b"h")]),
    ],
)
def test_bools_are_not_ids_or_counts(m: BlockManager, call, flag: bool) -> None:
    before = _state(m)
    with pytest.raises(InvalidArgumentError) as info:
        call(m, flag)
    assert "bool" in str(info.value)
    assert _state(m) == before
    m.check_invariants()


def test_bool_is_not_a_member(m: BlockManager) -> None:
    # `in` answers "is this a live sequence id"; a bool is not an id, whatever its int value.
    assert 1 in m and 0 in m
    assert True not in m and False not in m
    assert not m._core.contains(True)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_blocks=True),
        dict(num_blocks=16, block_size=True),
        dict(num_blocks=16, watermark_blocks=False),
        dict(num_blocks=16, max_blocks_per_seq=True),
    ],
)
def test_bool_sizes_rejected_by_the_manager(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        BlockManager(**kwargs)


def test_hash_blocks_rejects_bool_block_size() -> None:
    with pytest.raises(InvalidArgumentError):
        _core.hash_blocks([1, 2, 3, 4], True, hash_seed=0)


# ----------------------------------------------------------------------------------------- flags


@pytest.mark.parametrize("flag", ["enable_prefix_caching", "verify_prefix"])
@pytest.mark.parametrize("value", ["false", "", 0, 1, None, np.bool_(True), [False]])
def test_manager_flags_take_bools_only(flag: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        BlockManager(16, 4, **{flag: value})
    assert info.value.what == flag


def test_manager_flags_accept_bools() -> None:
    m = BlockManager(16, 4, enable_prefix_caching=False, verify_prefix=True)
    assert m.enable_prefix_caching is False and m.verify_prefix is True


@pytest.mark.parametrize("value", ["false", 0, None])
def test_buffer_and_pool_flags_take_bools_only(value: object) -> None:
    from pagedkv.config import CacheSpec
    from pagedkv.kv_pool import KVPool

    with pytest.raises(InvalidArgumentError):
        StepBuffers(2, 4, 2, device="cpu", csr=value)  # type: ignore[arg-type]
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
    with pytest.raises(InvalidArgumentError):
        KVPool(spec, 2, zero=value)  # type: ignore[arg-type]
    b = StepBuffers(2, 4, 2, device="cpu")
    from pagedkv import StepInfo

    info = StepInfo(1, 1, 1, 0, 1)
    with pytest.raises(InvalidArgumentError):
        b.views(info, on_device=value)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        b.to_device(info, non_blocking=value)  # type: ignore[arg-type]


def test_simulation_flag_takes_bools_only() -> None:
    from pagedkv.simulate import SimConfig

    with pytest.raises(InvalidConfigError):
        SimConfig(num_blocks=16, enable_prefix_caching="false")  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["tie_word_embeddings", "attention_bias"])
def test_model_config_flags_take_bools_only(field: str) -> None:
    from pagedkv.config import ModelConfig

    cfg = {
        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 100,
        "torch_dtype": "bfloat16", field: "false",
    }
    with pytest.raises(InvalidConfigError, match="must be a bool"):
        ModelConfig.from_hf_config(cfg)
    cfg[field] = False
    assert getattr(ModelConfig.from_hf_config(cfg), field) is False


# ------------------------------------------------------------------------------- numpy arrays


@pytest.mark.parametrize("dtype", [">i8", ">u4", ">i4", ">u8", ">i2"])
def test_big_endian_arrays_are_read_by_value(dtype: str) -> None:
    m = BlockManager(64, 4, watermark_blocks=0, hash_seed=7)
    m.attach_buffers(StepBuffers(4, 32, m.max_blocks_per_seq, device="cpu"))
    m.admit(np.uint64(5), np.array([1, 2, 300, 4, 5], dtype=dtype))
    m.admit(6, np.array([1, 2, 300, 4, 5], dtype="<i8"))
    assert m.seq_len(5) == 5
    m.append_batch(np.array([5, 6], dtype=dtype), np.array([9, 9], dtype=dtype))
    info = m.step(np.array([5, 6], dtype=dtype), np.array([6, 6], dtype=dtype))
    assert info.num_tokens == 12
    assert m.block_hashes(5)[0] == _core.hash_blocks([1, 2, 300, 4], 4, hash_seed=7)[0]
    hashes = _core.hash_blocks(np.array(range(8), dtype=dtype), 4, hash_seed=7)
    assert hashes == _core.hash_blocks(list(range(8)), 4, hash_seed=7)


def test_big_endian_out_of_range_is_typed() -> None:
    m = BlockManager(64, 4)
    with pytest.raises(InvalidArgumentError) as info:
        m.admit(1, np.array([1, -3], dtype=">i8"))
    assert info.value.value == -3
    with pytest.raises(InvalidArgumentError):
        m.admit(1, np.array([1, 2], dtype=">f8"))
    assert len(m) == 0


# ------------------------------------------------------------------------------------- salts


@pytest.mark.parametrize("salt", ["\ud800", "ok\udfff", "\udcff-tenant"])
def test_unencodable_salt_is_invalid_argument(m: BlockManager, salt: str) -> None:
    before = _state(m)
    with pytest.raises(InvalidArgumentError) as info:
        m.admit(9, [1, 2, 3], cache_salt=salt)
    assert info.value.what == "cache_salt"
    with pytest.raises(InvalidArgumentError):
        _core.hash_blocks([1, 2, 3, 4], 4, cache_salt=salt, hash_seed=0)
    assert _state(m) == before


@pytest.mark.parametrize("salt", ["", b"", bytearray()])
def test_empty_salt_is_refused_not_shared(m: BlockManager, salt: object) -> None:
    from pagedkv.scheduler import Sequence

    prompt = list(range(100, 109))
    m.admit(2, prompt)
    m.step([2], 9)  # two full blocks of `prompt` enter the unsalted cache
    before = _state(m)
    calls = [
        lambda: m.admit(9, prompt, cache_salt=salt),
        lambda: m.can_admit(prompt, cache_salt=salt),
        lambda: m.can_admit(9, cache_salt=salt),
        lambda: m.admit_batch([9, 10], [prompt, prompt], cache_salts=[b"x", salt]),
        lambda: Sequence(9, prompt, cache_salt=salt),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError, match="pass None for no salt") as info:
            call()
        assert info.value.what in ("cache_salt", "cache_salts") and info.value.value == salt
        assert _state(m) == before and 9 not in m and 10 not in m
    # None is the one spelling of "no salt"; a real salt does not share the unsalted blocks.
    assert m.admit(9, prompt, cache_salt=None).cached_tokens == 8
    assert m.admit(10, prompt, cache_salt=b"tenant").cached_tokens == 0


# ------------------------------------------------------------------------------------- devices


@pytest.mark.parametrize("device", ["not-a-device", "cuda:x", "mps", "meta", "cuda:99", 3.5, ""])
def test_bad_device_is_invalid_argument(device: object) -> None:
    from pagedkv.config import CacheSpec
    from pagedkv.kv_pool import KVPool

    with pytest.raises(InvalidArgumentError) as info:
        StepBuffers(2, 4, 2, device=device)  # type: ignore[arg-type]
    assert info.value.what == "device"
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
    with pytest.raises(InvalidArgumentError) as info:
        KVPool(spec, 2, device=device)  # type: ignore[arg-type]
    assert info.value.what == "device"


def test_cuda_device_without_cuda_is_invalid_argument() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: 'cuda' is a valid device")
    from pagedkv.config import CacheSpec
    from pagedkv.kv_pool import KVPool

    with pytest.raises(InvalidArgumentError, match="CUDA"):
        StepBuffers(2, 4, 2, device="cuda")
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
    with pytest.raises(InvalidArgumentError, match="CUDA"):
        KVPool(spec, 2, device="cuda")


# --------------------------------------------------------------------------------- allocation


def test_pool_allocation_failure_is_typed() -> None:
    from pagedkv.config import CacheSpec
    from pagedkv.kv_pool import KVPool

    spec = CacheSpec(num_layers=64, num_kv_heads=64, head_dim=256, dtype="float32", block_size=64)
    with pytest.raises(errors.AllocationFailedError) as info:
        KVPool(spec, 2**31 - 1, device="cpu", zero=False)
    err = info.value
    assert isinstance(err, PagedKVError) and isinstance(err, MemoryError)
    assert err.bytes == spec.bytes_per_block * (2**31 - 1)
    assert "pool" in err.what


def test_allocation_failed_error_fields() -> None:
    err = errors.AllocationFailedError("allocation failed", what="step buffers", bytes=123)
    assert err.what == "step buffers" and err.bytes == 123
    assert errors.AllocationFailedError.field_names == ("what", "bytes")


# -------------------------------------------------------------------------------------- CLI


def test_deeply_nested_hf_config_gives_a_clear_cli_error(tmp_path, capsys) -> None:
    from pagedkv.cli import main

    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["plan", "--hf-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "nested too deeply" in err and "Traceback" not in err
    # The same through the library: a typed error, no RecursionError.
    from pagedkv.config import ModelConfig

    with pytest.raises(InvalidConfigError, match="nested too deeply"):
        ModelConfig.from_hf_config(str(path))
    # A normal config next to it still reads.
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"a": [[[1]]]}))
    with pytest.raises(InvalidConfigError, match="missing required field"):
        ModelConfig.from_hf_config(str(ok))
