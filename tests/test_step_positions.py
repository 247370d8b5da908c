"""A step's positions have one source: what the manager wrote into the step buffers.

``StepBuffers.positions(step)`` reads them from ``seq_lens`` and ``query_start_loc`` (row ``k``'s
new tokens are the last ``q_len`` of its ``seq_lens[k]``); the scheduler's batch and the model
runner both use it. Checked against each sequence's computed count, for decodes, prefill chunks
prompts partly served by the prefix cache and a scheduler's prefill chunk, on both buffer backends.
"""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
from pagedkv.scheduler import Scheduler, Sequence


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_positions_follow_the_tables_the_manager_wrote(backend):
    if backend == "torch":
        pytest.importorskip("torch")
    m = pagedkv.BlockManager(64, 4, watermark_blocks=0)
    b = pagedkv.StepBuffers(8, 64, m.max_blocks_per_seq, backend=backend, device="cpu")
    m.attach_buffers(b)
    m.admit(0, list(range(10)))
    info = m.step([0], [10])
    assert b.positions(info).tolist() == list(range(10))
    m.append(0, [99])
    # Sequence 1 shares sequence 0's first two full blocks: only its last 3 tokens are computed.
    hit = m.admit(1, list(range(8)) + [50, 51, 52])
    assert hit.cached_tokens == 8
    m.admit(2, list(range(100, 106)))
    info = m.step([0, 1, 2], [1, 3, 6])  # a decode, a prompt after a hit, a whole prompt
    assert b.positions(info).tolist() == [10, 8, 9, 10, 0, 1, 2, 3, 4, 5]
    assert b.positions(info).dtype == np.int64


def test_the_scheduler_s_batch_reads_the_same_positions():
    m = pagedkv.BlockManager(64, 4, watermark_blocks=0)
    buffers = pagedkv.StepBuffers(4, 8, m.max_blocks_per_seq, backend="numpy")
    m.attach_buffers(buffers)
    s = Scheduler(m, max_num_seqs=4, max_num_batched_tokens=8)
    s.add(Sequence(0, [5, 6, 7]))
    s.add(Sequence(1, list(range(20, 32))))  # 12 tokens: a 5-token chunk fits the budget
    batch = s.schedule()
    assert batch.num_new_tokens == [3, 5]
    assert batch.positions().tolist() == buffers.positions(batch.step).tolist() == [0, 1, 2, 0, 1,
                                                                                   2, 3, 4]
