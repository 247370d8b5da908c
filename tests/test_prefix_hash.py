"""The chained prefix hash, reimplemented in Python from its written specification.

An independent implementation with the ``xxhash`` package must reproduce the core's hashes bit for
bit, including the worked examples of ``docs/prefix-hash.md``, which specifies it:

    h_{-1} = XXH3-128_k( b"pagedkv/prefix/v1" ‖ u32le(len(salt)) ‖ salt )
    h_i    = XXH3-128_k( u128le(h_{i-1}) ‖ u32le(token) × B ‖ extra_i )

``XXH3-128_k`` is XXH3-128 seeded with the 64-bit hash key ``k`` (a manager's ``hash_seed``;
key 0 is the unseeded hash).

``extra_i`` holds, in this order: the adapter record ``0x01 ‖ u64le(adapter_id)`` if an adapter is
set; for each multimodal input overlapping tokens ``[i·B, (i+1)·B)``, in the caller's order,
``0x02 ‖ u32le(start) ‖ u32le(end) ‖ u32le(len(hash)) ‖ hash``; and, if the caller's extra bytes
are non-empty, ``0x03 ‖ u32le(len(extra)) ‖ extra``. Hashes are exchanged as ``u128le`` bytes.
"""

from __future__ import annotations

import struct
from typing import Optional, Sequence

import hypothesis.strategies as st
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings

from pagedkv import BlockManager, StepBuffers, _core
from pagedkv.errors import InvalidArgumentError

DOMAIN = b"pagedkv/prefix/v1"


def reference_hashes(
    tokens: Sequence[int],
    block_size: int,
    hash_seed: int,
    cache_salt: bytes = b"",
    adapter_id: Optional[int] = None,
    mm_inputs: Sequence[tuple[int, int, bytes]] = (),
    extra_keys: bytes = b"",
) -> list[bytes]:
    prev = xxhash.xxh3_128_intdigest(
        DOMAIN + struct.pack("<I", len(cache_salt)) + cache_salt, hash_seed
    )
    out = []
    for i in range(len(tokens) // block_size):
        lo, hi = i * block_size, (i + 1) * block_size
        msg = bytearray(prev.to_bytes(16, "little"))
        msg += struct.pack(f"<{block_size}I", *tokens[lo:hi])
        if adapter_id is not None:
            msg += b"\x01" + struct.pack("<Q", adapter_id)
        for start, end, h in mm_inputs:
            if start < hi and end > lo:
                msg += b"\x02" + struct.pack("<III", start, end, len(h)) + h
        if extra_keys:
            msg += b"\x03" + struct.pack("<I", len(extra_keys)) + extra_keys
        prev = xxhash.xxh3_128_intdigest(bytes(msg), hash_seed)
        out.append(prev.to_bytes(16, "little"))
    return out


# The worked examples of docs/prefix-hash.md, as u128le bytes: block size 16, tokens 0..31, under
# key 0 (the public, unseeded hash) and under key 0x0123456789abcdef.
DOC_KEY = 0x0123456789ABCDEF
DOC_EXAMPLES = {
    (0, False): ["7506a7967aaa219aa0c3db3ac3036f84", "b9e561cec3cf430ba7a714278c3fcad6"],
    (0, True): ["bdf3dcc279f7a9e8cabf5be625b18379", "371086f37c940a3eeae15c98072f88f8"],
    (DOC_KEY, False): ["afa62f9cff911c033cbaaeb772109c4a", "0cfeb22067da0459ca0072bb18ef8b05"],
    (DOC_KEY, True): ["75602cfa65008bf62657645b2cc89c50", "c26469b78ba5e1e408225fcfdc2f9895"],
}
DOC_KEYS = dict(
    cache_salt=b"tenant-a", adapter_id=7, mm_inputs=[(4, 20, b"\xab" * 16)], extra_keys=b"x"
)
SEED = 0x9E3779B97F4A7C15


@pytest.mark.parametrize("key,all_keys", sorted(DOC_EXAMPLES))
def test_documented_examples(key: int, all_keys: bool) -> None:
    toks = list(range(32))
    kw = DOC_KEYS if all_keys else {}
    for got in (
        reference_hashes(toks, 16, key, **kw),
        _core.hash_blocks(toks, 16, hash_seed=key, **kw),
    ):
        assert [h.hex() for h in got] == DOC_EXAMPLES[key, all_keys]


def test_plain_chain() -> None:
    toks = list(range(40))
    got = _core.hash_blocks(toks, 16, hash_seed=SEED)
    assert len(got) == 2 and all(len(h) == 16 for h in got)
    assert got == reference_hashes(toks, 16, SEED)


def test_key_changes_every_hash() -> None:
    toks = list(range(64))
    for salt in (b"", b"s"):
        a = _core.hash_blocks(toks, 16, cache_salt=salt, hash_seed=SEED)
        b = _core.hash_blocks(toks, 16, cache_salt=salt, hash_seed=SEED ^ 1)
        assert all(x != y for x, y in zip(a, b))


def test_partial_block_is_not_hashed() -> None:
    assert _core.hash_blocks([1, 2, 3], 4, hash_seed=SEED) == []
    assert len(_core.hash_blocks([1, 2, 3, 4, 5], 4, hash_seed=SEED)) == 1


def test_every_key_kind_matches() -> None:
    toks = [(i * 7919) % 50000 for i in range(64)]
    kwargs = dict(
        cache_salt=b"tenant-42",
        adapter_id=2**64 - 1,
        mm_inputs=[(3, 20, b"\xaa" * 16), (18, 40, b"img-2"), (60, 64, b"")],
        extra_keys=b"\x00\x01extra",
    )
    got = _core.hash_blocks(toks, 8, hash_seed=SEED, **kwargs)
    assert got == reference_hashes(toks, 8, SEED, **kwargs)


def test_str_salt_is_its_utf8_bytes() -> None:
    toks = list(range(8))
    assert _core.hash_blocks(toks, 4, cache_salt="ünï", hash_seed=SEED) == reference_hashes(
        toks, 4, SEED, cache_salt="ünï".encode()
    )
    # No salt and an empty salt are the same root.
    assert _core.hash_blocks(toks, 4, cache_salt=b"", hash_seed=SEED) == _core.hash_blocks(
        toks, 4, hash_seed=SEED
    )


def test_token_ids_span_the_u32_range() -> None:
    toks = np.array([0, 2**32 - 1, 2**31, 1], dtype=np.uint32)
    assert _core.hash_blocks(toks, 2, hash_seed=SEED) == reference_hashes(toks.tolist(), 2, SEED)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mm_inputs": [(4, 4, b"x")]},
        {"mm_inputs": [(0, 9, b"x")]},
        {"adapter_id": -1},
        {"cache_salt": 3},
        {"hash_seed": -1},
        {"hash_seed": 2**64},
    ],
)
def test_bad_keys_are_rejected(kwargs: dict) -> None:
    kwargs = {"hash_seed": SEED, **kwargs}
    with pytest.raises(InvalidArgumentError):
        _core.hash_blocks(list(range(8)), 4, **kwargs)


