"""The chained prefix hash, reimplemented in Python from its written specification.

An independent implementation with the ``xxhash`` package must reproduce the core's hashes bit for
bit, including the worked examples of ``docs/prefix-hash.md``, which specifies it:

    h_{-1} = XXH3-128( b"pagedkv/prefix/v1" ‖ u32le(len(salt)) ‖ salt )
    h_i    = XXH3-128( u128le(h_{i-1}) ‖ u32le(token) × B ‖ extra_i )

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
    cache_salt: bytes = b"",
    adapter_id: Optional[int] = None,
    mm_inputs: Sequence[tuple[int, int, bytes]] = (),
    extra_keys: bytes = b"",
) -> list[bytes]:
    prev = xxhash.xxh3_128_intdigest(DOMAIN + struct.pack("<I", len(cache_salt)) + cache_salt)
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
        prev = xxhash.xxh3_128_intdigest(bytes(msg))
        out.append(prev.to_bytes(16, "little"))
    return out


# The worked examples of docs/prefix-hash.md, as u128le bytes: block size 16, tokens 0..31.
DOC_NO_KEYS = ["7506a7967aaa219aa0c3db3ac3036f84", "b9e561cec3cf430ba7a714278c3fcad6"]
DOC_ALL_KEYS = ["bdf3dcc279f7a9e8cabf5be625b18379", "371086f37c940a3eeae15c98072f88f8"]
DOC_KEYS = dict(
    cache_salt=b"tenant-a", adapter_id=7, mm_inputs=[(4, 20, b"\xab" * 16)], extra_keys=b"x"
)


def test_documented_examples() -> None:
    toks = list(range(32))
    for got in (reference_hashes(toks, 16), _core.hash_blocks(toks, 16)):
        assert [h.hex() for h in got] == DOC_NO_KEYS
    for got in (reference_hashes(toks, 16, **DOC_KEYS), _core.hash_blocks(toks, 16, **DOC_KEYS)):
        assert [h.hex() for h in got] == DOC_ALL_KEYS


def test_plain_chain() -> None:
    toks = list(range(40))
    got = _core.hash_blocks(toks, 16)
    assert len(got) == 2 and all(len(h) == 16 for h in got)
    assert got == reference_hashes(toks, 16)


def test_partial_block_is_not_hashed() -> None:
    assert _core.hash_blocks([1, 2, 3], 4) == []
    assert len(_core.hash_blocks([1, 2, 3, 4, 5], 4)) == 1


def test_every_key_kind_matches() -> None:
    toks = [(i * 7919) % 50000 for i in range(64)]
    kwargs = dict(
        cache_salt=b"tenant-42",
        adapter_id=2**64 - 1,
        mm_inputs=[(3, 20, b"\xaa" * 16), (18, 40, b"img-2"), (60, 64, b"")],
        extra_keys=b"\x00\x01extra",
    )
    assert _core.hash_blocks(toks, 8, **kwargs) == reference_hashes(toks, 8, **kwargs)


def test_str_salt_is_its_utf8_bytes() -> None:
    toks = list(range(8))
    assert _core.hash_blocks(toks, 4, cache_salt="ünï") == reference_hashes(
        toks, 4, cache_salt="ünï".encode()
    )
    # No salt and an empty salt are the same root.
    assert _core.hash_blocks(toks, 4, cache_salt=b"") == _core.hash_blocks(toks, 4)


def test_token_ids_span_the_u32_range() -> None:
    toks = np.array([0, 2**32 - 1, 2**31, 1], dtype=np.uint32)
    assert _core.hash_blocks(toks, 2) == reference_hashes(toks.tolist(), 2)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mm_inputs": [(4, 4, b"x")]},
        {"mm_inputs": [(0, 9, b"x")]},
        {"adapter_id": -1},
        {"cache_salt": 3},
    ],
)
def test_bad_keys_are_rejected(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        _core.hash_blocks(list(range(8)), 4, **kwargs)


def test_bad_block_size() -> None:
    with pytest.raises(InvalidArgumentError):
        _core.hash_blocks([1, 2], 0)


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
    data=st.data(),
)
def test_random_prompts_match_reference(toks, block_size, keys, data) -> None:
    n = len(toks)
    mm = []
    if n:
        for _ in range(data.draw(st.integers(0, 3), label="mm count")):
            start = data.draw(st.integers(0, n - 1), label="start")
            end = data.draw(st.integers(start + 1, n), label="end")
            mm.append((start, end, data.draw(st.binary(max_size=20), label="hash")))
    got = _core.hash_blocks(toks, block_size, mm_inputs=mm or None, **keys)
    assert got == reference_hashes(toks, block_size, mm_inputs=mm, **keys)


def test_manager_caches_blocks_under_the_reference_hashes() -> None:
    m = BlockManager(64, 4, watermark_blocks=0)
    m.attach_buffers(StepBuffers(2, 64, m.max_blocks_per_seq, device="cpu"))
    toks = [5, 9, 2, 7, 1, 1, 3, 8, 4, 4, 0]
    keys = dict(cache_salt=b"s", adapter_id=9, mm_inputs=[(2, 6, b"pic")], extra_keys=b"e")
    m.admit(1, toks, **keys)
    m.step([1], len(toks))
    want = reference_hashes(toks, 4, **keys)
    assert m.block_hashes(1) == want + [None]
    # Appending fills the tail; the next step registers it under the extended chain.
    m.append(1, [6])
    m.step([1], 1)
    assert m.block_hashes(1) == reference_hashes(toks + [6], 4, **keys)
