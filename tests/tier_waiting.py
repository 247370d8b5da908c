"""A waiting sequence as the tier cache reads it (:class:`pagedkv.tiers.cache.WaitingSeq`): the
tier-cache tests' stand-in for a scheduler sequence."""

from __future__ import annotations

from typing import List


class Waiting:
    """A waiting sequence: its id, its prompt, no cache salt."""

    def __init__(self, seq_id: int, token_ids: List[int]) -> None:
        self.seq_id = seq_id
        self.token_ids = token_ids
        self.cache_salt = None
