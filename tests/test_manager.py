"""BlockManager through Python: every method, every error path, and step output vs a Python model."""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import pytest
import torch

from pagedkv import AdmitResult, BlockManager, Stats, StepBuffers, StepInfo, _core
from pagedkv.errors import (
    BuffersNotRegisteredError,
    BufferTooSmallError,
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidBlockError,
    InvalidConfigError,
    OutOfBlocksError,
    SequenceTooLongError,
    UnknownSequenceError,
    WatermarkReachedError,
)

SENTINEL = -7


def snapshot(m: BlockManager, ids: Iterable[int]) -> tuple:
    """Everything observable about the manager's state for the given live ids."""
    ids = sorted(ids)
    tables = {i: (m.block_table(i), m.seq_len(i), m.block_hashes(i)) for i in ids}
    refcounts = [m.block_refcount(b) for b in range(m.num_blocks)]
    return (m.stats(), tables, refcounts, m.pending_copies(), len(m), m.num_free_blocks)


def expected_step(m: BlockManager, seqs: list[int], nums: list[int], copies: list) -> dict:
    """The step output computed in plain Python from the manager's tables."""
    B = m.block_size
    out: dict[str, list] = {
        "slot_mapping": [],
        "rows": [],
        "seq_lens": [],
        "query_start_loc": [0],
        "kv_indptr": [0],
        "kv_indices": [],
        "kv_last_page_len": [],
        "copies": [list(c) for c in copies],
    }
    for s, n in zip(seqs, nums):
        table = m.block_table(s)
        length = m.seq_len(s)
        assert len(table) == math.ceil(length / B)
        out["slot_mapping"] += [table[p // B] * B + p % B for p in range(length - n, length)]
        out["rows"].append(table)
        out["seq_lens"].append(length)
        out["query_start_loc"].append(out["query_start_loc"][-1] + n)
        out["kv_indptr"].append(out["kv_indptr"][-1] + len(table))
        out["kv_indices"] += table
        out["kv_last_page_len"].append((length - 1) % B + 1)
    return out


def check_step(m: BlockManager, b: StepBuffers, info: StepInfo, want: dict) -> None:
    h = b.host
    n = len(want["seq_lens"])
    assert info.num_seqs == n
    assert info.num_tokens == len(want["slot_mapping"])
    assert info.num_kv_indices == len(want["kv_indices"])
    assert info.num_copies == len(want["copies"])
    assert info.max_seq_len == max(want["seq_lens"], default=0)
    qsl = want["query_start_loc"]
    assert info.max_query_len == max((b - a for a, b in zip(qsl, qsl[1:])), default=0)
    assert h.slot_mapping[: info.num_tokens].tolist() == want["slot_mapping"]
    for i, row in enumerate(want["rows"]):
        assert h.block_tables[i, : len(row)].tolist() == row
    assert h.seq_lens[:n].tolist() == want["seq_lens"]
    assert h.query_start_loc[: n + 1].tolist() == want["query_start_loc"]
    assert h.kv_indptr[: n + 1].tolist() == want["kv_indptr"]
    assert h.kv_indices[: info.num_kv_indices].tolist() == want["kv_indices"]
    assert h.kv_last_page_len[:n].tolist() == want["kv_last_page_len"]
    assert h.copies[: info.num_copies].tolist() == want["copies"]


def manager_with_buffers(
    num_blocks: int = 64, block_size: int = 4, max_seqs: int = 8, max_tokens: int = 128, **kw
) -> tuple[BlockManager, StepBuffers]:
    kw.setdefault("watermark_blocks", 0)
    m = BlockManager(num_blocks, block_size, **kw)
    b = StepBuffers(max_seqs, max_tokens, m.max_blocks_per_seq, device="cpu")
    m.attach_buffers(b)
    return m, b


# ------------------------------------------------------------------------------------- config


def test_config_defaults_and_getters() -> None:
    m = BlockManager(1000)
    assert m.num_blocks == 1000
    assert m.block_size == 16
    assert m.watermark_blocks == 10  # 1% of the pool
    assert m.max_blocks_per_seq == 1000
    assert m.enable_prefix_caching is True
    assert m.verify_prefix is True
    assert m.num_free_blocks == 1000
    assert len(m) == 0 and m.num_seqs == 0
    assert m.buffers is None
    assert "num_blocks=1000" in repr(m)

    m = BlockManager(
        64, 8, watermark_blocks=3, max_blocks_per_seq=5, enable_prefix_caching=False, verify_prefix=False
    )
    assert (m.num_blocks, m.block_size, m.watermark_blocks, m.max_blocks_per_seq) == (64, 8, 3, 5)
    assert m.enable_prefix_caching is False and m.verify_prefix is False


@pytest.mark.parametrize(
    "args, kwargs, field",
    [
        ((0,), {}, "num_blocks"),
        ((8, 0), {}, "block_size"),
        ((8, 4), {"watermark_blocks": 8}, "watermark_blocks"),
        ((8, 4), {"max_blocks_per_seq": 0}, "max_blocks_per_seq"),
        ((2**31, 4), {}, "num_blocks"),
    ],
)
def test_invalid_config(args: tuple, kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidConfigError) as info:
        BlockManager(*args, **kwargs)
    assert info.value.field == field
    assert field in str(info.value)


@pytest.mark.parametrize(
    "args, kwargs, what",
    [
        ((-1,), {}, "num_blocks"),
        ((2**32,), {}, "num_blocks"),
        ((8, -4), {}, "block_size"),
        ((8, 4), {"watermark_blocks": -1}, "watermark_blocks"),
        (("8",), {}, "num_blocks"),
        ((8.0,), {}, "num_blocks"),
    ],
)
def test_unrepresentable_config_values(args: tuple, kwargs: dict, what: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        BlockManager(*args, **kwargs)
    assert info.value.what == what


# ------------------------------------------------------------------------------------ sequences


def test_admit_allocates_ceil_blocks() -> None:
    m = BlockManager(32, 4, watermark_blocks=0)
    r = m.admit(1, list(range(10)))
    assert isinstance(r, AdmitResult)
    assert r == AdmitResult(cached_tokens=0, new_blocks=3, num_blocks=3, num_tokens=10,
                           cached_tokens_gpu=0, cached_tokens_host=0)
    table = m.block_table(1)
    assert len(table) == 3 and len(set(table)) == 3
    assert all(0 <= b < 32 for b in table)
    assert m.seq_len(1) == 10
    assert m.num_free_blocks == 29
    assert 1 in m and 2 not in m and len(m) == 1
    for b in table:
        assert m.block_refcount(b) == 1
    m.check_invariants()


TOKENS = [5, 0, 7, 2**32 - 1, 3, 9, 11, 13, 1]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: list(TOKENS), id="list"),
        pytest.param(lambda: tuple(TOKENS), id="tuple"),
        pytest.param(lambda: np.array(TOKENS, dtype=np.int64), id="int64"),
        pytest.param(lambda: np.array(TOKENS, dtype=np.uint32), id="uint32"),
        pytest.param(lambda: np.array(TOKENS, dtype=np.uint64), id="uint64"),
        pytest.param(lambda: np.repeat(np.array(TOKENS, dtype=np.int64), 2)[::2], id="strided"),
        pytest.param(lambda: torch.tensor(TOKENS, dtype=torch.int64), id="torch-int64"),
        pytest.param(lambda: [np.int64(t) for t in TOKENS], id="numpy-scalars"),
    ],
)
def test_token_id_inputs_are_read_exactly(make) -> None:
    want = _core.hash_blocks(TOKENS, 4, hash_seed=7)
    m, b = manager_with_buffers(block_size=4, hash_seed=7)
    m.admit(1, make())
    assert m.seq_len(1) == len(TOKENS)
    m.step([1], len(TOKENS))
    # Blocks register at step time under the hash of the tokens read: equal hashes, equal tokens.
    assert m.block_hashes(1)[:2] == want


