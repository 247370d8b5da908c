"""The block record format, the layout fingerprint and the disk tier (pagedkv.tiers).

Everything runs against real files in a temporary directory: records are corrupted, truncated and
replaced on disk the way a crash, a bad disk or another engine would, and every case must read as a
counted miss, never as wrong bytes or an exception.
"""

from __future__ import annotations

import os
import stat
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.errors import InvalidArgumentError, InvalidConfigError
from pagedkv.tiers import BlockMeta, DiskStore, Reason, fingerprint, load_or_create_hash_key
from pagedkv.tiers.disk import HASH_KEY_FILE
from pagedkv.tiers.record import (
    HEADER_BYTES,
    TRAILER_BYTES,
    decode,
    decode_checked,
    encode,
    encode_into,
    parse_header,
    record_size,
)

from pagedkv.tiers.secret import TierSecret

FP = fingerprint("test/tiny-llama", "bfloat16", 16, 2, 2, 8)
SECRET = TierSecret(b"test fleet secret of at least 32 bytes", source="test")
OTHER_FP = fingerprint("test/other-model", "bfloat16", 16, 2, 2, 8)
BLOCK = 8192  # bytes of one test block
TOKENS = 16


def meta(i: int, salt: int = 7, parent: "int | None" = None) -> BlockMeta:
    return BlockMeta(
        block_hash=(0x9E3779B97F4A7C15 * (i + 1)) % (1 << 128), parent_hash=parent, salt_digest=salt,
        token_ids=[(i * TOKENS + t) % 50_000 for t in range(TOKENS)],
    )


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def store(path: "os.PathLike[str]", slots: int = 8, fp: bytes = FP, **kw: int) -> DiskStore:
    s = DiskStore(path, slots * 12288, fp, BLOCK, max_tokens=TOKENS, secret=SECRET, **kw)
    assert s.num_slots == slots and s.slot_bytes == 12288
    return s


def segment_file(path: "os.PathLike[str]") -> str:
    (name,) = [n for n in os.listdir(path) if n.endswith(".pkv")]
    return os.path.join(path, name)


def decode_args(m: BlockMeta, n: int = BLOCK) -> dict:
    return dict(
        fingerprint=FP, block_hash=m.block_hash, token_ids=m.token_ids, salt_digest=m.salt_digest,
        payload_len=n, secret=SECRET,
    )


# ---------------------------------------------------------------- record and fingerprint


def test_record_round_trip_and_header():
    m = meta(3, parent=1234)
    rec = encode(FP, m, payload(3), secret=SECRET)
    assert len(rec) == record_size(TOKENS, BLOCK) == HEADER_BYTES + 4 * TOKENS + BLOCK + TRAILER_BYTES
    out = decode(rec, **decode_args(m))
    assert out is not None and bytes(out) == payload(3)
    header = parse_header(rec)
    assert header is not None
    assert (header.block_hash, header.parent_hash, header.salt_digest) == (m.block_hash, 1234, 7)
    assert (header.fingerprint, header.token_count, header.payload_len) == (FP, TOKENS, BLOCK)
    assert parse_header(encode(FP, meta(4), payload(4), secret=SECRET)).parent_hash is None
    buf = bytearray(len(rec) + 100)
    assert encode_into(buf, FP, m, payload(3), secret=SECRET) == len(rec) and bytes(buf[: len(rec)]) == rec


def test_record_refusals_name_their_reason():
    m = meta(1)
    rec = bytearray(encode(FP, m, payload(1), secret=SECRET))
    cases = {
        Reason.FOREIGN: dict(decode_args(m), fingerprint=OTHER_FP),
        Reason.HASH_MISMATCH: dict(decode_args(m), block_hash=m.block_hash + 1),
        Reason.SALT_MISMATCH: dict(decode_args(m), salt_digest=8),
        Reason.TOKENS_MISMATCH: dict(decode_args(m), token_ids=list(m.token_ids[:-1]) + [1]),
        Reason.LENGTH_MISMATCH: dict(decode_args(m), payload_len=BLOCK - 1),
    }
    for reason, args in cases.items():
        assert decode_checked(bytes(rec), **args) == (None, reason)
    assert decode_checked(rec[:50], **decode_args(m)) == (None, Reason.TRUNCATED)
    assert decode_checked(rec[:-1], **decode_args(m)) == (None, Reason.TRUNCATED)
    bad = bytearray(rec)
    bad[0] ^= 1
    assert decode_checked(bad, **decode_args(m)) == (None, Reason.BAD_MAGIC)
    bad = bytearray(rec)
    bad[4] = 99
    assert decode_checked(bad, **decode_args(m)) == (None, Reason.BAD_VERSION)
    bad = bytearray(rec)
    bad[HEADER_BYTES + 4 * TOKENS + 5] ^= 0x40
    assert decode_checked(bad, **decode_args(m)) == (None, Reason.CHECKSUM)
    assert decode_checked(b"", **decode_args(m)) == (None, Reason.TRUNCATED)


