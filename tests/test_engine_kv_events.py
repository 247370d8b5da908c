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
from pagedkv.events import BlockStored, decode_batch, hash_from_wire  # noqa: E402

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
