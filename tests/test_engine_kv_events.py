"""An engine with kv_events_endpoint publishes its cache's real events, one batch per step.

A tiny Llama on the CPU; a real SUB socket reads what the engine sent. The hashes published are
the ones pagedkv.hash_prompt computes for the prompt under the engine's hash_seed, so a router
holding the key finds them.
"""

from __future__ import annotations

import time
from typing import List

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
zmq = pytest.importorskip("zmq")

from pagedkv import LLM, SamplingParams, hash_prompt  # noqa: E402
from pagedkv.errors import ConfigArgumentError  # noqa: E402
from pagedkv.events import BlockRemoved, BlockStored, decode_batch, hash_from_wire  # noqa: E402

from polling import wait_for  # noqa: E402
from tiny_hybrid import save_hybrid  # noqa: E402
from tiny_llama import save_tiny_llama  # noqa: E402

KEY = 1234


def test_engine_publishes_stored_blocks_with_the_documented_hashes(tmp_path) -> None:
    model = save_tiny_llama(str(tmp_path / "tiny"))
    llm = LLM(model, device="cpu", num_blocks=64, block_size=4, progress=False, hash_seed=KEY,
              kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*",
              kv_events_topic="replica-0")
    engine = llm.llm_engine
    pub = engine.kv_events.publisher
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"replica-0")
    sub.connect(pub.endpoint)
    time.sleep(0.3)
    try:
        prompt = list(range(10, 30))  # 5 full blocks
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        # The publisher's thread sends what the engine queued: wait until all of it is out.
        wait_for(lambda: pub.sent_batches == pub.queued_batches, 10)
        frames: List[list] = []
        while sub.poll(2000):
            frames.append(sub.recv_multipart())
            if len(frames) >= pub.sent_batches:
                break
        assert frames, "no batch published"
        seqs = [int.from_bytes(f[1], "big") for f in frames]
        assert seqs == list(range(len(frames)))
        assert all(f[0] == b"replica-0" for f in frames)
        stored = [e for f in frames for e in decode_batch(f[2]).events
                  if isinstance(e, BlockStored)]
        hashes = [hash_from_wire(h) for e in stored for h in e.block_hashes]
        assert hashes[:5] == hash_prompt(prompt, 4, KEY)
        assert stored[0].parent_block_hash is None and stored[0].medium == "GPU"
        assert stored[0].token_ids[:8] == prompt[:8]
        assert engine.kv_events.ring_dropped == 0
    finally:
        sub.close()
        llm.shutdown()
    assert pub.dropped_batches == 0


@pytest.mark.parametrize("kwargs, field", [
    (dict(hash_seed=-1), "hash_seed"),
    (dict(hash_seed=2**64), "hash_seed"),
    (dict(kv_events_endpoint="localhost:5557"), "kv_events_endpoint"),
    (dict(kv_events_replay_endpoint="tcp://*:5558"), "kv_events_replay_endpoint"),
    (dict(kv_events_endpoint="tcp://*:1", kv_events_topic=5), "kv_events_topic"),
])
def test_bad_event_settings_are_refused(kwargs: dict, field: str) -> None:
    from pagedkv.engine.config import EngineConfig

    with pytest.raises(ConfigArgumentError) as err:
        EngineConfig(**kwargs)
    assert err.value.fields["field"] == field


def test_hybrid_engine_events_carry_groups_balance_and_route(tmp_path) -> None:
    """A model with sliding and full layers publishes every group's blocks (group_idx and the
    group's spec), its released sliding blocks' evictions as removals of their group; the stream
    replayed per group equals the manager's cache; a router fed the stream over its own
    subscriber sends a prompt sharing a cached prefix to this engine."""
    from pagedkv.router.app import ReplicaSpec, Router

    # Three sliding layers (window 8) and one full layer: several KV cache groups.
    model = save_hybrid("gemma3_text", str(tmp_path / "gemma3"))
    llm = LLM(model, device="cpu", num_blocks=48, block_size=4, max_num_seqs=2,
              max_num_batched_tokens=16, progress=False, hash_seed=KEY,
              kv_events_bind="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*")
    engine = llm.llm_engine
    manager = engine.manager
    assert manager.num_groups > 1
    kinds = [g.kind for g in manager.groups]
    pub = engine.kv_events.publisher
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    # Replica 0 publishes nothing; replica 1 is this engine, followed over a real subscriber.
    router = Router([ReplicaSpec("http://127.0.0.1:9"),
                     ReplicaSpec("http://127.0.0.1:9", pub.endpoint, pub.replay_endpoint)],
                    block_size=4, hash_seed=KEY)
    router.start()
    time.sleep(0.3)
    try:
        shared = list(range(10, 26))  # four blocks every later prompt starts with
        prompts = [shared + [40 + 7 * k + t for t in range(12 + 4 * (k % 2))] for k in range(8)]
        for p in prompts:
            llm.generate([p], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        # The publisher's thread sends what the engine queued: wait until all of it is out
        # (counting frames against sent_batches alone misses batches still queued).
        wait_for(lambda: pub.sent_batches == pub.queued_batches, 10)
        frames: List[list] = []
        while len(frames) < pub.sent_batches and sub.poll(2000):
            frames.append(sub.recv_multipart())
        assert len(frames) == pub.sent_batches
        events = [e for f in frames for e in decode_batch(f[2]).events]
        held: set = set()
        removed_groups = set()
        for e in events:
            if isinstance(e, BlockStored):
                g = e.group_idx
                assert g is not None and 0 <= g < len(kinds)
                window = manager.groups[g].size if kinds[g] == "sliding" else None
                assert (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == (
                    {"full": "full_attention", "sliding": "sliding_window"}[kinds[g]], window)
                for h in e.block_hashes:
                    assert (g, hash_from_wire(h)) not in held
                    held.add((g, hash_from_wire(h)))
            elif isinstance(e, BlockRemoved):
                assert e.group_idx is not None
                removed_groups.add(e.group_idx)
                for h in e.block_hashes:
                    held.remove((e.group_idx, hash_from_wire(h)))
            else:
                held.clear()
        assert sorted(held) == manager.cached_block_keys()
        assert any(kinds[g] == "sliding" for g in removed_groups), "no sliding block evicted"
        assert {g for g, _ in held} == set(range(len(kinds)))
        manager.check_invariants()
        # The last prompt's chain is cached in group 0; the router matches its shared prefix
        # on replica 1 only, and places a new prompt sharing it there.
        hashes = hash_prompt(prompts[-1], 4, KEY)
        assert {(0, h) for h in hashes[:4]} <= held
        wait_for(lambda: router.index.match(hashes[:4]).get(1, 0) == 4)
        assert router.index.full_groups(1) == {g for g, k in enumerate(kinds) if k == "full"}
        assert router.choose(shared + [99, 98, 97, 96, 95], None)[0] == 1
        assert router.stats.matched_blocks == 4
        assert engine.kv_events.ring_dropped == 0
    finally:
        router.close()
        sub.close()
        llm.shutdown()
    assert pub.dropped_batches == 0