@settings(max_examples=60, deadline=None)
@given(
    block_hash=st.integers(0, (1 << 128) - 1),
    parent=st.one_of(st.none(), st.integers(0, (1 << 128) - 1)),
    salt=st.integers(0, (1 << 128) - 1),
    tokens=st.lists(st.integers(0, (1 << 32) - 1), min_size=0, max_size=64),
    body=st.binary(min_size=1, max_size=512),
    flip=st.integers(0, 10_000),
    bit=st.integers(0, 7),
)
def test_record_property_round_trip_and_any_flipped_bit_is_refused(
    block_hash, parent, salt, tokens, body, flip, bit
):
    m = BlockMeta(block_hash, parent, salt, tokens)
    rec = encode(FP, m, body, secret=SECRET)
    args = dict(fingerprint=FP, block_hash=block_hash, token_ids=tokens, salt_digest=salt, payload_len=len(body), secret=SECRET)
    out, reason = decode_checked(rec, **args)
    assert reason is Reason.OK and bytes(out) == body
    header = parse_header(rec)
    assert (header.block_hash, header.parent_hash, header.salt_digest) == (block_hash, parent, salt)
    bad = bytearray(rec)
    bad[flip % len(bad)] ^= 1 << bit
    # Bytes of the header that no check reads (flags, reserved) still break the checksum.
    out, reason = decode_checked(bytes(bad), **args)
    assert out is None and reason is not Reason.OK


def test_block_meta_validates_and_freezes_tokens():
    tokens = np.arange(TOKENS, dtype=np.uint32)
    m = BlockMeta(1, None, 2, tokens)
    tokens[0] = 99  # the caller's array is not the meta's
    assert int(m.token_ids[0]) == 0 and not m.token_ids.flags.writeable
    assert m == BlockMeta(1, None, 2, list(range(TOKENS))) and m != BlockMeta(1, None, 3, list(range(TOKENS)))
    with pytest.raises(InvalidArgumentError, match=r"token id 4294967296 is outside"):
        BlockMeta(1, None, 2, [1, 1 << 32])
    with pytest.raises(InvalidArgumentError, match=r"token id -1"):
        BlockMeta(1, None, 2, [-1])
    with pytest.raises(InvalidArgumentError, match=r"block_hash must be in \[0, 2\*\*128\), got -5"):
        BlockMeta(-5, None, 2, [1])
    with pytest.raises(InvalidArgumentError, match=r"salt_digest"):
        BlockMeta(1, None, 1 << 128, [1])
    with pytest.raises(InvalidArgumentError, match=r"parent_hash"):
        BlockMeta(1, "x", 0, [1])  # type: ignore[arg-type]


def test_fingerprint_covers_every_field():
    base = dict(model="m", dtype="bfloat16", block_size=16, num_layers=32, num_kv_heads=8, head_dim=128)
    fp = fingerprint(**base)
    assert len(fp) == 16 and fp == fingerprint(**dict(base, dtype="bf16"))
    variants = [
        dict(base, model="m2"), dict(base, dtype="float16"), dict(base, block_size=32),
        dict(base, num_layers=31), dict(base, num_kv_heads=4), dict(base, head_dim=64),
        dict(base, tp_size=2), dict(base, tp_rank=1, tp_size=2),
    ]
    digests = {fingerprint(**v) for v in variants} | {fp}
    assert len(digests) == len(variants) + 1
    with pytest.raises(InvalidArgumentError, match=r"tp_rank must be < tp_size \(2\), got 2"):
        fingerprint(**dict(base, tp_rank=2, tp_size=2))
    with pytest.raises(InvalidArgumentError, match=r"dtype 'int3'"):
        fingerprint(**dict(base, dtype="int3"))
    with pytest.raises(InvalidArgumentError, match=r"block_size must be an integer >= 1, got 0"):
        fingerprint(**dict(base, block_size=0))


# ---------------------------------------------------------------- disk store


