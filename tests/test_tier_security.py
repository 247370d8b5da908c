"""The tiers' trust guarantee against a party that can write to them.

"Anything that does not verify is a miss, never wrong KV; nothing crosses models": checked here
against what an adversary with write access to a tier can actually do, with real parts — a real
``redis-server`` on loopback, real files, symbolic and hard links, files chowned to ``nobody``,
and real engines on a tiny random Llama compared with transformers' own ``generate``:

* records re-encoded with other KV and a valid checksum, real payloads swapped between keys, a
  record of another fleet (another tier secret): counted ``unauthenticated`` misses, output
  unchanged;
* the tier secret's sources (environment, a 0600 file) and their refusals; a remote tier without
  one refuses to start;
* new weights saved at the same path: another fingerprint, zero tier hits;
* a cache directory or file prepared by another user, or reached through a link: refused with a
  typed error; a full disk at start-up: a typed error;
* a store (and an ``LLM``) dropped without ``shutdown`` releases its directory;
* the disk store reports the hashes it evicted (``take_removed``).
"""

from __future__ import annotations

import gc
import os
import pickle
import pwd
import random
import subprocess
import sys
import textwrap
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import xxhash

from pagedkv.errors import CacheIOError, InvalidConfigError, TierSecretError, UnsafePathError
from pagedkv.tiers import BlockMeta, DiskStore, Reason, RemoteStore, fingerprint, load_or_create_hash_key
from pagedkv.tiers.disk import HASH_KEY_FILE, LOCK_FILE, TIER_KEY_FILE, load_or_create_tier_key
from pagedkv.tiers.fingerprint import model_identity, weights_digest
from pagedkv.tiers.record import CHECKSUM_BYTES, MAC_BYTES, encode, parse_header
from pagedkv.tiers.secret import ENV_VAR, TierSecret, load_tier_secret

FP = fingerprint("test/tiny-llama", "bfloat16", 16, 2, 2, 8)
BLOCK = 8192
TOKENS = 16
SECRET_TEXT = "the fleet's tier secret, 32 bytes or more"
SECRET = TierSecret(SECRET_TEXT.encode(), source="test")
OTHER_FLEET = TierSecret(b"another fleet's secret, also long enough", source="test")

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def meta(i: int) -> BlockMeta:
    return BlockMeta((0x9E3779B97F4A7C15 * (i + 1)) % (1 << 128), None, 7,
                     [(i * TOKENS + t) % 50_000 for t in range(TOKENS)])


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def reencode(record: bytes, new_payload: bytes) -> bytes:
    """What a writer without the secret can do: keep a record's header and tokens, put other KV
    in, and recompute the checksum (the MAC it cannot recompute stays as it was)."""
    header = parse_header(record)
    assert header is not None
    n = len(record) - header.payload_len - CHECKSUM_BYTES - MAC_BYTES
    prefix = record[:n]
    return prefix + new_payload + xxhash.xxh3_128_digest(prefix + new_payload) + record[-MAC_BYTES:]


def nobody() -> Tuple[int, int]:
    entry = pwd.getpwnam("nobody")
    return entry.pw_uid, entry.pw_gid


def disk(path: Any, slots: int = 8, **kw: Any) -> DiskStore:
    kw.setdefault("secret", SECRET)
    return DiskStore(path, slots * 12288, FP, BLOCK, max_tokens=TOKENS, **kw)


# ====================================================================== 1. authenticated records


