"""What a scheduler needs from BlockManager: chunked admission that hits the prefix cache,
``can_admit`` counting hits, ``admit_batch`` / ``free_batch`` and ``reset_prefix_cache``.

Every error case checks the typed exception and that the manager's state is unchanged.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import pytest

from pagedkv import AdmitResult, BlockManager, StepBuffers
from pagedkv.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    SequenceTooLongError,
    UnknownSequenceError,
    WatermarkReachedError,
)


def snapshot(m: BlockManager, ids: Iterable[int]) -> tuple:
    ids = sorted(i for i in ids if i in m)
    tables = {i: (m.block_table(i), m.seq_len(i), m.block_hashes(i)) for i in ids}
    refcounts = [m.block_refcount(b) for b in range(m.num_blocks)]
    return (m.stats(), tables, refcounts, len(m), m.num_free_blocks)


def make(num_blocks: int, block_size: int = 16, watermark: int = 1, **kw) -> BlockManager:
    m = BlockManager(num_blocks, block_size, watermark_blocks=watermark, **kw)
    m.attach_buffers(StepBuffers(8, 4096, m.max_blocks_per_seq, device="cpu"))
    return m


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, size=n).tolist()


def chunked_prefill(m: BlockManager, seq: int, toks: list[int], chunk: int) -> AdmitResult:
    """Admits `toks` in chunks the way a scheduler does: admit, step, then append + step."""
    r = m.admit(seq, toks, max_new_tokens=chunk)
    m.step([seq], r.num_tokens - r.cached_tokens)
    held = r.num_tokens
    while held < len(toks):
        k = min(chunk, len(toks) - held)
        m.append(seq, toks[held : held + k])
        m.step([seq], k)
        held += k
    assert m.seq_len(seq) == len(toks)
    return r


# ------------------------------------------------------------------------ chunked admission


def test_cached_prompt_admitted_in_chunks_reuses_4080_tokens() -> None:
    m = make(1024)
    toks = prompt(4096, 0)
    first = chunked_prefill(m, 1, toks, 512)
    assert first == AdmitResult(cached_tokens=0, new_blocks=32, num_blocks=32, num_tokens=512,
                                cached_tokens_gpu=0, cached_tokens_host=0)
    m.free(1)
    r = m.admit(2, toks, max_new_tokens=512)
    assert r == AdmitResult(cached_tokens=4080, new_blocks=1, num_blocks=256, num_tokens=4096,
                            cached_tokens_gpu=4080, cached_tokens_host=0)
    assert m.seq_len(2) == 4096
    m.check_invariants()
    m.free(2)
    # Admitting only the first chunk's tokens can hit only what lies inside it.
    assert m.admit(3, toks[:512]).cached_tokens == 496
    m.check_invariants()


def test_one_token_cap_uses_the_whole_prompt_length() -> None:
    m = make(64, block_size=4, watermark=0)
    toks = list(range(100, 116))  # 4 full blocks
    chunked_prefill(m, 1, toks, 4)
    m.free(1)
    # All of it is cached: 3 blocks shared, the last recomputed (not 0 blocks: the chunk is 4).
    r = m.admit(2, toks, max_new_tokens=4)
    assert (r.cached_tokens, r.num_tokens, r.new_blocks) == (12, 16, 1)
    m.free(2)
    r = m.admit(3, toks + [7], max_new_tokens=4)
    assert (r.cached_tokens, r.num_tokens) == (16, 17)
    m.check_invariants()


def test_chunks_become_cacheable_when_their_step_is_built() -> None:
    m = make(1024)
    toks = prompt(4096, 1)
    r = m.admit(1, toks, max_new_tokens=512)
    assert (r.cached_tokens, r.num_tokens) == (0, 512)
    assert m.admit(2, toks, max_new_tokens=512).cached_tokens == 0, "before chunk 1's step"
    m.free(2)
    m.step([1], 512)
    r = m.admit(3, toks, max_new_tokens=512)
    assert (r.cached_tokens, r.num_tokens) == (512, 1024)
    assert m.block_table(3)[:32] == m.block_table(1)[:32]
    m.free(3)
    m.append(1, toks[512:1024])
    assert m.admit(4, toks, max_new_tokens=512).cached_tokens == 512, "chunk 2 not stepped"
    m.free(4)
    m.step([1], 512)
    assert m.admit(5, toks, max_new_tokens=512).cached_tokens == 1024
    m.check_invariants()


def test_chunked_admission_errors_leave_state() -> None:
    m = make(16, block_size=4, watermark=0)
    m.admit(1, [1, 2, 3])
    before = snapshot(m, [1, 2])
    with pytest.raises(InvalidArgumentError, match="max_new_tokens"):
        m.admit(2, [1, 2, 3], max_new_tokens=0)
    with pytest.raises(InvalidArgumentError, match="max_new_tokens"):
        m.admit(2, [1, 2, 3], max_new_tokens=-1)
    with pytest.raises(SequenceTooLongError):
        m.admit(2, list(range(65)), max_new_tokens=4)
    with pytest.raises(DuplicateSequenceError):
        m.admit(1, [1, 2], max_new_tokens=1)
    assert snapshot(m, [1, 2]) == before
    m.check_invariants()


# -------------------------------------------------------------------------------- can_admit


def test_can_admit_counts_prefix_hits() -> None:
    m = make(259)  # 256 for the running prompt, 2 spare, watermark 1
    toks = prompt(4096, 2)
    m.admit(1, toks)
    m.step([1], 4096)
    assert not m.can_admit(4096), "by length alone it does not fit"
    for form in (toks, tuple(toks), np.array(toks, dtype=np.int64), np.array(toks, np.uint32)):
        assert m.can_admit(form)
    assert not m.can_admit(prompt(4096, 3))
    assert not m.can_admit(toks, cache_salt=b"other tenant")
    assert m.can_admit(4096, max_new_tokens=32) and not m.can_admit(4096, max_new_tokens=33)
    assert m.can_admit(np.int64(16))
    before = snapshot(m, [1])
    assert m.can_admit(toks, max_new_tokens=512)
    assert snapshot(m, [1]) == before, "can_admit is read-only"
    assert m.admit(2, toks).new_blocks == 1
    assert not m.can_admit([]) and not m.can_admit(0)
    with pytest.raises(InvalidArgumentError):
        m.can_admit(toks, max_new_tokens=0)
    with pytest.raises(InvalidArgumentError):
        m.can_admit([1, -2])
    with pytest.raises(InvalidArgumentError):
        m.can_admit(-1)


def test_can_admit_counts_revived_cached_free_blocks() -> None:
    m = make(300, watermark=10)
    toks = prompt(4096, 4)
    m.admit(1, toks)
    m.step([1], 4096)
    m.free(1)  # all 256 blocks cached-free
    m.admit(9, prompt(35 * 16, 5))
    assert m.num_free_blocks == 265
    # 255 revived + 1 new = 256 blocks leave the free count, 9 < watermark 10.
    assert not m.can_admit(toks)
    with pytest.raises(WatermarkReachedError):
        m.admit(2, toks)
    m.free(9)
    m.admit(9, prompt(34 * 16, 5))
    assert m.can_admit(toks)
    assert m.admit(2, toks).cached_tokens == 4080
    m.check_invariants()


# ------------------------------------------------------------------------------ batch calls


def test_admit_batch_admits_in_order_until_one_does_not_fit() -> None:
    m = make(20, block_size=4, watermark=2)
    prompts = [prompt(20, s) for s in range(5)]  # 5 blocks each
    rs = m.admit_batch(list(range(5)), prompts)
    assert [r.num_blocks for r in rs] == [5, 5, 5]
    assert all(isinstance(r, AdmitResult) for r in rs)
    assert len(m) == 3 and 3 not in m and 4 not in m
    rs = m.admit_batch(np.array([3, 4]), prompts[3:], max_new_tokens=4)
    assert [(r.num_tokens, r.new_blocks) for r in rs] == [(4, 1), (4, 1)]
    assert m.admit_batch([9], [prompts[0]]) == []
    assert m.admit_batch([], []) == []
    m.check_invariants()


def test_admit_batch_per_sequence_salts_and_chunks() -> None:
    m = make(256, block_size=4, watermark=0)
    toks = list(range(1, 33))
    chunked_prefill(m, 1, toks, 8)
    rs = m.admit_batch(
        [2, 3, 4],
        [toks, toks, np.array(toks)],
        cache_salts=[None, b"t", "u"],
        max_new_tokens=[None, 8, 4],
    )
    assert [(r.cached_tokens, r.num_tokens) for r in rs] == [(28, 32), (0, 8), (0, 4)]
    m.check_invariants()


@pytest.mark.parametrize(
    "seqs, prompts, kw, err",
    [
        ([2, 1], [[1], [2]], {}, DuplicateSequenceError),
        ([2, 2], [[1], [2]], {}, DuplicateSequenceError),
        ([2, 3], [[1], []], {}, InvalidArgumentError),
        ([2, 3], [[1], list(range(300))], {}, SequenceTooLongError),
        ([2, 3], [[1]], {}, InvalidArgumentError),
        ([2, 3], [[1], [2]], {"max_new_tokens": [1]}, InvalidArgumentError),
        ([2, 3], [[1], [2]], {"max_new_tokens": [1, 0]}, InvalidArgumentError),
        ([2, 3], [[1], [2]], {"max_new_tokens": -1}, InvalidArgumentError),
        ([2, 3], [[1], [2]], {"cache_salts": [b"a"]}, InvalidArgumentError),
        ([2, 3], [[1], [2]], {"cache_salts": [b"a", 5]}, InvalidArgumentError),
        ([2, 3], [[1], [-2]], {}, InvalidArgumentError),
        ([2, -3], [[1], [2]], {}, InvalidArgumentError),
        ([2, 3], [[1], "ab"], {}, InvalidArgumentError),
    ],
)
def test_admit_batch_errors_admit_nothing(seqs, prompts, kw, err) -> None:
    m = make(64, block_size=4, watermark=0)
    m.admit(1, [1, 2, 3])
    before = snapshot(m, [1, 2, 3])
    with pytest.raises(err):
        m.admit_batch(seqs, prompts, **kw)
    assert snapshot(m, [1, 2, 3]) == before
    m.check_invariants()


def test_free_batch_validates_then_frees_all() -> None:
    m = make(32, block_size=4, watermark=0)
    for s in range(4):
        m.admit(s, prompt(9, s))
    before = snapshot(m, range(4))
    with pytest.raises(UnknownSequenceError):
        m.free_batch([0, 7])
    with pytest.raises(InvalidArgumentError, match="twice"):
        m.free_batch([0, 1, 0])
    with pytest.raises(InvalidArgumentError):
        m.free_batch([0, -1])
    assert snapshot(m, range(4)) == before
    m.free_batch(np.array([2, 0], dtype=np.uint64))
    assert len(m) == 2 and 1 in m and 3 in m
    m.free_batch([])
    m.free_batch((1, 3))
    assert m.num_free_blocks == 32
    m.check_invariants()


def test_reset_prefix_cache() -> None:
    m = make(64, block_size=4, watermark=0)
    a, b = list(range(17)), list(range(50, 62))
    m.admit(1, a)
    m.admit(2, b)
    m.step([1, 2], [17, 12])
    m.free(1)
    assert m.stats().cached_free_blocks == 4
    assert m.reset_prefix_cache() == 7  # 4 cached-free + 3 held by sequence 2
    s = m.stats()
    assert (s.cached_free_blocks, s.free_blocks) == (0, 61)
    assert m.block_hashes(2) == [None, None, None]
    m.check_invariants()
    assert m.admit(3, a).cached_tokens == 0
    assert m.admit(4, b).cached_tokens == 0
    assert m.reset_prefix_cache() == 0
    m.check_invariants()


# ------------------------------------------------------------------------ list conversion


EDGE = [0, 1, 255, 256, 2**15, 2**30 - 1, 2**30, 2**31, 2**32 - 1]


@pytest.mark.parametrize("container", [list, tuple])
def test_list_fast_path_reads_every_value_exactly(container) -> None:
    from pagedkv._core import hash_blocks

    toks = EDGE * 200  # crosses every digit boundary the reader handles
    want = hash_blocks(np.array(toks, dtype=np.uint32), 4, hash_seed=0)
    assert hash_blocks(container(toks), 4, hash_seed=0) == want
    # Items the fast reader hands to the slow path mid-list: numpy ints are read by value...
    mixed = list(toks)
    mixed[700] = np.int64(mixed[700])
    assert hash_blocks(container(mixed), 4, hash_seed=0) == want
    # ... and a bool is refused with the element named, never read as 0 or 1.
    mixed[5] = True
    with pytest.raises(InvalidArgumentError, match="element 5"):
        hash_blocks(container(mixed), 4, hash_seed=0)


@pytest.mark.parametrize(
    "bad, index",
    [(-1, 3000), (2**32, 17), (2**70, 0), (-(2**40), 4095), ("x", 9), (1.0, 100)],
)
def test_list_fast_path_errors_name_the_element(bad, index) -> None:
    m = make(512, watermark=0)
    toks = prompt(4096, 9)
    toks[index] = bad
    before = snapshot(m, [1])
    with pytest.raises(InvalidArgumentError, match=f"element {index}"):
        m.admit(1, toks)
    assert snapshot(m, [1]) == before


def test_large_sequence_ids_in_lists() -> None:
    m = make(64, block_size=4, watermark=0)
    ids = [2**60 - 1, 2**60, 2**64 - 1, 2**30]
    m.admit_batch(ids, [[1, 2]] * 4)
    assert all(i in m for i in ids)
    m.append_batch(ids, [3, 4, 5, 6])
    assert [m.seq_len(i) for i in ids] == [3, 3, 3, 3]
    with pytest.raises(InvalidArgumentError):
        m.free_batch([2**64])
    m.free_batch(ids)
    assert len(m) == 0
    m.check_invariants()