def test_round_trip_sync_async_and_into(tmp_path):
    with store(tmp_path) as s:
        assert s.get(meta(0)) is None and s.stats().misses == 1
        assert s.put(meta(0), payload(0))
        assert s.put_async(meta(1), np.frombuffer(payload(1), np.uint8)).result() is True
        assert s.get(meta(0)) == payload(0)
        assert s.get_async(meta(1)).result() == payload(1)
        out = np.zeros(BLOCK, np.uint8)
        assert s.get_into(meta(0), out) and out.tobytes() == payload(0)
        assert s.get_into_async(meta(1), out).result() and out.tobytes() == payload(1)
        assert s.contains(meta(0).block_hash) and not s.contains(meta(5).block_hash)
        st_ = s.stats()
        assert (st_.hits, st_.misses, st_.puts, st_.blocks) == (4, 1, 2, 2)
        assert st_.bytes_written == 2 * record_size(TOKENS, BLOCK)
        assert st_.bytes_read == 4 * record_size(TOKENS, BLOCK)
        assert st_.usage_bytes == 2 * s.slot_bytes and st_.capacity_bytes == 8 * s.slot_bytes
        # A second put of a stored block writes nothing.
        assert s.put(meta(0), payload(0)) and s.stats().bytes_written == st_.bytes_written


def test_longest_prefix_and_remove(tmp_path):
    with store(tmp_path) as s:
        for i in (0, 1, 3):
            s.put(meta(i), payload(i))
        hashes = [meta(i).block_hash for i in range(5)]
        assert s.longest_prefix(hashes) == 2
        assert s.longest_prefix(hashes[3:]) == 1 and s.longest_prefix([]) == 0
        assert s.remove(hashes[1]) and not s.remove(hashes[1])
        assert s.longest_prefix(hashes) == 1 and s.get(meta(1)) is None
    with store(tmp_path) as s:  # a removed block stays removed after a restart
        assert s.longest_prefix([meta(i).block_hash for i in range(4)]) == 1 and s.contains(hashes[3])


def test_restart_finds_the_blocks(tmp_path):
    with store(tmp_path) as s:
        for i in range(5):
            s.put(meta(i, parent=i or None), payload(i))
    with store(tmp_path) as s:
        assert len(s) == 5 and s.stats().puts == 0
        for i in range(5):
            assert s.get(meta(i)) == payload(i)
        # The free slots are still usable, and eviction still works past them.
        for i in range(5, 12):
            assert s.put(meta(i), payload(i))
        assert len(s) == 8 and s.stats().evictions == 4


def test_restart_with_a_smaller_capacity_keeps_what_fits(tmp_path):
    with store(tmp_path, slots=8) as s:
        for i in range(8):
            s.put(meta(i), payload(i))
    with store(tmp_path, slots=3) as s:
        assert [s.contains(meta(i).block_hash) for i in range(8)] == [True] * 3 + [False] * 5
        assert os.path.getsize(segment_file(tmp_path)) == 3 * s.slot_bytes


def test_lru_eviction_under_capacity(tmp_path):
    with store(tmp_path, slots=3) as s:
        for i in range(3):
            s.put(meta(i), payload(i))
        assert s.get(meta(0)) == payload(0)  # 0 is now the most recent; 1 is the oldest
        s.put(meta(3), payload(3))
        assert [s.contains(meta(i).block_hash) for i in range(4)] == [True, False, True, True]
        s.put(meta(4), payload(4))
        assert [s.contains(meta(i).block_hash) for i in range(5)] == [True, False, False, True, True]
        assert s.stats().evictions == 2 and len(s) == 3
        assert os.path.getsize(segment_file(tmp_path)) == 3 * s.slot_bytes
        for i in (0, 3, 4):
            assert s.get(meta(i)) == payload(i)


def test_flipped_byte_on_disk_is_a_counted_miss(tmp_path):
    with store(tmp_path) as s:
        s.put(meta(0), payload(0))
        s.put(meta(1), payload(1))
        path = segment_file(tmp_path)
        with open(path, "r+b") as f:  # one bit of block 0's payload
            f.seek(HEADER_BYTES + 4 * TOKENS + 1000)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x10]))
        assert s.get(meta(0)) is None
        st_ = s.stats()
        assert (st_.corrupt, st_.misses, st_.hits) == (1, 1, 0)
        assert not s.contains(meta(0).block_hash)  # its slot is free space now
        assert s.get(meta(1)) == payload(1)
        out = np.zeros(BLOCK, np.uint8)
        s.put(meta(0), payload(0))
        assert s.get_into(meta(0), out) and out.tobytes() == payload(0)
    with open(segment_file(tmp_path), "r+b") as f:  # corrupt the header's tokens this time
        f.seek(s.slot_bytes + HEADER_BYTES)
        f.write(b"\xff\xff")
    with store(tmp_path) as s:
        assert s.get(meta(1)) is None and s.stats().mismatched == 1