def test_remote_tampered_reencoded_swapped_and_foreign_records_are_misses(redis_server: Any) -> None:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    with RemoteStore(redis_server.url, FP, BLOCK, secret=SECRET, timeout_s=2.0) as s, \
            RemoteStore(redis_server.url, FP, BLOCK, secret=OTHER_FLEET, timeout_s=2.0) as other:
        for i in range(6):
            assert s.put(meta(i), payload(i))
        keys = [s.key(meta(i).block_hash) for i in range(6)]
        values = [client.get(k) for k in keys]
        # A tampered value (a flipped payload byte, checksum untouched): corrupt.
        bad = bytearray(values[0])
        bad[200] ^= 0x40
        client.set(keys[0], bytes(bad))
        # Other KV re-encoded under a valid checksum: only the MAC refuses it.
        client.set(keys[1], reencode(values[1], payload(99)))
        # Two real payloads swapped between keys (headers kept, checksums recomputed).
        client.set(keys[2], reencode(values[2], payload(3)))
        client.set(keys[3], reencode(values[3], payload(2)))
        # Two whole real records swapped between keys: each names another block.
        client.set(keys[4], values[5])
        client.set(keys[5], values[4])
        # Another fleet's record: not even seen under our keys, and refused if copied there.
        assert other.put(meta(6), payload(6))
        assert not s.contains(meta(6).block_hash) and s.get(meta(6)) is None
        key6 = s.key(meta(6).block_hash)
        client.set(key6, client.get(other.key(meta(6).block_hash)))
        before = s.stats()
        assert [s.get(meta(i)) for i in range(7)] == [None] * 7
        st = s.stats()
        assert st.hits == before.hits
        assert st.corrupt - before.corrupt == 1
        assert st.unauthenticated - before.unauthenticated == 4  # re-encoded, 2 swapped, other fleet
        assert st.mismatched - before.mismatched == 2
        # Forged values are deleted (one miss, not one per reader); the other fleet's own key stays.
        assert [client.exists(k) for k in keys[:4] + [key6]] == [0] * 5
        assert other.get(meta(6)) == payload(6)
        # The real blocks, written again, verify.
        for i in range(6):
            assert s.put(meta(i), payload(i))
        assert all(s.get(meta(i)) == payload(i) for i in range(6))
    client.close()


def test_disk_reencoded_record_with_a_valid_checksum_is_an_unauthenticated_miss(tmp_path: Any) -> None:
    with disk(tmp_path / "d") as s:
        assert s.put(meta(0), payload(0)) and s.put(meta(1), payload(1))
    (seg,) = [p for p in (tmp_path / "d").iterdir() if p.suffix == ".pkv"]
    raw = seg.read_bytes()
    rec = encode(FP, meta(0), payload(0), secret=SECRET)
    assert raw[:len(rec)] == rec
    with open(seg, "r+b") as f:
        f.write(reencode(rec, payload(7)))
    with disk(tmp_path / "d") as s:
        assert s.get(meta(0)) is None and s.get(meta(1)) == payload(1)
        st = s.stats()
        assert (st.hits, st.unauthenticated, st.corrupt) == (1, 1, 0)
        assert not s.contains(meta(0).block_hash)  # its slot is free space again
    # Records another secret wrote (the directory's own key, then a fleet secret): misses.
    with disk(tmp_path / "e", secret=None) as own:
        assert own.put(meta(2), payload(2))
    with disk(tmp_path / "e") as fleet:
        assert fleet.contains(meta(2).block_hash) and fleet.get(meta(2)) is None
        assert fleet.stats().unauthenticated == 1


def test_disk_tier_keeps_its_own_key_when_given_none(tmp_path: Any) -> None:
    root = tmp_path / "own"
    with disk(root, secret=None) as s:
        assert s.put(meta(0), payload(0))
        first = s.secret
    st = os.stat(root / TIER_KEY_FILE)
    assert st.st_mode & 0o777 == 0o600 and st.st_nlink == 1
    assert load_or_create_tier_key(root) == first
    with disk(root, secret=None) as s:
        assert s.secret == first and s.get(meta(0)) == payload(0)
    assert first != load_or_create_tier_key(tmp_path / "another")


def _engine(model_dir: str, prompts: List[List[int]],
            **kw: Any) -> Tuple[List[List[int]], Any, Dict[str, Any]]:
    import pagedkv

    sp = pagedkv.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm = pagedkv.LLM(model_dir, device="cpu", num_blocks=24, block_size=16, max_num_seqs=2,
                      progress=False, host_cache_memory="64KiB", **kw)
    try:
        outs = [list(llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids)
                for p in prompts]
        stats = llm.stats()
        tiers = llm.llm_engine.tiers
        stores = {s.name: s.stats() for s in tiers.stores} if tiers else {}
    finally:
        llm.shutdown()
    return outs, stats, stores


def _prompts(seed: int, n: int = 6, length: int = 100) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 128) for _ in range(length)] for _ in range(n)]


