"""The tiers of the prefix cache (host, disk, Redis) on models whose layers form several KV cache
groups.

Tiny random hybrid models (Gemma 3 text and gpt-oss: sliding beside full layers; Llama 4 text:
chunked beside full; fp32, seeded, saved with ``save_pretrained`` and loaded through the engine's
loader) run a trace whose prompts do not fit the device pool together: each prompt is served
alone, twice over, so the second round finds its prefixes only in the host tier (every group's
blocks, keyed by chain hash and group). Greedy token ids must equal a run without the host tier
and transformers' own ``generate``; the host tier must serve hits (``prefix_hits_by_tier``), the
manager keep its invariants, and no host block stay referenced once the engine is idle. A second
trace shares the host pool between the tier and swap preemption.

Below the host: the same trace with a host tier of forty pages (two prompts' blocks) over a disk tier (a temp dir) or
a real ``redis-server`` on loopback, so prefixes leave the device *and* the host and come back
from the disk or the server (each group's blocks stored under its key and group): outputs equal
the run without tiers and transformers', the disk/remote hit counters count, no record is refused
as damaged or foreign, the manager keeps its invariants and no host block stays referenced. A
record of group ``g`` is never served as group ``g'`` (moved between keys in the shared store,
or asked for under another group), and the cache's group keys are the manager's.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pagedkv import LLM, BlockManager, KVCacheGroup, SamplingParams  # noqa: E402
from pagedkv.engine.builder import sequence_blocks  # noqa: E402
from pagedkv.layer_groups import group_layers, layer_kinds  # noqa: E402
from pagedkv.tiers import BlockMeta, DiskStore, Reason, RemoteStore  # noqa: E402
from pagedkv.tiers.cache import group_key  # noqa: E402
from pagedkv.tiers.record import decode_checked, encode  # noqa: E402
from pagedkv.tiers.secret import TierSecret  # noqa: E402

from tiny_hybrid import (  # noqa: E402
    MAX_LEN, VOCAB, greedy_reference, hybrid_config, save_hybrid)
from tier_waiting import Waiting  # noqa: E402

BLOCK = 4
NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=["gemma3_text", "gpt_oss", "llama4_text"])
def model_dir(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Tuple[str, str]:
    return request.param, save_hybrid(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def dense(model_dir: Tuple[str, str]) -> Any:
    """The same checkpoint loaded by transformers alone: the reference."""
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir[1],
                                                             dtype=torch.float32).eval()


def _reference(dense: Any, prompt: List[int], max_new_tokens: int = NEW) -> List[int]:
    return greedy_reference(dense, prompt, max_new_tokens)


def _prompts(seed: int, lengths: List[int]) -> List[List[int]]:
    g = np.random.default_rng(seed)
    return [g.integers(0, VOCAB, n).tolist() for n in lengths]


#: Six prompts of 10 full blocks and a bit; with a shared head, so a second round can also hit
#: a prefix another prompt left on the device.
PROMPTS = [_prompts(7, [12])[0] + p for p in _prompts(8, [30, 31, 29, 33, 30, 32])]


def _page_bytes(kind: str) -> int:
    grouping = group_layers(layer_kinds(hybrid_config(kind)), MAX_LEN, BLOCK)
    return int(grouping.slots) * 2 * BLOCK * 2 * 16 * 4  # slots x K,V x tokens x heads x dims x 4


def _idle_host_pool(llm: LLM) -> None:
    """Nothing holds a host block once every request finished: each is free or host-cached."""
    m = llm.llm_engine.manager
    m.check_invariants()
    assert m.num_seqs == 0
    assert all(m.host_block_refcount(h) == 0 for h in range(m.num_host_blocks))
    s = m.stats()
    assert m.num_free_host_blocks + s.host_cached_blocks == m.num_host_blocks


def _run(model_dir: Tuple[str, str], rounds: int = 2, stores: Any = None,
         **kw: Any) -> Tuple[List[List[int]], Any]:
    """Each prompt alone, ``rounds`` times, in a pool that holds one of them and a little more
    (a chunked group's finished prompt keeps few blocks: a few such prompts fit). ``stores``,
    if given, is a dict filled with the lower tiers' own counters by name."""
    grouping = group_layers(layer_kinds(hybrid_config(model_dir[0])), MAX_LEN, BLOCK)
    peak = sequence_blocks(grouping.groups, max(map(len, PROMPTS)) + NEW, BLOCK, 64)
    llm = LLM(model_dir[1], device="cpu", progress=False, block_size=BLOCK,
              num_blocks=peak + peak // 4, max_num_seqs=2, max_num_batched_tokens=64, **kw)
    try:
        outs = []
        for _ in range(rounds):
            for p in PROMPTS:
                got = llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)
                outs.append(list(got[0].outputs[0].token_ids))
        if "host_cache_memory" in kw:
            _idle_host_pool(llm)
        else:
            llm.llm_engine.manager.check_invariants()
        if stores is not None:
            tiers = llm.llm_engine.tiers
            stores.update({st.name: st.stats() for st in (tiers.stores if tiers else [])})
        return outs, llm.stats()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("write_through", [False, True])
def test_host_tier_serves_every_groups_blocks_with_the_same_outputs(
        model_dir: Tuple[str, str], dense: Any, write_through: bool) -> None:
    kind, _ = model_dir
    base, base_stats = _run(model_dir)
    assert base_stats.prefix_hits_by_tier == {"gpu": base_stats.prefix_hit_tokens}
    outs, stats = _run(model_dir, host_cache_memory=256 * _page_bytes(kind),
                       host_cache_write_through=write_through)
    assert outs == base
    assert outs[:len(PROMPTS)] == [_reference(dense, p) for p in PROMPTS]
    hits = stats.prefix_hits_by_tier
    # Round two: the pool kept a few prompts at most; the others' prefixes come from the host.
    assert hits["host"] >= 2 * 10 * BLOCK, hits
    assert sum(hits.values()) == stats.prefix_hit_tokens > base_stats.prefix_hit_tokens
    # Whole pages move, of whichever group; a hit may load fewer blocks than it adds (group 0
    # still on the device, another group's few blocks loaded) or more (several groups').
    page = _page_bytes(kind)
    assert stats.tier_bytes_read["host"] > 0 and stats.tier_bytes_read["host"] % page == 0
    assert stats.tier_bytes_written["host"] > 0 and stats.tier_bytes_written["host"] % page == 0


def test_host_tier_and_swap_share_the_host_pool(model_dir: Tuple[str, str], dense: Any) -> None:
    """Requests growing together in a small pool are swapped out and back through the same host
    pool the tier keeps prefixes in (swapped blocks win); a later round hits the tier; every
    token is transformers'."""
    kind, _ = model_dir
    prompts = _prompts(3, [20, 17, 23])
    params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    grouping = group_layers(layer_kinds(hybrid_config(kind)), MAX_LEN, BLOCK)
    peak = sequence_blocks(grouping.groups, 23 + 28, BLOCK, 16)
    page = _page_bytes(kind)
    llm = LLM(model_dir[1], device="cpu", progress=False, block_size=BLOCK, num_blocks=peak + 2,
              max_num_seqs=4, max_num_batched_tokens=16, swap_space=64 * page + page // 2,
              preemption_mode="swap", host_cache_memory=64 * page)
    try:
        want = [_reference(dense, p, 28) for p in prompts]
        for _ in range(2):
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == want
        stats = llm.stats()
        assert stats.num_preemptions_swap > 0
        core = llm.llm_engine.manager.stats()
        assert core.swapped_out_blocks > 0 and core.swapped_in_blocks > 0
        assert stats.prefix_hits_by_tier.get("host", 0) > 0
        _idle_host_pool(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def baseline(model_dir: Tuple[str, str]) -> List[List[int]]:
    outs, stats = _run(model_dir)
    assert stats.prefix_hits_by_tier == {"gpu": stats.prefix_hit_tokens}
    return outs


@pytest.mark.parametrize("tier", ["disk", "remote"])
def test_lower_tiers_serve_every_groups_blocks_with_the_same_outputs(
        model_dir: Tuple[str, str], dense: Any, baseline: List[List[int]], tier: str,
        tmp_path: Any, request: Any, monkeypatch: Any) -> None:
    """A host tier of forty pages cannot keep six prompts' blocks (but takes what one admission
    evicts): they are demoted (with their groups) to the disk or the server, and round two
    fetches every group's blocks its boundary needs from there."""
    kind, _ = model_dir
    page = _page_bytes(kind)
    kw: Dict[str, Any]
    if tier == "disk":
        kw = dict(disk_cache_dir=str(tmp_path / "kv"), disk_cache_memory="64MiB")
    else:
        server = request.getfixturevalue("redis_server")
        monkeypatch.setenv("PAGEDKV_TIER_SECRET", "a fleet secret of the hybrid test engines")
        kw = dict(remote_cache_url=server.url, remote_cache_timeout_s=2.0, hash_seed=1234)
    stores: Dict[str, Any] = {}
    # A prefill rate this slow makes every load pay (the host's and the store's: the measured
    # rates would make the choice depend on this machine's load).
    outs, stats = _run(model_dir, stores=stores, host_cache_memory=40 * page,
                       prefill_tokens_per_s=1.0, **kw)
    assert outs == baseline
    assert outs[:len(PROMPTS)] == [_reference(dense, p) for p in PROMPTS]
    hits = stats.prefix_hits_by_tier
    # Round two: prefixes that left the device and the host come from below (how many depends
    # on the family: a chunked group's finished prompt keeps few blocks, so the host keeps more).
    assert hits[tier] >= 10 * BLOCK, hits
    assert sum(hits.values()) == stats.prefix_hit_tokens
    assert stats.tier_bytes_read[tier] > 0 and stats.tier_bytes_read[tier] % page == 0
    assert stats.tier_bytes_written[tier] > 0 and stats.tier_bytes_written[tier] % page == 0
    st = stores[tier]
    assert st.hits > 0
    assert st.corrupt == st.foreign == st.mismatched == st.unauthenticated == st.errors == 0


def test_group_keys_are_the_managers() -> None:
    """Blocks committed under their groups are found per group and demoted with their group's
    key, which is :func:`group_key` of the chain hash (what the stores are keyed by)."""
    bs = 4
    m = BlockManager(16, bs, watermark_blocks=0, num_host_blocks=4, host_cache=True,
                     groups=[KVCacheGroup.full(), KVCacheGroup.sliding(8)])
    tokens = list(range(1, 4 * bs + 2))
    hashes, salt, present = m.lookup_tiers_groups(tokens)
    assert len(hashes) == 4 and present == [[False] * 4, [False] * 4]
    slots = m.reserve_host_blocks(3)
    # Group 0's block 0 and group 1's blocks 1 and 2 (chain hashes; the manager mixes the group).
    blocks = [0, 1, 2]
    groups = [0, 1, 1]
    flat = [t for i in blocks for t in tokens[i * bs:(i + 1) * bs]]
    parents = [None, hashes[0], hashes[1]]
    assert m.commit_host_blocks(slots, [hashes[i] for i in blocks], parents, salt, flat, True,
                                groups=groups) == 3
    _, _, present = m.lookup_tiers_groups(tokens)
    assert present == [[True, False, False, False], [False, True, True, False]]
    assert m.stats().host_cached_blocks == 3
    m.check_invariants()
    # Taking every host block demotes the three, oldest first, named by their groups' keys.
    again = m.reserve_host_blocks(4)
    demoted = m.take_demotions_by_group()
    assert [(d[1], d[2], d[5]) for d in demoted] == [
        (hashes[0], None, 0),
        (group_key(hashes[1], 1), group_key(hashes[0], 1), 1),
        (group_key(hashes[2], 1), group_key(hashes[1], 1), 1)]
    assert group_key(hashes[1], 1) != hashes[1] and group_key(group_key(hashes[1], 1), 1) == hashes[1]
    m.commit_host_blocks(again, [1, 2, 3, 4], [None] * 4, salt, [0] * (4 * bs), False)
    m.check_invariants()


def _meta(group: int, h: int = 0xABC, tokens: Any = (5, 6, 7, 8)) -> BlockMeta:
    return BlockMeta(block_hash=group_key(h, group), parent_hash=None, salt_digest=9,
                     token_ids=np.asarray(tokens, dtype=np.uint32), group=group)


def _foreign_group_checks(store: Any, put_raw: Any) -> None:
    """A record of group 1 is never served as group 2: asked under its own key with group 2
    named, or moved (as an attacker sharing the store could) under group 2's key."""
    data = np.arange(store.block_bytes, dtype=np.uint8)
    out = np.zeros(store.block_bytes, dtype=np.uint8)
    assert store.put(_meta(1), data)
    assert store.get_into(_meta(1), out) and np.array_equal(out, data)
    asked_as_2 = BlockMeta(block_hash=group_key(0xABC, 1), parent_hash=None, salt_digest=9,
                           token_ids=np.asarray((5, 6, 7, 8), dtype=np.uint32), group=2)
    before = store.stats()
    assert not store.get_into(asked_as_2, out)
    assert store.stats().mismatched == before.mismatched + 1
    # The record copied verbatim under group 2's key: its hash and group are group 1's.
    put_raw(group_key(0xABC, 2))
    assert not store.get_into(_meta(2), out)
    assert store.stats().mismatched == before.mismatched + 2
    # Still served as what it is.
    assert store.get_into(_meta(1), out) and np.array_equal(out, data)


def test_a_record_of_one_group_is_never_another_groups() -> None:
    secret = TierSecret(b"k" * 32)
    fp = b"f" * 16
    data = np.arange(64, dtype=np.uint8)
    rec = encode(fp, _meta(1), data, secret=secret)
    common = dict(fingerprint=fp, token_ids=[5, 6, 7, 8], salt_digest=9, payload_len=64,
                  secret=secret)
    payload, reason = decode_checked(rec, block_hash=group_key(0xABC, 1), group=1, **common)
    assert reason is Reason.OK and bytes(payload) == data.tobytes()  # type: ignore[arg-type]
    assert decode_checked(rec, block_hash=group_key(0xABC, 1), group=0, **common)[1] \
        is Reason.GROUP_MISMATCH
    assert decode_checked(rec, block_hash=group_key(0xABC, 2), group=2, **common)[1] \
        is Reason.HASH_MISMATCH
    # The group word rewritten (checksum recomputed, as a forger would): the MAC refuses it.
    import xxhash
    forged = bytearray(rec)
    forged[76:80] = (2).to_bytes(4, "little")
    end = len(forged) - 48
    forged[end:end + 16] = xxhash.xxh3_128(bytes(forged[:end])).digest()
    assert decode_checked(bytes(forged), block_hash=group_key(0xABC, 1), group=2, **common)[1] \
        is Reason.UNAUTHENTICATED
    # A one-group record is what it was before the group was named: the word is 0.
    assert encode(fp, _meta(0), data, secret=secret)[76:80] == b"\0\0\0\0"


def test_disk_store_never_serves_a_group_as_another(tmp_path: Any) -> None:
    secret = TierSecret(b"s" * 32)
    store = DiskStore(tmp_path / "kv", 1 << 20, b"f" * 16, 256, max_tokens=4, secret=secret)
    try:
        def put_raw(key: int) -> None:
            # The slot of group 1's record now indexed under group 2's key too.
            with store._lock:
                store._index[key] = store._index[group_key(0xABC, 1)]
        _foreign_group_checks(store, put_raw)
    finally:
        store.close()


def test_remote_store_never_serves_a_group_as_another(redis_url: str) -> None:
    import redis
    secret = TierSecret(b"r" * 32)
    store = RemoteStore(redis_url, b"f" * 16, 256, secret=secret)
    client = redis.Redis.from_url(redis_url)
    try:
        def put_raw(key: int) -> None:
            client.set(store.key(key), client.get(store.key(group_key(0xABC, 1))))
        _foreign_group_checks(store, put_raw)
    finally:
        client.close()
        store.close()


class _SlowDisk(DiskStore):
    """A disk store whose writes take a while (a busy disk, a far server)."""

    def put(self, meta: BlockMeta, data: Any) -> bool:
        time.sleep(0.05)
        return super().put(meta, data)


def test_demoted_blocks_go_down_with_their_group_and_come_back(tmp_path: Any) -> None:
    """Host blocks of two groups demoted through the tier cache land in the disk store under
    their groups' keys, with STORAGE events naming group and chain hash; a prompt probed while
    those writes are still under way is deferred until they land (the gate never waits for
    them: tests/test_tiers_fetch_defer.py), and its fetch reads back exactly the blocks
    its boundary needs (group 0's four, the sliding group's window), bytes intact; the admission
    hits that boundary."""
    from pagedkv.config import CacheSpec
    from pagedkv.events.publisher import EventSink
    from pagedkv.events.schema import BlockStored, hash_to_wire
    from pagedkv.kv_pool import KVPool
    from pagedkv.tiers import TierCache
    from pagedkv.tiers.host import SwapEngine

    bs = 4
    spec = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=bs)
    m = BlockManager(16, bs, watermark_blocks=0, num_host_blocks=8, host_cache=True,
                     groups=[KVCacheGroup.full(), KVCacheGroup.sliding(8)])
    swap = SwapEngine(KVPool(spec, 16, "cpu"), 8, pin_memory=False)
    store = _SlowDisk(tmp_path / "kv", 1 << 20, b"f" * 16, spec.bytes_per_block, max_tokens=bs,
                      secret=TierSecret(b"t" * 32))
    sink = EventSink()
    tiers = TierCache(m, swap, [store], block_size=bs, events=sink)
    try:
        tokens = list(range(1, 4 * bs + 2))
        hashes, salt, _ = m.lookup_tiers_groups(tokens)
        # Every group's block of every position, each page filled with its own value.
        which = [(g, i) for g in (0, 1) for i in range(4)]
        slots = m.reserve_host_blocks(len(which))
        raw = swap.host.raw
        for s, (g, i) in zip(slots, which):
            raw[s] = 10 * i + g + 1
        m.commit_host_blocks(slots, [hashes[i] for _, i in which],
                             [None if i == 0 else hashes[i - 1] for _, i in which], salt,
                             [t for _, i in which for t in tokens[i * bs:(i + 1) * bs]], True,
                             groups=[g for g, _ in which])
        # Taking every host block demotes all eight; after_schedule copies them out and hands
        # them to the store's (slow) writes; the slots go free again at once.
        again = m.reserve_host_blocks(8)
        tiers.after_schedule()
        m.commit_host_blocks(again, list(range(1, 9)), [None] * 8, salt, [0] * (8 * bs), False)
        assert m.lookup_tiers_groups(tokens)[2] == [[False] * 4, [False] * 4]
        raw.zero_()  # the host forgets: whatever is there after the fetch was read back
        assert store.stats().puts < 8  # still writing

        seq = Waiting(1, tokens)
        # The probe is deferred (never waited for) until the writes land, then fetches.
        assert not tiers.ready(seq)
        assert tiers.num_fetching == 1
        deadline = time.monotonic() + 30
        while not tiers.ready(seq):
            assert time.monotonic() < deadline
            tiers.wait()
        assert store.holds([group_key(hashes[i], g) for g, i in which]) == [True] * 8
        stored = [(e.group_idx, e.block_hashes[0]) for e in sink.take()
                  if isinstance(e, BlockStored) and e.medium == "STORAGE"]
        assert sorted(stored) == sorted((g, hash_to_wire(hashes[i])) for g, i in which)
        # Boundary 4 (position 16, window 8: from 9) needs the sliding group's blocks 2 and 3.
        present = m.lookup_tiers_groups(tokens)[2]
        assert present == [[True] * 4, [False, False, True, True]]
        assert tiers.stats.bytes_read["disk"] == 6 * spec.bytes_per_block
        # The pages read back are the ones written: each holds its (group, position) value.
        pages = {int(raw[s][0]) for s in range(8) if bool((raw[s] == raw[s][0]).all())}
        assert pages == {0} | {10 * i + 1 for i in range(4)} | {10 * i + 2 for i in (2, 3)}
        assert store.stats().hits == 6 and store.stats().mismatched == 0
        r = m.admit(1, tokens)
        assert r.cached_tokens == r.cached_tokens_host == 4 * bs
        tiers.admitted(seq, r)
        assert tiers.stats.fetched_tokens["disk"] == 4 * bs
        m.check_invariants()
    finally:
        tiers.close()
