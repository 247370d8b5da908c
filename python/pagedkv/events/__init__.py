"""KV-cache events on the wire: what blocks a replica caches, published as vLLM publishes them.

Owns the wire schema (:mod:`.schema`: vLLM 0.33's ``KVEventBatch`` / ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` as msgpack, hashes as 16 big-endian bytes), the publisher
(:mod:`.publisher`: :class:`EventSink`, :class:`ZmqEventPublisher`) and a consumer
(:mod:`.subscriber`: :class:`EventSubscriber`). ``docs/kv-events.md`` specifies the wire format
and what a reader can learn from it; with several KV cache groups every stored / removed event
names its group (vLLM's ``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``),
and a one-group engine's events leave those unset. Needs ``msgspec`` and ``pyzmq`` (``pagedkv[serve]``).
"""

from __future__ import annotations

from .publisher import EventSink, ZmqEventPublisher
from .schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    hash_from_wire,
    hash_to_wire,
)
from .subscriber import EventSubscriber, SequenceTracker

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "EventSink",
    "ZmqEventPublisher",
    "EventSubscriber",
    "SequenceTracker",
    "decode_batch",
    "encode_batch",
    "hash_from_wire",
    "hash_to_wire",
]