@pytest.mark.parametrize(
    "dtype", [np.int8, np.int16, np.int32, np.uint8, np.uint16]
)
def test_narrow_integer_dtypes(dtype) -> None:
    toks = np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=dtype)
    assert _core.hash_blocks(toks, 4, hash_seed=7) == _core.hash_blocks(
        list(range(1, 9)), 4, hash_seed=7
    )


@pytest.mark.parametrize(
    "bad, what",
    [
        ([1, -2, 3], -2),
        ([1, 2**32], 2**32),
        (np.array([3, -1], dtype=np.int32), -1),
        (np.array([3, 2**40], dtype=np.int64), 2**40),
        (np.array([1.0, 2.0]), None),
        (np.zeros((2, 2), dtype=np.int64), None),
        ([1, 2.5], None),
        ([1, "2"], None),
        (None, None),
        ("abc", None),
        ([], None),
    ],
)
def test_bad_token_ids_raise_and_leave_state(bad, what) -> None:
    m = BlockManager(16, 4, watermark_blocks=0)
    m.admit(1, [1, 2, 3])
    before = snapshot(m, [1])
    with pytest.raises(InvalidArgumentError) as info:
        m.admit(2, bad)
    if what is not None:
        assert info.value.value == what
        assert str(what) in str(info.value)
    with pytest.raises(InvalidArgumentError):
        m.append(1, bad)
    assert snapshot(m, [1]) == before
    m.check_invariants()