def _reference(model_dir: str, prompts: List[List[int]], n: int = 5) -> List[List[int]]:
    import torch
    import transformers

    dense = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = dense.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("transformers")
    from tiny_llama import save_tiny_llama

    return save_tiny_llama(str(tmp_path_factory.mktemp("security-model")), 512)


@pytest.fixture(autouse=True)
def _private_digest_cache(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(ENV_VAR, raising=False)


def test_forged_remote_records_leave_generate_unchanged(model_dir: str, redis_url: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A party with write access to the shared Redis re-encodes every value with other KV and a
    valid checksum: the next engine serves nothing from it and its output is transformers'."""
    import redis

    monkeypatch.setenv(ENV_VAR, SECRET_TEXT)
    args: Dict[str, Any] = dict(remote_cache_url=redis_url, remote_cache_timeout_s=1.0, hash_seed=77)
    prompts = _prompts(0)
    expected = _reference(model_dir, prompts)
    first, s1, _ = _engine(model_dir, prompts + _prompts(1), **args)
    assert first[:6] == expected and s1.tier_bytes_written["remote"] > 0
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=b"pagedkv:*"))
    assert keys
    rng = np.random.default_rng(5)
    for k in keys:
        v = client.get(k)
        n = parse_header(v).payload_len  # type: ignore[union-attr]
        client.set(k, reencode(v, rng.integers(0, 256, n, dtype=np.uint8).tobytes()))
    client.close()
    again, s2, stores = _engine(model_dir, prompts, **args)
    assert again == expected
    assert s2.prefix_hits_by_tier.get("remote", 0) == 0
    assert stores["remote"].unauthenticated > 0 and stores["remote"].hits == 0


def test_a_remote_tier_without_a_secret_refuses_to_start(model_dir: str, tmp_path: Any) -> None:
    with pytest.raises(TierSecretError, match=ENV_VAR) as info:
        RemoteStore("redis://127.0.0.1:1/0", FP, BLOCK)
    assert info.value.reason == "missing"
    import pagedkv

    with pytest.raises(TierSecretError, match="tier_secret_file"):
        pagedkv.LLM(model_dir, device="cpu", num_blocks=24, block_size=16, progress=False,
                    host_cache_memory="64KiB", remote_cache_url="redis://127.0.0.1:1/0")
    # The same engine with the secret in a private file starts and uses it.
    path = tmp_path / "tier-secret"
    path.write_text(SECRET_TEXT + "\n")
    os.chmod(path, 0o600)
    llm = pagedkv.LLM(model_dir, device="cpu", num_blocks=24, block_size=16, progress=False,
                      host_cache_memory="64KiB", remote_cache_url="redis://127.0.0.1:1/0",
                      tier_secret_file=str(path))
    try:
        (store,) = [s for s in llm.llm_engine.tiers.stores if s.name == "remote"]
        assert store.secret == SECRET and store.secret.key_id == SECRET.key_id
    finally:
        llm.shutdown()


def test_tier_secret_sources_and_refusals(tmp_path: Any) -> None:
    assert load_tier_secret(environ={}) is None
    env = load_tier_secret(environ={ENV_VAR: SECRET_TEXT})
    assert env == SECRET and env is not None and env.source == f"env {ENV_VAR}"
    with pytest.raises(TierSecretError, match="at least 32"):
        load_tier_secret(environ={ENV_VAR: "short"})
    good = tmp_path / "secret"
    good.write_text(SECRET_TEXT + "\n")
    os.chmod(good, 0o600)
    assert load_tier_secret(str(good), environ={ENV_VAR: "ignored: the file wins"}) == SECRET
    os.chmod(good, 0o400)
    assert load_tier_secret(str(good)) == SECRET
    # Readable by others: refused, as are a link and a missing file.
    os.chmod(good, 0o640)
    with pytest.raises(UnsafePathError, match="0640"):
        load_tier_secret(str(good))
    os.chmod(good, 0o600)
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        load_tier_secret(str(link))
    with pytest.raises(TierSecretError, match="cannot be opened"):
        load_tier_secret(str(tmp_path / "absent"))
    # Never shown, never pickled.
    assert SECRET_TEXT not in repr(env) and SECRET.key_id in repr(env)
    with pytest.raises(TypeError):
        pickle.dumps(env)


