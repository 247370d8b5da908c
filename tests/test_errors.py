"""Exception classes and the mapping of every core error variant to its class.

Each variant is checked twice where a public call can reach it: once through a sample raised by the
extension (``_core._raise_core_error``: the same mapping code, fixed field values, so the message and
attributes can be compared exactly) and once through a real call that provokes it.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np
import pytest

import pagedkv
from pagedkv import errors
from pagedkv import _core

# variant -> (class, builtin base, expected message, expected fields) for the sample the
# extension builds for that variant.
SAMPLES = {
    "InvalidConfig": (
        errors.InvalidConfigError,
        ValueError,
        "invalid config: block_size = 0: must be at least 1",
        {"field": "block_size", "value": 0, "reason": "must be at least 1"},
    ),
    "InvalidArgument": (
        errors.InvalidArgumentError,
        ValueError,
        "invalid argument: num_tokens = -1: must not be negative",
        {"what": "num_tokens", "value": -1, "reason": "must not be negative"},
    ),
    "UnknownSequence": (
        errors.UnknownSequenceError,
        KeyError,
        "unknown sequence id 7",
        {"seq_id": 7},
    ),
    "DuplicateSequence": (
        errors.DuplicateSequenceError,
        ValueError,
        "sequence id 7 already exists",
        {"seq_id": 7},
    ),
    "OutOfBlocks": (
        errors.OutOfBlocksError,
        errors.PagedKVError,
        "out of blocks: need 3, 1 available",
        {"needed": 3, "available": 1},
    ),
    "WatermarkReached": (
        errors.WatermarkReachedError,
        errors.OutOfBlocksError,
        "admission needs 3 blocks but only 1 are free above the watermark reserve of 2",
        {"needed": 3, "available": 1, "watermark": 2},
    ),
    "SequenceTooLong": (
        errors.SequenceTooLongError,
        ValueError,
        "sequence 7 would need 9 blocks; a block-table row holds 8",
        {"seq_id": 7, "needed_blocks": 9, "max_blocks_per_seq": 8},
    ),
    "BufferTooSmall": (
        errors.BufferTooSmallError,
        ValueError,
        "buffer `slot_mapping` too small: need 9 elements, capacity 8",
        {"buffer": "slot_mapping", "needed": 9, "capacity": 8},
    ),
    "BufferInvalid": (
        errors.BufferInvalidError,
        ValueError,
        "buffer `seq_lens`: expected int32, got int64",
        {"buffer": "seq_lens", "expected": "int32", "got": "int64"},
    ),
    "BuffersNotRegistered": (
        errors.BuffersNotRegisteredError,
        RuntimeError,
        "no step buffers registered",
        {},
    ),
    "InvalidBlock": (
        errors.InvalidBlockError,
        IndexError,
        "block id 12 out of range: the pool holds 10 blocks",
        {"block": 12, "num_blocks": 10},
    ),
    "RefcountUnderflow": (
        errors.RefcountUnderflowError,
        RuntimeError,
        "refcount underflow on block 3 (double free)",
        {"block": 3},
    ),
    "PrefixCollision": (
        errors.PrefixCollisionError,
        RuntimeError,
        "prefix hash collision on block 4: cached token ids differ from the request's",
        {"block": 4},
    ),
    "InvariantViolation": (
        errors.InvariantViolationError,
        RuntimeError,
        "invariant violated: free list holds block 2 twice",
        {"detail": "free list holds block 2 twice"},
    ),
    "AllocationFailed": (
        errors.AllocationFailedError,
        MemoryError,
        "allocation failed: prefix hash map needs 1099511627776 bytes",
        {"what": "prefix hash map", "bytes": 1 << 40},
    ),
    "OutOfHostBlocks": (
        errors.OutOfHostBlocksError,
        errors.PagedKVError,
        "out of host blocks: need 4, 1 available",
        {"needed": 4, "available": 1},
    ),
    "InvalidSequenceState": (
        errors.InvalidSequenceStateError,
        ValueError,
        "sequence 9 is swapped; this call needs it running",
        {"seq_id": 9, "state": "swapped", "expected": "running"},
    ),
}


def test_every_error_class_is_covered_by_a_sample() -> None:
    classes = {
        getattr(errors, n) for n in errors.__all__ if n != "PagedKVError"
    }
    assert classes == {cls for cls, *_ in SAMPLES.values()}


@pytest.mark.parametrize("variant", sorted(SAMPLES))
def test_core_variant_maps_to_its_class(variant: str) -> None:
    cls, base, message, fields = SAMPLES[variant]
    with pytest.raises(errors.PagedKVError) as info:
        _core._raise_core_error(variant)
    err = info.value
    assert type(err) is cls
    assert isinstance(err, base)
    assert str(err) == message
    assert err.message == message
    assert err.fields == fields
    for name, value in fields.items():
        assert getattr(err, name) == value
    assert set(fields) == set(cls.field_names)


def test_unknown_variant_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="no core error variant"):
        _core._raise_core_error("NoSuchVariant")


def test_key_error_subclass_prints_without_quotes() -> None:
    err = errors.UnknownSequenceError("unknown sequence id 5", seq_id=5)
    assert str(err) == "unknown sequence id 5"
    # A plain KeyError would print "'unknown sequence id 5'".
    assert str(KeyError("unknown sequence id 5")) != str(err)
    assert isinstance(err, KeyError)


@pytest.mark.parametrize("variant", sorted(SAMPLES))
def test_errors_pickle_with_their_fields(variant: str) -> None:
    with pytest.raises(errors.PagedKVError) as info:
        _core._raise_core_error(variant)
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is type(info.value)
    assert str(back) == str(info.value)
    assert back.fields == info.value.fields


def test_python_side_construction_with_message_only() -> None:
    # Other modules (config sizing) raise these with a message alone.
    err = errors.InvalidConfigError("block_size must be a power of two, got 3")
    assert str(err) == "block_size must be a power of two, got 3"
    assert err.fields == {}


def test_package_root_exports_every_error() -> None:
    for name in errors.__all__:
        assert getattr(pagedkv, name) is getattr(errors, name)


def test_binding_raises_exactly_the_classes_errors_defines() -> None:
    """The binding's class list (``CLASS_NAMES`` in ``rust/python/src/errors.rs``), the classes it
    actually raises, and ``errors.__all__`` (which the package root re-exports) are one set."""
    source = Path(__file__).resolve().parent.parent / "rust" / "python" / "src" / "errors.rs"
    if not source.exists():
        pytest.skip("the binding's sources are not beside the tests")
    block = re.search(r"const CLASS_NAMES: \[&str; \d+\] = \[(.*?)\];", source.read_text(), re.S)
    assert block is not None, "CLASS_NAMES not found in errors.rs"
    binding = re.findall(r'"(\w+)"', block.group(1))
    assert len(binding) == len(set(binding))
    assert set(binding) == set(errors.__all__) - {"PagedKVError"}
    raised = set()
    for variant in SAMPLES:
        with pytest.raises(errors.PagedKVError) as info:
            _core._raise_core_error(variant)
        raised.add(type(info.value).__name__)
    assert raised == set(binding)
    assert set(errors.__all__) <= set(pagedkv.__all__)


# --------------------------------------------------------------------------------------------------
# The same variants, reached through real calls.


def _step_buffers(max_seqs: int = 2, max_tokens: int = 8, max_blocks: int = 4):
    from pagedkv import StepBuffers

    return StepBuffers(max_seqs, max_tokens, max_blocks, device="cpu")


def _invalid_config() -> None:
    pagedkv.BlockManager(0)


def _invalid_argument() -> None:
    pagedkv.BlockManager(8, 4).admit(1, [1, -2, 3])


def _unknown_sequence() -> None:
    pagedkv.BlockManager(8, 4).free(42)


def _duplicate_sequence() -> None:
    m = pagedkv.BlockManager(8, 4, watermark_blocks=0)
    m.admit(1, [1, 2])
    m.admit(1, [3, 4])


def _out_of_blocks() -> None:
    m = pagedkv.BlockManager(3, 2, watermark_blocks=0, enable_prefix_caching=False)
    m.admit(1, [1, 2, 3, 4])
    m.admit(2, [9])
    m.append(1, [5])


def _watermark_reached() -> None:
    m = pagedkv.BlockManager(4, 2, watermark_blocks=2)
    m.admit(1, [1, 2, 3, 4, 5])


def _sequence_too_long() -> None:
    m = pagedkv.BlockManager(16, 2, watermark_blocks=0, max_blocks_per_seq=2)
    m.admit(1, [1, 2, 3, 4, 5])


def _buffer_too_small() -> None:
    m = pagedkv.BlockManager(16, 2, watermark_blocks=0, max_blocks_per_seq=4)
    m.attach_buffers(_step_buffers(max_seqs=1))
    m.admit(1, [1])
    m.admit(2, [2])
    m.step([1, 2], 1)


def _buffer_invalid() -> None:
    # One buffer set, two managers: the second may not take it while the first holds it.
    bufs = _step_buffers()
    m1, m2 = pagedkv.BlockManager(16, 2), pagedkv.BlockManager(16, 2)
    m1.attach_buffers(bufs)
    m2.attach_buffers(bufs)


def _allocation_failed() -> None:
    from pagedkv import StepBuffers

    StepBuffers(2**20, 16, 2**25, device="cpu", csr=False)


def _buffers_not_registered() -> None:
    m = pagedkv.BlockManager(16, 2)
    m.admit(1, [1])
    m.step([1], 1)


def _invalid_block() -> None:
    pagedkv.BlockManager(8, 4).block_refcount(8)


def _out_of_host_blocks() -> None:
    m = pagedkv.BlockManager(16, 2, watermark_blocks=0)  # num_host_blocks=0: swap disabled
    m.admit(1, [1, 2, 3])
    m.swap_out([1])


def _invalid_sequence_state() -> None:
    m = pagedkv.BlockManager(16, 2, watermark_blocks=0, num_host_blocks=4)
    m.admit(1, [1, 2, 3])
    m.swap_out([1])
    m.append(1, [4])


REAL = {
    "InvalidConfig": _invalid_config,
    "InvalidArgument": _invalid_argument,
    "UnknownSequence": _unknown_sequence,
    "DuplicateSequence": _duplicate_sequence,
    "OutOfBlocks": _out_of_blocks,
    "WatermarkReached": _watermark_reached,
    "SequenceTooLong": _sequence_too_long,
    "BufferTooSmall": _buffer_too_small,
    "BufferInvalid": _buffer_invalid,
    "BuffersNotRegistered": _buffers_not_registered,
    "InvalidBlock": _invalid_block,
    "AllocationFailed": _allocation_failed,
    "OutOfHostBlocks": _out_of_host_blocks,
    "InvalidSequenceState": _invalid_sequence_state,
}
# Not reachable through a public call, so covered by the samples above only: RefcountUnderflow (the
# manager never over-frees), PrefixCollision (verify mode serves a collision as a miss) and
# InvariantViolation (a bug if ever seen).


@pytest.mark.parametrize("variant", sorted(REAL))
def test_real_call_raises_the_variant_class(variant: str) -> None:
    cls = SAMPLES[variant][0]
    with pytest.raises(cls) as info:
        REAL[variant]()
    assert type(info.value) is cls
    assert str(info.value)
    assert set(info.value.fields) == set(cls.field_names)


def test_real_messages_name_value_and_limit() -> None:
    with pytest.raises(errors.InvalidArgumentError) as info:
        _invalid_argument()
    assert "-2" in str(info.value) and "4294967295" in str(info.value)
    assert info.value.value == -2
    with pytest.raises(errors.WatermarkReachedError) as wm:
        _watermark_reached()
    assert wm.value.needed == 3 and wm.value.watermark == 2
    with pytest.raises(errors.SequenceTooLongError) as tl:
        _sequence_too_long()
    assert tl.value.needed_blocks == 3 and tl.value.max_blocks_per_seq == 2
    with pytest.raises(errors.UnknownSequenceError) as us:
        _unknown_sequence()
    assert us.value.seq_id == 42 and str(us.value) == "unknown sequence id 42"


def test_token_id_above_u32_names_the_value() -> None:
    m = pagedkv.BlockManager(8, 4)
    with pytest.raises(errors.InvalidArgumentError) as info:
        m.admit(1, np.array([1, 2**32], dtype=np.int64))
    assert info.value.value == 2**32
    assert str(2**32) in str(info.value)
    assert 1 not in m


def test_impossible_pool_raises_allocation_failed() -> None:
    """2**31 - 1 blocks of 2**31 - 1 tokens with verify on would need 2**64 bytes of token ids:
    a typed error naming the bytes, not an aborted interpreter."""
    n = 2**31 - 1
    with pytest.raises(errors.AllocationFailedError) as info:
        pagedkv.BlockManager(n, n, max_blocks_per_seq=1)
    assert info.value.bytes == n * n * 4
    assert "verify_prefix" in info.value.what
    assert str(n * n * 4) in str(info.value)