@pytest.mark.parametrize("sid", [-1, 2**64, 1.5, "3", None])
def test_bad_seq_ids(sid) -> None:
    m = BlockManager(16, 4)
    with pytest.raises(InvalidArgumentError) as info:
        m.admit(sid, [1])
    assert info.value.what == "seq_id"
    assert len(m) == 0
    assert sid not in m


def test_seq_id_extremes_and_numpy_scalars() -> None:
    m = BlockManager(16, 4)
    m.admit(2**64 - 1, [1])
    m.admit(np.int64(5), [1])
    assert 2**64 - 1 in m and m.seq_len(np.uint64(5)) == 1
    m.free(2**64 - 1)
    assert 2**64 - 1 not in m


def test_can_admit_respects_watermark_and_row_width() -> None:
    m = BlockManager(10, 4, watermark_blocks=2)
    assert m.can_admit(32)  # 8 blocks, leaves 2
    assert not m.can_admit(33)  # 9 blocks would dip into the reserve
    assert not m.can_admit(0)
    m2 = BlockManager(100, 4, watermark_blocks=0, max_blocks_per_seq=6)
    assert m2.can_admit(24) and not m2.can_admit(25)
    with pytest.raises(InvalidArgumentError):
        m.can_admit(-1)


def test_append_allocates_only_on_boundaries() -> None:
    m = BlockManager(16, 4, watermark_blocks=0)
    m.admit(1, [1, 2, 3, 4])
    assert len(m.block_table(1)) == 1
    m.append(1, 5)  # a single int appends one token
    assert len(m.block_table(1)) == 2 and m.seq_len(1) == 5
    m.append(1, np.array([6, 7, 8], dtype=np.int32))
    assert len(m.block_table(1)) == 2 and m.seq_len(1) == 8
    m.append(1, (9,))
    assert len(m.block_table(1)) == 3 and m.seq_len(1) == 9
    assert m.num_free_blocks == 13
    m.check_invariants()


def test_append_may_use_the_reserve_but_admit_may_not() -> None:
    m = BlockManager(6, 2, watermark_blocks=2, enable_prefix_caching=False)
    m.admit(1, [1, 2, 3, 4])
    m.admit(3, [1, 2, 3, 4])  # 4 blocks used: exactly the reserve is left
    with pytest.raises(WatermarkReachedError) as info:
        m.admit(2, [1])
    assert (info.value.needed, info.value.available, info.value.watermark) == (1, 0, 2)
    m.append(1, [5, 6])  # the reserve is for this
    assert m.num_free_blocks == 1
    m.append(3, [5, 6])
    with pytest.raises(OutOfBlocksError) as oob:
        m.append(1, [7])
    assert (oob.value.needed, oob.value.available) == (1, 0)
    assert m.seq_len(1) == 6


def test_sequence_too_long_on_admit_and_append() -> None:
    m = BlockManager(64, 4, watermark_blocks=0, max_blocks_per_seq=2)
    with pytest.raises(SequenceTooLongError) as info:
        m.admit(1, list(range(9)))
    assert (info.value.seq_id, info.value.needed_blocks, info.value.max_blocks_per_seq) == (1, 3, 2)
    m.admit(1, list(range(8)))
    with pytest.raises(SequenceTooLongError):
        m.append(1, [1])
    with pytest.raises(SequenceTooLongError):
        m.append_batch([1], [1])
    assert m.seq_len(1) == 8


def test_append_batch_appends_one_token_each() -> None:
    m = BlockManager(64, 4, watermark_blocks=0)
    for s in range(5):
        m.admit(s, list(range(s + 1)))
    seqs = np.arange(5, dtype=np.int64)
    m.append_batch(seqs, np.full(5, 42, dtype=np.int64))
    assert [m.seq_len(s) for s in range(5)] == [2, 3, 4, 5, 6]
    # The 4-token sequence crossed a boundary.
    assert [len(m.block_table(s)) for s in range(5)] == [1, 1, 1, 2, 2]
    m.append_batch([0, 2], [1, 2])
    m.append_batch(np.array([4], dtype=np.uint64), np.array([7], dtype=np.uint32))
    assert m.seq_len(0) == 3 and m.seq_len(2) == 5 and m.seq_len(4) == 7
    m.check_invariants()


@pytest.mark.parametrize(
    "seqs, toks, err",
    [
        ([0, 1, 99, 2], [1, 1, 1, 1], UnknownSequenceError),
        ([0, 1, 0], [1, 1, 1], InvalidArgumentError),
        ([0, 1], [1], InvalidArgumentError),
        ([0, -1], [1, 1], InvalidArgumentError),
        ([0, 1], [1, -1], InvalidArgumentError),
        (np.array([0, 1], dtype=np.float64), [1, 1], InvalidArgumentError),
    ],
)
def test_append_batch_is_all_or_nothing(seqs, toks, err) -> None:
    m = BlockManager(64, 4, watermark_blocks=0)
    for s in range(3):
        m.admit(s, list(range(4)))  # full blocks: every append allocates
    before = snapshot(m, range(3))
    with pytest.raises(err):
        m.append_batch(seqs, toks)
    assert snapshot(m, range(3)) == before
    m.check_invariants()