def test_corrupt_block_is_not_indexed_again_after_restart(tmp_path):
    with store(tmp_path) as s:
        s.put(meta(0), payload(0))
        with open(segment_file(tmp_path), "r+b") as f:
            f.seek(HEADER_BYTES + 4 * TOKENS + 17)
            f.write(b"\x00\x01\x02")
        assert s.get(meta(0)) is None and s.stats().corrupt == 1
    with store(tmp_path) as s:
        assert len(s) == 0 and s.get(meta(0)) is None and s.stats().corrupt == 0


def test_truncated_file_is_a_counted_miss(tmp_path):
    with store(tmp_path) as s:
        s.put(meta(0), payload(0))
        s.put(meta(1), payload(1))
        os.truncate(segment_file(tmp_path), s.slot_bytes + 500)
        assert s.get(meta(0)) == payload(0)
        assert s.get(meta(1)) is None
        assert s.stats().corrupt == 1
        assert s.put(meta(2), payload(2)) and s.get(meta(2)) == payload(2)  # the slot is reused
    os.truncate(segment_file(tmp_path), 100)
    with store(tmp_path) as s:  # a restart over a truncated segment: nothing indexed, all usable
        assert len(s) == 0
        assert os.path.getsize(segment_file(tmp_path)) == 8 * s.slot_bytes
        assert s.put(meta(0), payload(0)) and s.get(meta(0)) == payload(0)


def test_foreign_fingerprint_is_ignored_and_its_slots_reused(tmp_path):
    with store(tmp_path, slots=4) as s:
        for i in range(4):
            s.put(meta(i), payload(i))
    with store(tmp_path, slots=4, fp=OTHER_FP) as s:
        assert len(s) == 0 and s.stats().foreign == 4
        assert s.get(meta(0)) is None
        for i in range(10, 14):
            assert s.put(meta(i), payload(i))
        assert s.stats().evictions == 0 and len(s) == 4
    with store(tmp_path, slots=4) as s:  # the first model's blocks were overwritten
        assert len(s) == 0 and s.stats().foreign == 4


def test_foreign_record_written_under_a_stored_hash_is_refused(tmp_path):
    with store(tmp_path) as s:
        s.put(meta(0), payload(0))
        with open(segment_file(tmp_path), "r+b") as f:
            f.write(encode(OTHER_FP, meta(0), payload(0), secret=SECRET))
        assert s.get(meta(0)) is None and s.stats().foreign == 1


def test_other_block_size_files_are_removed(tmp_path):
    with store(tmp_path) as s:
        s.put(meta(0), payload(0))
        old = segment_file(tmp_path)
    with DiskStore(tmp_path, 1 << 20, FP, 2 * BLOCK, max_tokens=TOKENS) as s:
        assert not os.path.exists(old) and s.stats().foreign == 1 and len(s) == 0


def test_wrong_token_ids_or_salt_is_a_miss_and_keeps_the_block(tmp_path):
    with store(tmp_path) as s:
        m = meta(0)
        s.put(m, payload(0))
        other_tokens = BlockMeta(m.block_hash, None, m.salt_digest, list(range(100, 100 + TOKENS)))
        other_salt = BlockMeta(m.block_hash, None, m.salt_digest + 1, m.token_ids)
        assert s.get(other_tokens) is None and s.get(other_salt) is None
        out = np.full(BLOCK, 3, np.uint8)
        assert not s.get_into(other_salt, out)
        assert s.stats().mismatched == 3 and s.stats().corrupt == 0
        assert s.get(m) == payload(0)  # another tenant's miss does not evict the owner's block


def test_permissions_are_owner_only(tmp_path):
    root = tmp_path / "cache"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    with DiskStore(root, 1 << 20, FP, BLOCK, max_tokens=TOKENS) as s:
        s.put(meta(0), payload(0))
        key = load_or_create_hash_key(root)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    names = os.listdir(root)
    assert HASH_KEY_FILE in names and "lock" in names and any(n.endswith(".pkv") for n in names)
    for name in names:
        assert stat.S_IMODE(os.stat(root / name).st_mode) == 0o600, name
    fresh = tmp_path / "a" / "b"
    DiskStore(fresh, 1 << 20, FP, BLOCK).close()
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    assert 0 <= key < 1 << 64


