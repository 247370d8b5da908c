"""Speculative decoding's Prometheus signals, with vLLM's ``spec_decode`` meanings.

Owns :class:`SpecDecodeCollector`, a ``prometheus_client`` collector reading an engine core's
cumulative speculative counters at scrape time:

==================================================================  =================================
``pagedkv_spec_decode_num_drafts_total``                            sequence-steps that carried drafts
``pagedkv_spec_decode_num_draft_tokens_total``                      draft tokens verified
``pagedkv_spec_decode_num_accepted_tokens_total``                   draft tokens accepted
``pagedkv_spec_decode_num_accepted_tokens_per_pos_total{position}`` accepted drafts at each position
``pagedkv_spec_decode_num_steps_skipped_total``                     steps the cost model sent undrafted
==================================================================  =================================

Invariants: reading changes nothing; the counters only grow (they are the core's lifetime counts,
not reset by :meth:`LLMEngine.reset_stats`). The values are plain ints the step thread increments,
so a scrape from another thread reads each one whole (a scrape between two increments of one step
may see one updated and not the other).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

__all__ = ["SpecDecodeCollector"]

#: (counter key in the core's ``spec_counts``, metric name, help).
_COUNTERS = (
    ("num_drafts", "pagedkv_spec_decode_num_drafts",
     "Sequence-steps that carried speculative draft tokens."),
    ("num_draft_tokens", "pagedkv_spec_decode_num_draft_tokens",
     "Speculative draft tokens verified by the target model."),
    ("num_accepted_tokens", "pagedkv_spec_decode_num_accepted_tokens",
     "Speculative draft tokens accepted."),
    ("num_steps_skipped", "pagedkv_spec_decode_num_steps_skipped",
     "Steps whose drafts the cost model dropped (verifying them would not pay)."),
)


class SpecDecodeCollector:
    """Collector of an :class:`~pagedkv.engine.core.EngineCore`'s speculative counters.

    Args:
        core: The engine core (``spec_counts``, ``spec_accepted_by_pos``).
        labels: Constant labels added to every sample.
    """

    def __init__(self, core: Any, *, labels: Optional[Dict[str, str]] = None) -> None:
        from ...metrics import _prometheus

        self._c = _prometheus()
        self.core = core
        self._names = sorted(labels or {})
        self._values = [str((labels or {})[k]) for k in self._names]

    def describe(self) -> List[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        c = self._c
        counts = dict(self.core.spec_counts)
        for key, name, doc in _COUNTERS:
            m = c.CounterMetricFamily(name, doc, labels=self._names)
            m.add_metric(self._values, float(counts.get(key, 0)))
            yield m
        m = c.CounterMetricFamily("pagedkv_spec_decode_num_accepted_tokens_per_pos",
                                  "Speculative draft tokens accepted, by position in the draft "
                                  "(0: the first draft token).",
                                  labels=self._names + ["position"])
        for pos, v in enumerate(list(self.core.spec_accepted_by_pos)):
            m.add_metric(self._values + [str(pos)], float(v))
        yield m