def test_append_batch_out_of_blocks_is_all_or_nothing() -> None:
    m = BlockManager(5, 2, watermark_blocks=0, enable_prefix_caching=False)
    for s in range(3):
        m.admit(s, [1, 2])  # 3 blocks used, 2 free; every append needs a block
    before = snapshot(m, range(3))
    with pytest.raises(OutOfBlocksError) as info:
        m.append_batch([0, 1, 2], [1, 1, 1])
    assert (info.value.needed, info.value.available) == (3, 2)
    assert snapshot(m, range(3)) == before


def test_free_returns_blocks_and_unknown_raises() -> None:
    m = BlockManager(16, 4, watermark_blocks=0, enable_prefix_caching=False)
    m.admit(1, list(range(9)))
    m.admit(2, [1])
    assert m.num_free_blocks == 12
    m.free(1)
    assert 1 not in m and m.num_free_blocks == 15 and len(m) == 1
    with pytest.raises(UnknownSequenceError) as info:
        m.free(1)
    assert info.value.seq_id == 1
    with pytest.raises(UnknownSequenceError):
        m.seq_len(1)
    with pytest.raises(UnknownSequenceError):
        m.block_table(1)
    with pytest.raises(UnknownSequenceError):
        m.append(1, [1])
    m.check_invariants()


def test_contains_is_total() -> None:
    m = BlockManager(8, 4)
    m.admit(3, [1])
    assert 3 in m and np.int64(3) in m and np.uint8(3) in m
    for x in (-3, "3", 3.0, None, 2**70, [3], np.int64(-3)):
        assert x not in m


def test_block_refcount_out_of_range() -> None:
    m = BlockManager(8, 4)
    with pytest.raises(InvalidBlockError) as info:
        m.block_refcount(8)
    assert (info.value.block, info.value.num_blocks) == (8, 8)
    assert m.block_refcount(7) == 0


def test_duplicate_admission_and_fork_target() -> None:
    m = BlockManager(16, 4, watermark_blocks=0)
    m.admit(1, [1, 2, 3])
    m.admit(2, [4])
    before = snapshot(m, [1, 2])
    with pytest.raises(DuplicateSequenceError) as info:
        m.admit(1, [9, 9])
    assert info.value.seq_id == 1
    with pytest.raises(DuplicateSequenceError):
        m.fork(1, 2)
    with pytest.raises(UnknownSequenceError):
        m.fork(5, 6)
    assert snapshot(m, [1, 2]) == before


# ---------------------------------------------------------------------------- fork, copy-on-write


def test_fork_shares_blocks_and_copies_the_tail_on_write() -> None:
    m, b = manager_with_buffers(block_size=4)
    m.admit(1, list(range(6)))  # one full block, one partial tail
    m.fork(1, 2)
    t1, t2 = m.block_table(1), m.block_table(2)
    assert t1 == t2 and m.seq_len(2) == 6
    assert [m.block_refcount(x) for x in t1] == [2, 2]
    assert m.stats().shared_blocks == 2
    free_before = m.num_free_blocks

    m.append(2, [100])
    t2b = m.block_table(2)
    assert t2b[0] == t1[0] and t2b[1] != t1[1]
    assert m.pending_copies() == [(t1[1], t2b[1])]
    assert m.num_free_blocks == free_before - 1
    assert m.stats().cow_copies == 1
    assert m.stats().shared_blocks == 1

    info = m.step([1, 2], [6, 7])
    want = expected_step(m, [1, 2], [6, 7], [(t1[1], t2b[1])])
    check_step(m, b, info, want)
    assert m.pending_copies() == []
    # The parent's tail is now its own: writing into it copies nothing.
    m.append(1, [200])
    assert m.pending_copies() == []
    m.check_invariants()


def test_fork_then_free_parent_keeps_child_blocks() -> None:
    m = BlockManager(16, 4, watermark_blocks=0)
    m.admit(1, list(range(8)))
    m.fork(1, 2)
    m.free(1)
    assert [m.block_refcount(x) for x in m.block_table(2)] == [1, 1]
    m.append(2, [1])
    assert m.pending_copies() == []
    m.check_invariants()


# -------------------------------------------------------------------------------------- steps


