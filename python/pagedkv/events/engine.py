"""The engine's end of KV events: drain the block manager once per step, publish one batch.

Owns :class:`StepEventPublisher`, which the engine core (:mod:`pagedkv.engine.core`) builds when
``kv_events_endpoint`` or ``kv_events_bind`` is set (:func:`kv_events_enabled`,
:meth:`StepEventPublisher.from_config`). Invariants: the core's ring is drained exactly once per
engine step (from the engine thread, the manager's only caller), and its events and the lower
tiers' (added to :attr:`StepEventPublisher.sink` from Python) leave as one :class:`KVEventBatch` per step that has
any, in the order they were recorded; a step never waits on the network (the publisher's queue is
bounded and drops, counting); ring overflow in the core is reported by
:attr:`StepEventPublisher.ring_dropped`. Events carry the salted, keyed hashes only: neither the
hash key nor any salt is ever published. A manager with several KV cache groups publishes each
stored / removed event with vLLM's ``group_idx`` (and a stored one with its group's
``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window``); a one-group manager's events leave
those unset, byte for byte as before.
"""

from __future__ import annotations

from typing import Any, Optional

from .publisher import EventSink, ZmqEventPublisher

__all__ = ["StepEventPublisher", "KV_EVENT_CAPACITY", "kv_events_enabled"]

#: Events the core's ring holds between two drains (one step's worth; overflow is counted).
KV_EVENT_CAPACITY = 1 << 16


def kv_events_enabled(config: Any) -> bool:
    """Whether an :class:`~pagedkv.engine.config.EngineConfig` asks for KV events."""
    return (getattr(config, "kv_events_endpoint", None) is not None
            or getattr(config, "kv_events_bind", None) is not None)


class StepEventPublisher:
    """Drains ``manager`` and publishes its events, one batch per :meth:`flush`.

    Args:
        manager: A block manager built with ``kv_event_capacity > 0`` (its
            ``drain_kv_events()`` returns the core's event tuples).
        endpoint, replay_endpoint, topic, bind: As for :class:`ZmqEventPublisher` (``bind``
            always binds, e.g. ``tcp://127.0.0.1:5557`` listens on loopback only).
    """

    def __init__(self, manager: Any, endpoint: Optional[str],
                 replay_endpoint: Optional[str] = None, topic: str = "", *,
                 bind: Optional[str] = None) -> None:
        self._drain = manager.drain_kv_events
        self._manager = manager
        groups = list(getattr(manager, "groups", None) or ())
        #: Where a lower tier (disk, Redis) adds its events; they leave with the next step's.
        #: With several KV cache groups its core events name their group and its spec.
        self.sink = EventSink(groups if len(groups) > 1 else None)
        self.publisher = ZmqEventPublisher(endpoint, replay_endpoint, topic=topic, bind=bind)
        self._dropped_seen = 0

    @classmethod
    def from_config(cls, manager: Any, config: Any) -> Optional["StepEventPublisher"]:
        """The publisher an :class:`~pagedkv.engine.config.EngineConfig` asks for (its
        ``kv_events_*`` fields), or None when it asks for none."""
        if not kv_events_enabled(config):
            return None
        return cls(manager, config.kv_events_endpoint, config.kv_events_replay_endpoint,
                   config.kv_events_topic, bind=getattr(config, "kv_events_bind", None))

    @property
    def ring_dropped(self) -> int:
        """Events the core's ring overwrote before a drain (``kv_events_dropped``)."""
        return int(getattr(self._manager, "kv_events_dropped", 0))

    def flush(self) -> None:
        """Drains the core's events into the sink and publishes the sink's batch (if any).

        When the ring overflowed since the last drain, part of the history is lost: the batch then
        starts with ``AllBlocksCleared``, so a consumer forgets what it knew of this engine rather
        than keep entries whose removal it missed (it under-counts until blocks are stored again).
        """
        events = self._drain()
        dropped = self.ring_dropped
        if dropped != self._dropped_seen:
            self._dropped_seen = dropped
            self.sink.add_cleared()
        self.sink.add_core(events)
        self.publisher.publish_events(self.sink.take())

    def close(self) -> None:
        """Publishes what is pending and closes the sockets. Idempotent."""
        try:
            self.flush()
        finally:
            self.publisher.close()