def test_bad_block_size() -> None:
    with pytest.raises(InvalidArgumentError):
        _core.hash_blocks([1, 2], 0, hash_seed=SEED)


KEYS = st.fixed_dictionaries(
    {},
    optional={
        "cache_salt": st.binary(max_size=12),
        "adapter_id": st.integers(0, 2**64 - 1),
        "extra_keys": st.binary(max_size=12),
    },
)


@settings(max_examples=200, deadline=None)
@given(
    toks=st.lists(st.integers(0, 2**32 - 1), max_size=70),
    block_size=st.sampled_from([1, 2, 3, 4, 16]),
    keys=KEYS,
    seed=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_random_prompts_match_reference(toks, block_size, keys, seed, data) -> None:
    n = len(toks)
    mm = []
    if n:
        for _ in range(data.draw(st.integers(0, 3), label="mm count")):
            start = data.draw(st.integers(0, n - 1), label="start")
            end = data.draw(st.integers(start + 1, n), label="end")
            mm.append((start, end, data.draw(st.binary(max_size=20), label="hash")))
    got = _core.hash_blocks(toks, block_size, mm_inputs=mm or None, hash_seed=seed, **keys)
    assert got == reference_hashes(toks, block_size, seed, mm_inputs=mm, **keys)


def test_manager_caches_blocks_under_the_reference_hashes() -> None:
    m = BlockManager(64, 4, watermark_blocks=0, hash_seed=SEED)
    m.attach_buffers(StepBuffers(2, 64, m.max_blocks_per_seq, device="cpu"))
    toks = [5, 9, 2, 7, 1, 1, 3, 8, 4, 4, 0]
    keys = dict(cache_salt=b"s", adapter_id=9, mm_inputs=[(2, 6, b"pic")], extra_keys=b"e")
    m.admit(1, toks, **keys)
    m.step([1], len(toks))
    want = reference_hashes(toks, 4, SEED, **keys)
    assert m.block_hashes(1) == want + [None]
    # Appending fills the tail; the next step registers it under the extended chain.
    m.append(1, [6])
    m.step([1], 1)
    assert m.block_hashes(1) == reference_hashes(toks + [6], 4, SEED, **keys)


def _cached_hashes(**kwargs) -> list:
    m = BlockManager(16, 4, watermark_blocks=0, **kwargs)
    m.attach_buffers(StepBuffers(1, 64, m.max_blocks_per_seq, device="cpu"))
    m.admit(1, list(range(9)))
    m.step([1], 9)
    return m.block_hashes(1)


def test_default_manager_key_is_secret_and_per_manager() -> None:
    """Without ``hash_seed`` each manager keys its hashes with its own secret: the same prompt
    hashes differently in two managers, and under no public key."""
    a, b = _cached_hashes(), _cached_hashes()
    assert a[:2] != b[:2] and a[2] is None
    for public in (0, SEED):
        assert a[:2] != reference_hashes(list(range(9)), 4, public)
    assert BlockManager(16, 4).verify_prefix is True
    # An explicit key is reproducible across managers (and processes).
    assert _cached_hashes(hash_seed=SEED) == _cached_hashes(hash_seed=SEED)
    assert _cached_hashes(hash_seed=SEED)[:2] == reference_hashes(list(range(9)), 4, SEED)


@pytest.mark.parametrize("bad", [-1, 2**64, "1", 1.0])
def test_bad_hash_seed_is_rejected(bad) -> None:
    with pytest.raises(InvalidArgumentError):
        BlockManager(16, 4, hash_seed=bad)