def test_step_without_buffers() -> None:
    m = BlockManager(8, 4)
    m.admit(1, [1])
    with pytest.raises(BuffersNotRegisteredError):
        m.step([1], 1)


def test_step_matches_python_model_and_keeps_stale_columns() -> None:
    m, b = manager_with_buffers(num_blocks=128, block_size=4, max_seqs=6, max_tokens=64)
    for _, t in b.host.items():
        t.fill_(SENTINEL)
    lens = {10: 3, 11: 9, 12: 16, 13: 1, 14: 21}
    for s, n in lens.items():
        m.admit(s, [(s * 31 + i) % 1000 for i in range(n)])
    seqs = [12, 10, 14, 11]
    nums = [16, 2, 5, 1]
    info = m.step(seqs, nums)
    want = expected_step(m, seqs, nums, [])
    check_step(m, b, info, want)
    h = b.host
    # Stale data: columns past each row's blocks and rows past the batch are untouched.
    for i, row in enumerate(want["rows"]):
        assert (h.block_tables[i, len(row) :] == SENTINEL).all()
    assert (h.block_tables[len(seqs) :] == SENTINEL).all()
    assert (h.slot_mapping[info.num_tokens :] == SENTINEL).all()
    assert (h.kv_indices[info.num_kv_indices :] == SENTINEL).all()

    # A decode step: append one token each, then one new token per sequence (int broadcast).
    m.append_batch(seqs, [1, 2, 3, 4])
    info2 = m.step(np.array(seqs, dtype=np.int64), 1)
    check_step(m, b, info2, expected_step(m, seqs, [1] * 4, []))
    # The same with the counts as an array.
    info3 = m.step(seqs, np.ones(4, dtype=np.int32))
    assert info3 == info2


def test_incremental_rows_and_invalidate_step_cache() -> None:
    # Rows are written incrementally: a row that already holds the same sequence gets only its new
    # entries. A caller that scribbles over the host table must invalidate; then every row of the
    # next step is rewritten in full.
    m, b = manager_with_buffers(num_blocks=128, block_size=4, max_seqs=4, max_tokens=64)
    seqs = [1, 2, 3]
    for s in seqs:
        m.admit(s, list(range(4 * s + 2)))
    check_step(m, b, m.step(seqs, [1, 1, 1]), expected_step(m, seqs, [1, 1, 1], []))
    for _ in range(3):  # crosses a block boundary for every sequence
        m.append_batch(seqs, [7, 8, 9])
        check_step(m, b, m.step(seqs, 1), expected_step(m, seqs, [1, 1, 1], []))

    b.host.block_tables.fill_(SENTINEL)
    m.invalidate_step_cache()
    m.append_batch(seqs, [7, 8, 9])
    check_step(m, b, m.step(seqs, 1), expected_step(m, seqs, [1, 1, 1], []))

    # Reordered batch: rows move, and each moved row is written in full.
    order = [3, 1, 2]
    m.append_batch(order, [4, 5, 6])
    check_step(m, b, m.step(order, 1), expected_step(m, order, [1, 1, 1], []))