def test_stores_without_a_secret_argument_take_the_environments(tmp_path: Any, redis_url: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, SECRET_TEXT)
    with RemoteStore(redis_url, FP, BLOCK) as r, disk(tmp_path / "d", secret=None) as d:
        assert r.secret == SECRET and d.secret == SECRET
        assert r.put(meta(0), payload(0)) and d.put(meta(0), payload(0))
    assert not (tmp_path / "d" / TIER_KEY_FILE).exists()
    with RemoteStore(redis_url, FP, BLOCK, secret=SECRET) as r, disk(tmp_path / "d") as d:
        assert r.get(meta(0)) == payload(0) and d.get(meta(0)) == payload(0)


@as_root
def test_a_secret_file_owned_by_another_user_is_refused(tmp_path: Any) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET_TEXT)
    os.chmod(path, 0o600)
    os.chown(path, *nobody())
    with pytest.raises(UnsafePathError, match="owned by uid"):
        load_tier_secret(str(path))


# ====================================================================== 2. weights, not paths


def test_new_weights_at_the_same_path_get_no_tier_hits(tmp_path: Any) -> None:
    """The first engine fills a disk tier; other weights are saved at the same path; the second
    engine (same path, same directory, same hash key) serves nothing from the disk and its output
    is transformers' on the new weights."""
    pytest.importorskip("transformers")
    from tiny_llama import save_tiny_llama

    path = str(tmp_path / "model")
    save_tiny_llama(path, 512, seed=1)
    args: Dict[str, Any] = dict(disk_cache_dir=str(tmp_path / "kv"), disk_cache_memory="64MiB")
    prompts = _prompts(3)
    first, s1, _ = _engine(path, prompts + _prompts(4), **args)
    assert s1.tier_bytes_written["disk"] > 0
    # The same weights again do hit (the check below is not vacuous).
    _, s_same, _ = _engine(path, prompts, **args)
    assert s_same.prefix_hits_by_tier["disk"] > 0
    save_tiny_llama(path, 512, seed=2)
    expected = _reference(path, prompts)
    assert expected != first[:6]
    again, s2, stores = _engine(path, prompts, **args)
    assert again == expected
    assert s2.prefix_hits_by_tier.get("disk", 0) == 0 and stores["disk"].hits == 0


def test_weights_digest_is_cached_and_follows_content(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    # The package exports the function `fingerprint`, which shadows the module's attribute.
    fpmod = importlib.import_module("pagedkv.tiers.fingerprint")

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"\x01" * 4096)
    (model / "tokenizer.json").write_text('{"vocab": 1}')
    (model / "chat_template.jinja").write_text("{{ x }}")
    cache = str(tmp_path / "cache.json")
    reads: List[str] = []
    real = fpmod._file_digest

    def counting(path: str) -> Any:
        reads.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(fpmod, "_file_digest", counting)
    first = weights_digest(str(model), cache_file=cache)
    assert first is not None and sorted(reads) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert os.stat(cache).st_mode & 0o777 == 0o600
    reads.clear()
    assert weights_digest(str(model), cache_file=cache) == first and reads == []  # a restart
    # Same path and size, other bytes: read again, another digest. Even with the old mtime back.
    st = os.stat(model / "model.safetensors")
    (model / "model.safetensors").write_bytes(b"\x02" * 4096)
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    second = weights_digest(str(model), cache_file=cache)
    assert reads == ["model.safetensors"] and second != first
    # The tokenizer changes ids: another digest; a chat template does not.
    (model / "chat_template.jinja").write_text("{{ y }}")
    assert weights_digest(str(model), cache_file=cache) == second
    (model / "tokenizer.json").write_text('{"vocab": 2}')
    assert weights_digest(str(model), cache_file=cache) != second
    # One checkpoint at two paths is one identity; no weights: the name, as before.
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in model.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert model_identity(str(copy), cache_file=cache) == model_identity(str(model), cache_file=cache)
    assert model_identity("org/some-model", cache_file=cache) == "org/some-model"


