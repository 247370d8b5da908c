"""Tensor parallelism with KV cache groups: the step packet carries every group's tables.

A small random hybrid model (Gemma 3 text: three sliding layers of window 8 beside one full layer,
fp32, seeded, 4 query heads over 2 KV heads) is saved with ``save_pretrained``. ``LLM(...,
tensor_parallel_size=2)`` spawns rank 1 (gloo, CPU) and runs the same prompts as ``LLM(...)``:
greedy tokens must be equal, token for token. With block size 4 and window 8 the sliding group
releases blocks while sequences run, so its tables differ from group 0's (``-1`` where it
released); the prompts also include a chunked prefill, a prefix-cache hit, a fork (``n=2``,
copy-on-write in both groups) and, in a pool this small, preemption. Rank 1 computes half of the
heads of every layer from the tables it received: a sliding layer read through group 0's tables
(or stale ones) changes its heads' output, the all-reduced logits and the tokens.

The packet itself is checked through a real gloo group of one rank (its broadcast leaves the
packet as it is): groups ``1..G-1``' tables come back in the step's extent, a one-group packet
has no group field (same layout and size as before groups), and a packet for another number of
groups is refused before anything is written.
"""

from __future__ import annotations

import numpy as np
import pytest

import tp_harness
from tp_harness import (check_full_chunk_and_copies, check_same_schedule, generate, params,
                        prompts, require_torch_distributed)

require_torch_distributed()

from pagedkv import StepBuffers, StepInfo  # noqa: E402
from pagedkv.distributed import step_broadcast as sb  # noqa: E402
from pagedkv.errors import InvariantViolationError  # noqa: E402

from tiny_hybrid import VOCAB, save_hybrid  # noqa: E402

gloo_world_of_one = tp_harness.gloo_world_of_one  # the fixture the packet tests take


@pytest.fixture(scope="module", params=["gemma3_text", "qwen2"])  # qwen2: the fused forward
def hybrid(request, tmp_path_factory):
    return save_hybrid(request.param, str(tmp_path_factory.mktemp(request.param)))


ENGINE = dict(device="cpu", block_size=4, num_blocks=96, max_num_batched_tokens=32,
              max_num_seqs=8, progress=False, preemption_mode="recompute")


def _has_groups(llm) -> None:
    assert llm.llm_engine.runner.buffers.num_groups >= 2


def _generate(path, tp):
    # The 4th prompt shares 10 full blocks with the 70-token one: a prefix-cache hit.
    return generate(path, tp, ENGINE, prompts(VOCAB, second=19, shared=40), params(),
                    check=_has_groups)


def test_tp2_with_groups_equals_tp1(hybrid):
    ref = _generate(hybrid, 1)
    got = _generate(hybrid, 2)
    # The same schedule ran, and the cases this test is for did happen.
    check_same_schedule(ref, got)
    records = got[2]
    assert records is not None and len(records) == 2 and len(records[1]) == len(records[0])
    infos = [r["info"] for r in records[0]]
    check_full_chunk_and_copies(infos, ENGINE["max_num_batched_tokens"])


# --------------------------------------------------------------------------------- packet


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def test_packet_carries_every_groups_tables(gloo_world_of_one):
    max_seqs, max_tokens, max_blocks = 4, 16, 6
    one = StepBuffers(max_seqs, max_tokens, max_blocks, max_copies=2, max_swaps=2, device="cpu")
    three = StepBuffers(max_seqs, max_tokens, max_blocks, max_copies=2, max_swaps=2,
                        device="cpu", num_groups=3)
    b1 = sb.StepBroadcaster(one, gloo_world_of_one)
    b3 = sb.StepBroadcaster(three, gloo_world_of_one)
    # One group: no group field, the layout of a packet without groups.
    assert set(b1.offsets) == set(sb._HOST_FIELDS + sb._DEVICE_FIELDS)
    assert b1.num_groups == 1 and "num_groups" not in repr(b1)
    per_group = _aligned(8 * max_tokens) + _aligned(4 * max_seqs * max_blocks)
    assert b3.nbytes == b1.nbytes + 2 * per_group
    assert {k: v for k, v in b3.offsets.items() if k in b1.offsets} == b1.offsets

    info = StepInfo(3, 7, 0, 1, 13, 0, 0, 5)
    g = np.random.default_rng(5)
    sent = []
    for gt in three.groups_host:
        sm, bt = gt.slot_mapping.numpy(), gt.block_tables.numpy()
        sm[:] = g.integers(-1, 100, sm.shape)
        bt[:] = g.integers(-1, 30, bt.shape)
        sent.append((sm.copy(), bt.copy()))
    ids, pos, rows = np.arange(7), np.arange(7), np.array([1, 6])
    b3.send_step(info, ids, pos, rows)
    three._host_arena.zero_()  # what the receiver writes shows up as non-zero bytes
    b3.seq_no = 0  # the one rank receives the packet it sent
    got = b3.recv()
    assert got.cmd == sb.CMD_STEP and got.info == info
    for gt, (sm, bt) in zip(three.groups_host, sent):
        assert gt.slot_mapping.numpy()[:7].tolist() == sm[:7].tolist()
        assert gt.block_tables.numpy()[:3].tolist() == bt[:3].tolist()
        # Past the step's extent nothing is carried.
        assert not gt.slot_mapping.numpy()[7:].any() and not gt.block_tables.numpy()[3:].any()
    # Each group's view of the step, as the runner cuts it, is what rank 0 had.
    for k, (sm, bt) in enumerate(sent, start=1):
        v = three.group_views(info, k, on_device=False)
        assert v.slot_mapping.tolist() == sm[:7].tolist()
        assert v.block_tables.tolist() == bt[:3].tolist()


def test_packet_for_another_number_of_groups_is_refused(gloo_world_of_one):
    three = StepBuffers(4, 16, 6, max_copies=2, max_swaps=2, device="cpu", num_groups=3)
    b = sb.StepBroadcaster(three, gloo_world_of_one)
    info = StepInfo(2, 5, 0, 0, 9, 0, 0, 4)
    b.send_step(info, np.arange(5), np.arange(5), np.array([2, 4]))
    good = b._header.copy()
    arena = three._host_arena
    arena.zero_()
    for bad in (1, 2, 4):
        b._header[:] = good
        b._header[sb._H_NGROUPS] = bad
        b.seq_no = 0
        with pytest.raises(InvariantViolationError) as e:
            b.recv()
        assert e.value.value == bad and "3" in str(e.value)
        assert b.seq_no == 0 and not bool(arena.any())
    b._header[:] = good
    assert b.recv().info == info and b.seq_no == 1
