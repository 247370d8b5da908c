"""pagedkv.hash_prompt, written from docs/prefix-hash.md, against the core's hashes.

The router and any external indexer find a prompt among the hashes replicas publish by computing
them themselves; these tests hold the pure-Python implementation to the core's for random inputs
(tokens, block sizes, keys, salts) and to the documented worked examples.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from pagedkv import _core, hash_prompt
from pagedkv.errors import InvalidArgumentError


def core_hashes(tokens: list[int], block_size: int, key: int, salt: object) -> list[int]:
    raw = _core.hash_blocks(tokens, block_size, salt, hash_seed=key)
    return [int.from_bytes(h, "little") for h in raw]


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    block_size=st.sampled_from([1, 2, 3, 8, 16, 32]),
    key=st.integers(0, 2**64 - 1),
    salt=st.one_of(st.none(), st.binary(min_size=1, max_size=40),
                   st.text(min_size=1, max_size=12)),
)
def test_equals_core_for_random_inputs(tokens: list[int], block_size: int, key: int,
                                       salt: object) -> None:
    got = hash_prompt(tokens, block_size, key, salt)  # type: ignore[arg-type]
    assert got == core_hashes(tokens, block_size, key, salt)
    assert len(got) == len(tokens) // block_size


def test_documented_examples() -> None:
    tokens = list(range(32))
    assert hash_prompt(tokens, 16, 0) == [0x846F03C33ADBC3A09A21AA7A96A70675,
                                          0xD6CA3F8C2714A7A70B43CFC3CE61E5B9]
    assert hash_prompt(tokens, 16, 0x0123456789ABCDEF) == [0x4A9C1072B7AEBA3C031C91FF9C2FA6AF,
                                                           0x058BEF18BB7200CA5904DA6720B2FE0C]


def test_prefix_property_and_salt_separates() -> None:
    tokens = list(range(100, 164))
    full = hash_prompt(tokens, 16, 7)
    assert hash_prompt(tokens[:40], 16, 7) == full[:2]
    assert hash_prompt(tokens, 16, 7, "tenant-a") != full
    assert hash_prompt(tokens, 16, 7, "tenant-a") == hash_prompt(tokens, 16, 7, b"tenant-a")
    assert hash_prompt(tokens, 16, 8) != full


@pytest.mark.parametrize("args, what", [
    (([1, 2], 0, 0), "block_size"),
    (([1, 2], 2**32, 0), "block_size"),
    (([1, 2], 2, -1), "key"),
    (([1, 2], 2, 2**64), "key"),
    (([1, -2], 2, 0), "tokens"),
    (([1, 2**32], 2, 0), "tokens"),
    (([1, 2], 2, 0, ""), "salt"),
    (([1, 2], 2, 0, 5), "salt"),
])
def test_bad_input_names_the_value(args: tuple, what: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        hash_prompt(*args)
    assert err.value.fields["what"] == what