def test_hash_key_is_stable_and_checked(tmp_path):
    key = load_or_create_hash_key(tmp_path / "k")
    assert load_or_create_hash_key(tmp_path / "k") == key
    assert load_or_create_hash_key(tmp_path / "k2") != key  # 2**-64 odds of a false failure
    path = tmp_path / "k" / HASH_KEY_FILE
    assert path.read_text() == f"{key:016x}\n"
    os.chmod(path, 0o644)
    assert load_or_create_hash_key(tmp_path / "k") == key
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    path.write_text("not a key\n")
    with pytest.raises(InvalidConfigError, match=r"does not hold a key"):
        load_or_create_hash_key(tmp_path / "k")


def test_one_store_per_directory(tmp_path):
    s = store(tmp_path)
    with pytest.raises(InvalidConfigError, match=r"in use by another DiskStore"):
        store(tmp_path)
    s.close()
    s.close()  # idempotent
    store(tmp_path).close()


def test_bad_arguments_raise_typed_errors_naming_the_value(tmp_path):
    with pytest.raises(InvalidConfigError, match=r"capacity_bytes must be an integer >= 0, got -1") as info:
        DiskStore(tmp_path, -1, FP, BLOCK)
    assert info.value.field == "capacity_bytes" and info.value.value == -1
    with pytest.raises(InvalidConfigError, match=r"capacity_bytes 12287 is smaller than one block's slot \(12288"):
        DiskStore(tmp_path, 12287, FP, BLOCK, max_tokens=TOKENS)
    with pytest.raises(InvalidConfigError, match=r"block_bytes"):
        DiskStore(tmp_path, 1 << 20, FP, 0)
    with pytest.raises(InvalidConfigError, match=r"fingerprint must be 16 bytes"):
        DiskStore(tmp_path, 1 << 20, b"short", BLOCK)
    with pytest.raises(InvalidConfigError, match=r"threads"):
        DiskStore(tmp_path, 1 << 20, FP, BLOCK, threads=0)
    with store(tmp_path) as s:
        with pytest.raises(InvalidArgumentError, match=r"data holds 8191 bytes; this store's blocks are 8192") as err:
            s.put(meta(0), payload(0)[:-1])
        assert err.value.value == 8191
        with pytest.raises(InvalidArgumentError, match=r"data holds 8191 bytes"):
            s.put_async(meta(0), payload(0)[:-1])
        with pytest.raises(InvalidArgumentError, match=r"17 token ids exceeds this store's max_tokens 16"):
            s.put(BlockMeta(1, None, 0, list(range(17))), payload(0))
        with pytest.raises(InvalidArgumentError, match=r"meta must be a pagedkv.tiers.BlockMeta"):
            s.get("nope")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match=r"out must be a writable buffer"):
            s.get_into(meta(0), payload(0))
        with pytest.raises(InvalidArgumentError, match=r"block hash must be an integer in \[0, 2\*\*128\), got -1"):
            s.contains(-1)
        with pytest.raises(InvalidArgumentError, match=r"must support the buffer protocol"):
            s.put(meta(0), "text")  # type: ignore[arg-type]
        assert len(s) == 0 and s.stats().puts == 0  # nothing changed