@as_root
def test_a_digest_cache_another_user_could_write_is_not_trusted(tmp_path: Any) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\x01" * 64)
    cache = tmp_path / "cache.json"
    honest = weights_digest(str(model), cache_file=str(cache))
    # A cache (owned by another user) claiming other digests for these very files.
    import json

    data = json.loads(cache.read_text())
    for entry in data["entries"].values():
        entry["digest"] = "00" * 16
    cache.write_text(json.dumps(data))
    os.chown(cache, *nobody())
    assert weights_digest(str(model), cache_file=str(cache)) == honest
    os.chown(cache, os.geteuid(), os.getegid())
    os.chmod(cache, 0o666)
    assert weights_digest(str(model), cache_file=str(cache)) == honest


# ====================================================================== 3. owned cache directories

#: Each file of a cache directory, and the call that opens it.
_OPENERS = {
    LOCK_FILE: lambda root: disk(root).close(),
    TIER_KEY_FILE: lambda root: disk(root, secret=None).close(),
    HASH_KEY_FILE: load_or_create_hash_key,
}


@as_root
def test_a_directory_or_files_of_another_user_are_refused(tmp_path: Any) -> None:
    uid, gid = nobody()
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, uid, gid)
    with pytest.raises(UnsafePathError, match="owned by uid") as info:
        disk(theirs)
    assert info.value.path == str(theirs)
    with pytest.raises(UnsafePathError, match="owned by uid"):
        load_or_create_hash_key(theirs)
    assert os.stat(theirs).st_uid == uid and os.listdir(theirs) == []  # untouched
    # Our directory with a lock, a key or a segment of theirs.
    for name, opener in _OPENERS.items():
        root = tmp_path / f"ours-{name}"
        disk(root, secret=None).close()
        load_or_create_hash_key(root)
        os.chown(root / name, uid, gid)
        with pytest.raises(UnsafePathError, match="owned by uid"):
            opener(root)
    root = tmp_path / "seg"
    with disk(root) as s:
        s.put(meta(0), payload(0))
    (seg,) = [p for p in root.iterdir() if p.suffix == ".pkv"]
    os.chown(seg, uid, gid)
    with pytest.raises(UnsafePathError, match="owned by uid"):
        disk(root)


def test_a_directory_writable_by_others_or_a_link_is_refused(tmp_path: Any) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafePathError, match="0777"):
        disk(shared)
    assert os.stat(shared).st_mode & 0o777 == 0o777 and os.listdir(shared) == []
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        disk(link)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        load_or_create_hash_key(link)
    # A file where the directory should be is a configuration error of its own kind.
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidConfigError, match="not a directory"):
        disk(tmp_path / "file")


def test_symlinked_lock_key_or_segment_is_refused_and_nothing_is_written_through(tmp_path: Any) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"precious")
    for name, opener in _OPENERS.items():
        root = tmp_path / f"sym-{name}"
        root.mkdir(mode=0o700)
        (root / name).symlink_to(elsewhere)
        with pytest.raises(UnsafePathError, match="symbolic link"):
            opener(root)
    root = tmp_path / "symseg"
    with disk(root) as s:
        s.put(meta(0), payload(0))
    (seg,) = [p for p in root.iterdir() if p.suffix == ".pkv"]
    seg.unlink()
    seg.symlink_to(elsewhere)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        disk(root)
    assert elsewhere.read_bytes() == b"precious"


def test_hard_linked_segment_or_key_is_refused(tmp_path: Any) -> None:
    root = tmp_path / "hard"
    with disk(root, secret=None) as s:
        s.put(meta(0), payload(0))
    (seg,) = [p for p in root.iterdir() if p.suffix == ".pkv"]
    outside = tmp_path / "outside.pkv"
    os.link(seg, outside)
    before = outside.read_bytes()
    with pytest.raises(UnsafePathError, match="2 hard links"):
        with disk(root, secret=None) as s:
            s.put(meta(1), payload(1))  # would land in `outside` through the link
    assert outside.read_bytes() == before
    outside.unlink()
    load_or_create_hash_key(root)
    for name, opener in _OPENERS.items():
        other = tmp_path / f"copy-{name}"
        os.link(root / name, other)
        with pytest.raises(UnsafePathError, match="hard links"):
            opener(root)
        other.unlink()
    disk(root, secret=None).close()