def test_step_views_match_info() -> None:
    m, b = manager_with_buffers(block_size=4)
    m.admit(1, list(range(7)))
    info = m.step([1], 7)
    v = b.to_device(info)
    assert v.slot_mapping.tolist() == [m.block_table(1)[p // 4] * 4 + p % 4 for p in range(7)]
    assert v.block_tables.shape == (1, b.max_blocks_per_seq)
    assert v.kv_indices.tolist() == m.block_table(1)


def test_max_query_len_of_a_mixed_prefill_and_decode_batch() -> None:
    m, b = manager_with_buffers(block_size=4)
    m.admit(1, list(range(9)))
    m.admit(2, list(range(100, 105)))
    m.admit(3, list(range(200, 213)))
    # 1 decodes, 3 runs a 7-token chunk of its prompt, 2 its whole 5-token prompt.
    info = m.step([1, 3, 2], [1, 7, 5])
    assert info.max_query_len == 7 and info.num_tokens == 13 and info.max_seq_len == 13
    qsl = b.views(info, on_device=False).query_start_loc
    assert qsl.tolist() == [0, 1, 8, 13]
    assert info.max_query_len == int(np.diff(np.asarray(qsl)).max())
    check_step(m, b, info, expected_step(m, [1, 3, 2], [1, 7, 5], []))
    assert m.step([2, 1, 3], 1).max_query_len == 1
    empty = m.step([], [])
    assert empty.max_query_len == 0 and empty == StepInfo(0, 0, 0, 0, 0)


@pytest.mark.parametrize(
    "seqs, nums, err",
    [
        ([1, 2], [0, 1], InvalidArgumentError),
        ([1, 2], [1, 4], InvalidArgumentError),
        ([1, 99], [1, 1], UnknownSequenceError),
        ([1, 1], [1, 1], InvalidArgumentError),
        ([1, 2], [1], InvalidArgumentError),
        ([1, 2], [1, -1], InvalidArgumentError),
        ([1, 2, 3], [1, 1, 1], BufferTooSmallError),  # max_seqs is 2
        ([1, 2], [3, 3], BufferTooSmallError),  # max_tokens is 5
    ],
)
def test_step_errors_write_nothing_and_leave_state(seqs, nums, err) -> None:
    m = BlockManager(32, 4, watermark_blocks=0)
    b = StepBuffers(2, 5, m.max_blocks_per_seq, device="cpu")
    m.attach_buffers(b)
    for s in (1, 2, 3):
        m.admit(s, [s] * 3)
    for _, t in b.host.items():
        t.fill_(SENTINEL)
    before = snapshot(m, [1, 2, 3])
    with pytest.raises(err):
        m.step(seqs, nums)
    assert snapshot(m, [1, 2, 3]) == before
    for name, t in b.host.items():
        assert (t == SENTINEL).all(), name
    m.check_invariants()


def test_step_buffer_too_small_names_buffer() -> None:
    m = BlockManager(32, 4, watermark_blocks=0)
    m.attach_buffers(StepBuffers(4, 3, m.max_blocks_per_seq, device="cpu"))
    m.admit(1, [1, 2, 3, 4])
    with pytest.raises(BufferTooSmallError) as info:
        m.step([1], 4)
    assert (info.value.buffer, info.value.needed, info.value.capacity) == ("slot_mapping", 4, 3)


def test_rows_narrower_than_a_sequence_are_refused() -> None:
    m = BlockManager(32, 4, watermark_blocks=0)
    m.attach_buffers(StepBuffers(2, 64, 2, device="cpu"))
    m.admit(1, list(range(9)))  # 3 blocks; rows hold 2
    with pytest.raises(BufferTooSmallError) as info:
        m.step([1], 1)
    assert info.value.buffer == "block_table_stride"


def test_reattaching_buffers_switches_the_target() -> None:
    m, b1 = manager_with_buffers(block_size=4)
    b2 = StepBuffers(8, 128, m.max_blocks_per_seq, device="cpu")
    m.admit(1, [1, 2, 3])
    m.step([1], 3)
    assert b1.host.seq_lens[0].item() == 3
    m.attach_buffers(b2)
    m.append(1, 4)
    m.step([1], 1)
    assert b2.host.seq_lens[0].item() == 4 and b1.host.seq_lens[0].item() == 3
    assert m.buffers is b2


# ------------------------------------------------------------------------------- prefix cache


def _stepped(m: BlockManager, seq: int, toks, **keys) -> AdmitResult:
    r = m.admit(seq, toks, **keys)
    m.step([seq], len(toks) - r.cached_tokens)
    return r


def test_prefix_hits_after_step_and_share_blocks() -> None:
    m, _ = manager_with_buffers(block_size=4)
    prompt = list(range(100, 109))  # 2 full blocks + 1 token
    assert _stepped(m, 1, prompt) == AdmitResult(0, 3, 3, 9, 0, 0)
    r = m.admit(2, prompt)
    assert r == AdmitResult(cached_tokens=8, new_blocks=1, num_blocks=3, num_tokens=9,
                           cached_tokens_gpu=8, cached_tokens_host=0)
    assert m.block_table(2)[:2] == m.block_table(1)[:2]
    assert m.block_table(2)[2] != m.block_table(1)[2]
    assert [m.block_refcount(x) for x in m.block_table(1)[:2]] == [2, 2]
    s = m.stats()
    assert s.prefix_query_tokens == 18 and s.prefix_hit_tokens == 8
    assert s.prefix_hit_ratio == pytest.approx(8 / 18)
    assert s.shared_blocks == 2
    m.check_invariants()


def test_blocks_register_only_at_step_time() -> None:
    m, _ = manager_with_buffers(block_size=4)
    prompt = list(range(12))
    m.admit(1, prompt)
    assert m.block_hashes(1) == [None, None, None]
    assert m.admit(2, prompt).cached_tokens == 0
    m.step([1], 12)
    assert all(h is not None and len(h) == 16 for h in m.block_hashes(1))
    # A fully cached prompt still recomputes its last block.
    assert m.admit(3, prompt).cached_tokens == 8


@pytest.mark.parametrize(
    "keys_a, keys_b, hit",
    [
        ({}, {}, True),
        ({"cache_salt": b"tenant"}, {"cache_salt": "tenant"}, True),
        ({"cache_salt": b"a"}, {"cache_salt": b"b"}, False),
        ({}, {"cache_salt": b"a"}, False),
        ({"adapter_id": 3}, {"adapter_id": 3}, True),
        ({"adapter_id": 3}, {"adapter_id": 4}, False),
        ({"adapter_id": 3}, {}, False),
        ({"extra_keys": b"x"}, {"extra_keys": b"x"}, True),
        ({"extra_keys": b"x"}, {"extra_keys": b"y"}, False),
        ({"mm_inputs": [(1, 3, b"img")]}, {"mm_inputs": [(1, 3, b"img")]}, True),
        ({"mm_inputs": [(1, 3, b"img")]}, {"mm_inputs": [(1, 3, b"other")]}, False),
    ],
)
def test_extra_keys_separate_cache_entries(keys_a: dict, keys_b: dict, hit: bool) -> None:
    m, _ = manager_with_buffers(block_size=4)
    prompt = list(range(9))
    _stepped(m, 1, prompt, **keys_a)
    r = m.admit(2, prompt, **keys_b)
    assert r.cached_tokens == (8 if hit else 0)


def test_mm_input_affects_only_blocks_from_its_first() -> None:
    m, _ = manager_with_buffers(block_size=4)
    prompt = list(range(13))
    _stepped(m, 1, prompt, mm_inputs=[(5, 7, b"cat")])
    # Same placeholder tokens, different image in block 1: block 0 still hits.
    assert m.admit(2, prompt, mm_inputs=[(5, 7, b"dog")]).cached_tokens == 4


@pytest.mark.parametrize(
    "keys",
    [
        {"mm_inputs": [(3, 3, b"x")]},
        {"mm_inputs": [(0, 99, b"x")]},
        {"mm_inputs": [(0, 2)]},
        {"mm_inputs": [(0, 2, "str-not-bytes")]},
        {"mm_inputs": "nope"},
        {"adapter_id": -1},
        {"extra_keys": "str-not-bytes"},
        {"cache_salt": 5},
    ],
)
def test_bad_keys_raise_and_leave_state(keys: dict) -> None:
    m = BlockManager(16, 4, watermark_blocks=0)
    m.admit(1, [1, 2, 3])
    before = snapshot(m, [1])
    with pytest.raises(InvalidArgumentError):
        m.admit(2, list(range(8)), **keys)
    assert snapshot(m, [1]) == before


def test_no_prefix_caching_means_no_hits() -> None:
    m, _ = manager_with_buffers(block_size=4, enable_prefix_caching=False)
    prompt = list(range(9))
    _stepped(m, 1, prompt)
    assert m.admit(2, prompt).cached_tokens == 0
    assert m.block_hashes(1) == [None, None, None]
    assert m.stats().prefix_query_tokens == 0


def test_freed_blocks_stay_cached_then_get_evicted() -> None:
    m, _ = manager_with_buffers(num_blocks=6, block_size=2, max_seqs=2, max_tokens=16)
    prompt = [1, 2, 3, 4, 5]  # 3 blocks, 2 full
    _stepped(m, 1, prompt)
    m.free(1)
    s = m.stats()
    assert s.cached_free_blocks == 2 and s.free_blocks == 4 and m.num_free_blocks == 6
    # A hit revives the cached blocks.
    assert m.admit(2, prompt).cached_tokens == 4
    m.free(2)
    # Filling the pool with other prompts evicts them.
    m.admit(3, list(range(50, 62)))
    assert m.stats().evictions == 2
    assert m.num_free_blocks == 0
    m.free(3)
    # The evicted prefix is gone: the same prompt now misses.
    assert m.admit(4, prompt).cached_tokens == 0
    m.check_invariants()


def test_verify_prefix_still_hits_on_equal_tokens() -> None:
    for kw in ({}, {"verify_prefix": True}, {"verify_prefix": False}):
        m, _ = manager_with_buffers(block_size=4, **kw)
        _stepped(m, 1, list(range(9)))
        assert m.admit(2, list(range(9))).cached_tokens == 8
        assert m.stats().prefix_collisions == 0


# -------------------------------------------------------------------------------- stats, misc


def test_stats_snapshot() -> None:
    m = BlockManager(20, 4, watermark_blocks=0)
    m.admit(1, list(range(9)))
    m.admit(2, [1])
    s = m.stats()
    assert isinstance(s, Stats)
    assert (s.num_blocks, s.block_size, s.num_seqs) == (20, 4, 2)
    assert s.used_blocks == 4 and s.free_blocks + s.cached_free_blocks == 16
    assert s.num_free_blocks == m.num_free_blocks
    assert s.used_tokens == 10
    assert s.kv_utilization == pytest.approx(10 / 80)
    assert s.allocated_token_slots == 16
    assert s.preemptions == 0
    assert len(s.blocks_per_seq) == 16
    # One sequence with 1 block (bucket 0), one with 3 (bucket 2).
    assert s.blocks_per_seq[0] == 1 and s.blocks_per_seq[2] == 1 and sum(s.blocks_per_seq) == 2
    with pytest.raises(Exception):
        s.num_seqs = 5  # type: ignore[misc]
    d = s.as_dict()
    assert d["num_seqs"] == 2 and isinstance(d["blocks_per_seq"], list)


def test_core_module_version() -> None:
    import pagedkv

    assert isinstance(_core.__version__, str) and _core.__version__.count(".") == 2
    assert pagedkv.__version__ == _core.__version__


@pytest.mark.parametrize(
    "seq_dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.uint64]
)
def test_seq_id_arrays_of_every_integer_dtype(seq_dtype) -> None:
    m = BlockManager(64, 4, watermark_blocks=0)
    for s in (1, 2, 3):
        m.admit(s, [s])
    m.append_batch(np.array([3, 1], dtype=seq_dtype), np.array([7, 8], dtype=np.int32))
    assert (m.seq_len(1), m.seq_len(2), m.seq_len(3)) == (2, 1, 2)


@pytest.mark.parametrize(
    "seqs, toks, value",
    [
        (np.array([1, -1], dtype=np.int64), np.array([1, 1], dtype=np.int64), -1),
        (np.array([1, -2], dtype=np.int8), np.array([1, 1], dtype=np.int64), -2),
        (np.array([1, 2], dtype=np.int64), np.array([1, -3], dtype=np.int64), -3),
        (np.array([1, 2], dtype=np.int64), np.array([1, -4], dtype=np.int32), -4),
        (np.array([1, 2], dtype=np.int64), np.array([2**32, 1], dtype=np.uint64), 2**32),
        (np.array([1, 2], dtype=np.int64), np.array([1, 2**63], dtype=np.uint64), 2**63),
        # Strided views (a reversed one, a stepped one) take the element-by-element path.
        (np.array([1, 2], dtype=np.int64)[::-1], np.array([-5, 0, 7, 0], dtype=np.int64)[::2], -5),
        (np.array([2, 0, -6, 0], dtype=np.int64)[::2], np.array([1, 1], dtype=np.int64), -6),
    ],
)
def test_out_of_range_array_values_are_named(seqs, toks, value) -> None:
    m = BlockManager(64, 4, watermark_blocks=0)
    m.admit(1, [1])
    m.admit(2, [2])
    before = snapshot(m, [1, 2])
    with pytest.raises(InvalidArgumentError) as info:
        m.append_batch(seqs, toks)
    assert info.value.value == value
    assert str(value) in str(info.value)
    assert snapshot(m, [1, 2]) == before


def test_numpy_integer_scalars_as_single_values() -> None:
    m, b = manager_with_buffers(block_size=4)
    m.admit(1, [1, 2])
    m.append(1, np.int32(3))
    assert m.seq_len(1) == 3
    info = m.step(np.array([1]), np.int64(2))
    assert info.num_tokens == 2
    info = m.step([1], [3])
    assert info.num_tokens == 3


def test_one_manager_shared_by_threads_stays_consistent() -> None:
    """Batch calls release the GIL; a second thread entering the same manager meanwhile must get
    a clean RuntimeError (the object is borrowed), never a corrupted state."""
    import threading

    m, _ = manager_with_buffers(
        num_blocks=4096, block_size=16, max_seqs=64, max_tokens=64, max_blocks_per_seq=64
    )
    seqs = np.arange(64, dtype=np.int64)
    for s in seqs:
        m.admit(int(s), [1])
    ok = [0, 0]
    refused = [0, 0]

    def worker(k: int) -> None:
        toks = np.full(64, k, dtype=np.int64)
        for _ in range(300):
            try:
                m.append_batch(seqs, toks)
                ok[k] += 1
            except RuntimeError as e:
                assert "borrow" in str(e).lower(), e
                refused[k] += 1
            try:
                m.step(seqs, 1)
            except RuntimeError as e:
                assert "borrow" in str(e).lower(), e

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m.check_invariants()
    assert all(m.seq_len(int(s)) == 1 + sum(ok) for s in seqs)
    assert sum(ok) + sum(refused) == 600


@pytest.mark.gpu
def test_cuda_token_tensor_is_rejected_cleanly() -> None:
    m = BlockManager(16, 4)
    with pytest.raises(InvalidArgumentError) as info:
        m.admit(1, torch.tensor([1, 2, 3], device="cuda"))
    assert "host" in str(info.value)
    assert 1 not in m
    # The same ids on the host are fine.
    m.admit(1, torch.tensor([1, 2, 3], device="cuda").cpu())
    assert m.seq_len(1) == 3