def test_concurrent_puts_and_gets_never_return_wrong_bytes(tmp_path):
    """Eight threads over twelve slots and forty blocks: eviction races with reads and writes."""
    with store(tmp_path, slots=12, threads=4) as s:
        errors: list[BaseException] = []
        wrong: list[int] = []
        hits = [0] * 8  # one counter per thread: no shared read-modify-write

        def worker(seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                for _ in range(150):
                    i = int(rng.integers(0, 40))
                    if rng.random() < 0.5:
                        s.put(meta(i), payload(i))
                    else:
                        got = s.get(meta(i)) if rng.random() < 0.5 else s.get_async(meta(i)).result()
                        if got is not None:
                            hits[seed] += 1
                            if got != payload(i):
                                wrong.append(i)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and wrong == []
        st_ = s.stats()
        assert sum(hits) == st_.hits > 0 and st_.corrupt == 0 and st_.errors == 0
        assert len(s) <= 12 and st_.evictions > 0
    with store(tmp_path, slots=12) as s:  # what the races left on disk all verifies
        held = [i for i in range(40) if s.contains(meta(i).block_hash)]
        assert len(held) == 12
        assert all(s.get(meta(i)) == payload(i) for i in held)


def test_use_after_close_raises_store_closed(tmp_path):
    from pagedkv.tiers import StoreClosedError

    s = store(tmp_path)
    s.put(meta(0), payload(0))
    s.close()
    for call in (
        lambda: s.put(meta(1), payload(1)), lambda: s.put_async(meta(1), payload(1)),
        lambda: s.get(meta(0)), lambda: s.get_async(meta(0)), lambda: s.contains(meta(0).block_hash),
        lambda: s.longest_prefix([meta(0).block_hash]), lambda: s.remove(meta(0).block_hash),
    ):
        with pytest.raises(StoreClosedError, match=r"DiskStore\(.*\) is closed"):
            call()
    assert s.stats().blocks == 1
    assert [n for n in os.listdir(tmp_path) if n.endswith(".pkv")] == [os.path.basename(segment_file(tmp_path))]


_FSIZE_SCRIPT = r"""
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
from pagedkv.tiers import BlockMeta, DiskStore, fingerprint
fp = fingerprint("test/tiny-llama", "bfloat16", 16, 2, 2, 8)
block = 8192
s = DiskStore(sys.argv[1], 8 * 12288, fp, block, max_tokens=16)
resource.setrlimit(resource.RLIMIT_FSIZE, (4 * 12288, resource.RLIM_INFINITY))
m = BlockMeta(1, None, 0, list(range(16)))
ok = s.put(m, bytes(block))
ok_async = s.put_async(BlockMeta(2, None, 0, list(range(16))), bytes(block)).result()
got = s.get(m)
st = s.stats()
print(ok, ok_async, got is None, st.errors, st.dropped, st.puts, st.misses)
"""


def test_a_file_system_refusing_the_segment_is_a_counted_drop(tmp_path):
    """The process may not grow files past 4 slots (RLIMIT_FSIZE), so preallocating the 8-slot
    segment fails with EFBIG: puts are dropped and counted, nothing raises."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", _FSIZE_SCRIPT, str(tmp_path / "d")], capture_output=True, text=True,
        env=env, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True", "2", "2", "0", "1"]


class DiskModel:
    """What a DiskStore of ``slots`` slots must hold: keys in LRU order, each in a slot (the lowest
    free slot, or the evicted block's), and after a restart the LRU order is the slot order."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.lru: "dict[int, int]" = {}  # key -> slot, oldest first (dicts keep insertion order)

    def put(self, key: int) -> None:
        if key in self.lru:
            self.lru[key] = self.lru.pop(key)
            return
        used = set(self.lru.values())
        free = [s for s in range(self.slots) if s not in used]
        if free:
            slot = free[0]
        else:
            oldest = next(iter(self.lru))
            slot = self.lru.pop(oldest)
        self.lru[key] = slot

    def get(self, key: int) -> bool:
        if key not in self.lru:
            return False
        self.lru[key] = self.lru.pop(key)
        return True

    def remove(self, key: int) -> bool:
        return self.lru.pop(key, None) is not None

    def restart(self) -> None:
        self.lru = dict(sorted(self.lru.items(), key=lambda kv: kv[1]))


_OPS = st.sampled_from(["put", "put", "put", "get", "get", "remove", "restart"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_OPS, st.integers(0, 7)), min_size=5, max_size=60))
def test_disk_store_follows_its_lru_model(tmp_path_factory, ops):
    """Random puts, gets, removes and restarts over 4 slots and 8 blocks: the store holds exactly
    the model's blocks, with their bytes, after every step."""
    path = tmp_path_factory.mktemp("model")
    model = DiskModel(4)
    s = store(path, slots=4)
    try:
        for op, key in ops:
            if op == "put":
                assert s.put(meta(key), payload(key))
                model.put(key)
            elif op == "get":
                got = s.get(meta(key))
                assert (got is not None) == model.get(key)
                assert got is None or got == payload(key)
            elif op == "remove":
                assert s.remove(meta(key).block_hash) == model.remove(key)
            else:
                s.close()
                s = store(path, slots=4)
                model.restart()
            assert {k for k in range(8) if s.contains(meta(k).block_hash)} == set(model.lru)
    finally:
        s.close()
