"""The scheduler's speculative hook without a model: drafts ride decode rows as the manager's
provisional tokens, and ``postprocess`` commits the accepted prefix in one call.
"""

from __future__ import annotations

import pytest

from pagedkv import BlockManager, StepBuffers
from pagedkv.errors import InvalidArgumentError
from pagedkv.scheduler import Scheduler, Sequence


def _sched(num_blocks: int = 32, k: int = 3) -> Scheduler:
    m = BlockManager(num_blocks, 4, max_provisional=k, watermark_blocks=0, hash_seed=1)
    m.attach_buffers(StepBuffers(4, 64, m.max_blocks_per_seq, device="cpu", backend="numpy"))
    return Scheduler(m, max_num_seqs=4, max_num_batched_tokens=64)


def _prefilled(s: Scheduler, prompts: list) -> list:
    seqs = [Sequence(i, p) for i, p in enumerate(prompts)]
    for q in seqs:
        s.add(q)
    b = s.schedule()
    s.postprocess(b, [100 + i for i in range(len(seqs))])  # each prompt's first token
    return seqs


def test_drafts_ride_decodes_and_commit_the_accepted_prefix() -> None:
    s = _sched()
    a, b = _prefilled(s, [[1, 2, 3, 4, 5], [6, 7]])
    seen = []

    def propose(decodes, budget):
        seen.append(([q.seq_id for q in decodes], budget))
        return [[7, 8, 9], []]

    s.propose = propose
    batch = s.schedule()
    assert seen == [([0, 1], 62)]
    assert batch.drafts == [[7, 8, 9], []]
    assert batch.num_new_tokens == [4, 1]
    assert batch.input_ids().tolist() == [100, 7, 8, 9, 101]
    assert batch.sample_mask() == [True, True]
    m = s.manager
    assert (m.num_provisional(0), m.seq_len(0)) == (3, 9)
    with pytest.raises(InvalidArgumentError, match="prefix"):
        s.postprocess(batch, [50, 51], [[7, 9], []])  # not a prefix of the drafts
    assert m.num_provisional(0) == 3  # nothing changed
    s.postprocess(batch, [50, 51], [[7, 8], []])
    assert a.token_ids == [1, 2, 3, 4, 5, 100, 7, 8, 50]
    assert a.num_computed_tokens == 8 == m.seq_len(0) and m.num_provisional(0) == 0
    assert b.token_ids == [6, 7, 101, 51] and b.num_computed_tokens == 3
    m.check_invariants()


def test_no_room_for_drafts_decodes_plainly() -> None:
    # A pool of 2 blocks of 4: the prompt (5 tokens) and its first token fit; 3 drafts would need
    # a third block, so the step carries no drafts (and preempts nobody).
    s = _sched(num_blocks=2, k=3)
    (a,) = _prefilled(s, [[1, 2, 3, 4, 5]])
    s.propose = lambda decodes, budget: [[1, 2, 3]]
    batch = s.schedule()
    assert batch.drafts == [] and batch.num_new_tokens == [1]
    assert s.manager.num_provisional(0) == 0
    s.postprocess(batch, [9])
    assert a.token_ids[-2:] == [100, 9]