def test_a_full_disk_at_start_is_a_typed_error(tmp_path: Any) -> None:
    """A file size limit of 0 makes every write fail as a full disk would (EFBIG for ENOSPC):
    the first start, which writes its key, raises CacheIOError, not a bare OSError."""
    script = textwrap.dedent(f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
        from pagedkv.errors import CacheIOError
        from pagedkv.tiers import DiskStore, load_or_create_hash_key, fingerprint
        fp = fingerprint("m", "bf16", 16, 1, 1, 8)
        for call in (lambda: load_or_create_hash_key(sys.argv[1] + "/a"),
                     lambda: DiskStore(sys.argv[1] + "/b", 1 << 20, fp, {BLOCK})):
            try:
                call()
            except CacheIOError as exc:
                print(type(exc).__name__, exc.errno, isinstance(exc, OSError))
            else:
                print("no error")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["CacheIOError 27 True"] * 2
    # Nothing half-written is left to be read as a key later.
    assert not (tmp_path / "a" / HASH_KEY_FILE).exists()


def test_an_in_use_directory_is_still_a_config_error(tmp_path: Any) -> None:
    with disk(tmp_path / "d"):
        with pytest.raises(InvalidConfigError, match="in use"):
            disk(tmp_path / "d")


# ====================================================================== 4. released without shutdown


def test_a_dropped_store_releases_its_directory(tmp_path: Any) -> None:
    s = disk(tmp_path / "d")
    s.put(meta(0), payload(0))
    del s
    gc.collect()
    with disk(tmp_path / "d") as again:
        assert again.get(meta(0)) == payload(0)


def test_a_deleted_llm_releases_its_disk_tier(model_dir: str, tmp_path: Any) -> None:
    import pagedkv

    args: Dict[str, Any] = dict(device="cpu", num_blocks=24, block_size=16, progress=False,
                                host_cache_memory="64KiB", disk_cache_dir=str(tmp_path / "kv"),
                                disk_cache_memory="8MiB")
    sp = pagedkv.SamplingParams(temperature=0.0, max_tokens=2)
    llm = pagedkv.LLM(model_dir, **args)
    llm.generate([{"prompt_token_ids": list(range(3, 40))}], sp, use_tqdm=False)
    del llm
    gc.collect()
    with pagedkv.LLM(model_dir, **args) as second:
        second.generate([{"prompt_token_ids": list(range(3, 40))}], sp, use_tqdm=False)
    # __exit__ released it too.
    pagedkv.LLM(model_dir, **args).shutdown()


# ====================================================================== 5. evictions reported


def test_disk_store_reports_the_hashes_it_evicted(tmp_path: Any) -> None:
    h = [meta(i).block_hash for i in range(6)]
    with disk(tmp_path / "d", slots=2) as s:
        assert s.take_removed() == []
        for i in range(3):
            assert s.put(meta(i), payload(i))
        assert s.take_removed() == [h[0]] and s.take_removed() == []
        assert s.put(meta(3), payload(3))  # evicts 1
        assert s.put(meta(1), payload(1))  # evicts 2; 1 is present again
        assert s.take_removed() == [h[2]]
        # An explicit remove is the caller's own; a record dropped as bad bytes is reported.
        assert s.remove(h[3])
        assert s.take_removed() == []
        (seg,) = [p for p in (tmp_path / "d").iterdir() if p.suffix == ".pkv"]
        data = bytearray(seg.read_bytes())
        slot = next(i for i in range(2) if data[i * s.slot_bytes + 24:i * s.slot_bytes + 40]
                    == h[1].to_bytes(16, "little"))
        data[slot * s.slot_bytes + 500] ^= 1
        seg.write_bytes(bytes(data))
        assert s.get(meta(1)) is None and s.stats().corrupt == 1
        assert s.take_removed() == [h[1]]
        assert s.stats().evictions == 3


def test_reasons_have_their_own_counter() -> None:
    assert Reason.UNAUTHENTICATED.counter == "unauthenticated"
    assert Reason.CHECKSUM.counter == "corrupt"
