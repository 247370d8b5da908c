"""Swap and recompute through the Python API: the host block pool, swap_out / swap_in, recompute /
resume, victim choice, the cost model, the swap lists of the step buffers, and the stats.

KV content is simulated with numpy: ``dev[b]`` is the content of device block ``b``, ``host[h]`` of
host block ``h``. A step writes each new token's value into its slot; the emitted lists are applied
in the documented order (swap-out, swap-in, copy-on-write) before that write. A round trip must
bring every sequence's tokens back, position for position.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedkv
from pagedkv import BlockManager, CostModel, StepBuffers
from pagedkv.errors import (
    BufferTooSmallError,
    InvalidArgumentError,
    InvalidSequenceStateError,
    OutOfBlocksError,
    OutOfHostBlocksError,
    UnknownSequenceError,
    WatermarkReachedError,
)

B = 4


class Sim:
    """A manager plus simulated device and host KV pools (one int per token slot)."""

    def __init__(self, num_blocks=32, num_host_blocks=32, *, max_swaps=None, **kw) -> None:
        kw.setdefault("watermark_blocks", 0)
        self.m = BlockManager(num_blocks, B, num_host_blocks=num_host_blocks, hash_seed=3, **kw)
        self.bufs = StepBuffers(8, 256, 16, device="cpu", max_swaps=max_swaps)
        self.m.attach_buffers(self.bufs)
        self.dev = np.full((num_blocks, B), -1, dtype=np.int64)
        self.host = np.full((max(num_host_blocks, 1), B), -1, dtype=np.int64)
        self.tokens: dict[int, list[int]] = {}

    def step(self, seqs, new):
        info = self.m.step(seqs, new)
        v = self.bufs.views(info, on_device=False)
        for d, h in v.swap_out.tolist():
            self.host[h] = self.dev[d]
        for h, d in v.swap_in.tolist():
            self.dev[d] = self.host[h]
        for s, d in v.copies.tolist():
            self.dev[d] = self.dev[s]
        # The forward: write the new tokens' KV through the slot mapping.
        slots = v.slot_mapping.tolist()
        k = 0
        for sid, n in zip(seqs, [new] * len(seqs) if isinstance(new, int) else new):
            toks = self.tokens[sid]
            for p in range(len(toks) - n, len(toks)):
                self.dev.reshape(-1)[slots[k]] = toks[p]
                k += 1
        return info

    def admit(self, sid, toks):
        self.tokens[sid] = list(toks)
        r = self.m.admit(sid, toks)
        self.step([sid], r.num_tokens - r.cached_tokens)
        return r

    def append(self, sid, t):
        self.m.append(sid, [t])
        self.tokens[sid].append(t)

    def fork(self, parent, child):
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    def content(self, sid):
        """The sequence's tokens as its (device) table reads them."""
        table = self.m.block_table(sid)
        flat = np.concatenate([self.dev[b] for b in table])
        return flat[: len(self.tokens[sid])].tolist()


def _snapshot(m: BlockManager):
    return (
        sorted((s, m.seq_state(s), tuple(m.block_table(s)), m.seq_len(s)) for s in _ids(m)),
        m.num_free_blocks,
        m.num_free_host_blocks,
        tuple(m.pending_swap_out()),
        tuple(m.pending_swap_in()),
        tuple(m.pending_copies()),
        m.stats().as_dict(),
    )


def _ids(m: BlockManager):
    return [s for s in range(0, 64) if s in m]


def test_swap_disabled_by_default() -> None:
    m = BlockManager(16, B)
    assert m.num_host_blocks == 0
    m.admit(1, [1, 2, 3])
    with pytest.raises(OutOfHostBlocksError) as info:
        m.swap_out([1])
    assert info.value.needed == 1 and info.value.available == 0
    assert m.seq_state(1) == "running"
    m.check_invariants()


def test_round_trip_restores_content() -> None:
    s = Sim()
    s.admit(1, list(range(100, 110)))
    s.append(1, 110)
    s.step([1], 1)
    before = s.content(1)
    out = s.m.swap_out([1])
    assert len(out) == 3 and s.m.seq_state(1) == "swapped"
    assert s.m.num_free_blocks == 32
    assert [h for _, h in out] == s.m.block_table(1)
    s.m.check_invariants()
    # Another sequence takes the freed device blocks before the step emits the swap-out.
    s.admit(2, list(range(500, 512)))
    s.m.check_invariants()
    s.m.swap_in([1])
    s.append(1, 111)
    info = s.step([1], 1)
    assert info.num_swap_in == 3
    assert s.content(1) == before + [111]
    assert s.content(2) == list(range(500, 512))
    s.m.check_invariants()
    st_ = s.m.stats()
    assert st_.preemptions_swap == 1 and st_.preemptions == 1
    assert st_.swapped_out_blocks == 3 and st_.swapped_in_blocks == 3
    assert st_.host_free_blocks == 32 and st_.num_host_blocks == 32


def test_forked_group_copied_once() -> None:
    s = Sim()
    s.admit(1, list(range(10)))  # 2 full blocks + a partial tail
    s.fork(1, 2)
    s.fork(1, 3)
    s.append(2, 77)
    s.step([1, 2, 3], 1)  # seq 2 copies its tail (COW)
    victim = s.m.choose_victim()
    assert victim == [1, 2, 3]
    out = s.m.swap_out(victim)
    # Shared blocks once: 2 full + the shared tail (1 and 3) + seq 2's own tail.
    assert len(out) == 4
    assert s.m.stats().preemptions_swap == 3
    for h in s.m.block_table(1)[:2]:
        assert s.m.host_block_refcount(h) == 3
    assert s.m.block_table(1) == s.m.block_table(3)
    s.m.check_invariants()
    s.m.swap_in(victim)
    s.step([1, 2, 3], 1)
    for sid in victim:
        assert s.content(sid) == s.tokens[sid]
    # Shared again on the device.
    assert s.m.block_table(1)[:2] == s.m.block_table(2)[:2]
    assert s.m.block_refcount(s.m.block_table(1)[0]) == 3
    s.m.check_invariants()


def test_swapped_sequence_is_not_schedulable() -> None:
    s = Sim()
    s.admit(1, [1, 2, 3])
    s.m.swap_out([1])
    before = _snapshot(s.m)
    for call in (
        lambda: s.m.step([1], 1),
        lambda: s.m.append(1, [4]),
        lambda: s.m.append_batch([1], [4]),
        lambda: s.m.fork(1, 2),
        lambda: s.m.swap_out([1]),
        lambda: s.m.resume(1),
    ):
        with pytest.raises(InvalidSequenceStateError) as info:
            call()
        assert info.value.seq_id == 1 and info.value.state == "swapped"
    assert _snapshot(s.m) == before
    assert 1 in s.m and len(s.m) == 1
    s.admit(2, [5, 6])
    s.m.recompute(2)
    s.m.free_batch([1, 2])  # any state may be freed
    assert len(s.m) == 0
    assert s.m.num_free_host_blocks == 32
    s.m.check_invariants()


def test_errors_leave_state_unchanged() -> None:
    s = Sim(num_blocks=8, num_host_blocks=2)
    s.admit(1, list(range(12)))  # 3 blocks
    s.admit(2, [1])
    before = _snapshot(s.m)
    with pytest.raises(OutOfHostBlocksError):
        s.m.swap_out([1])
    with pytest.raises(UnknownSequenceError):
        s.m.swap_out([2, 9])
    with pytest.raises(InvalidArgumentError):
        s.m.swap_out([2, 2])
    with pytest.raises(InvalidArgumentError):
        s.m.swap_out([])
    with pytest.raises(InvalidSequenceStateError):
        s.m.swap_in([2])
    with pytest.raises(InvalidArgumentError):
        s.m.swap_out([True])
    assert _snapshot(s.m) == before
    s.m.check_invariants()
    # swap_in needs device blocks above the watermark, like an admission.
    s2 = Sim(num_blocks=4, num_host_blocks=4)
    s2.admit(1, list(range(8)))
    s2.m.swap_out([1])
    s2.admit(2, list(range(12)))
    before = _snapshot(s2.m)
    with pytest.raises(OutOfBlocksError):
        s2.m.swap_in([1])
    assert _snapshot(s2.m) == before
    s3 = Sim(num_blocks=8, num_host_blocks=4, watermark_blocks=4)
    s3.admit(1, list(range(8)))
    s3.m.swap_out([1])
    s3.admit(2, list(range(12)))
    before = _snapshot(s3.m)
    with pytest.raises(WatermarkReachedError):
        s3.m.swap_in([1])
    assert _snapshot(s3.m) == before
    s3.m.check_invariants()


def test_swapped_hashed_blocks_leave_the_prefix_cache_until_swapped_back() -> None:
    s = Sim()
    prompt = list(range(9))
    s.admit(1, prompt)
    assert s.m.block_hashes(1)[:2] != [None, None]
    s.m.swap_out([1])
    assert s.m.stats().cached_free_blocks == 0
    assert s.m.admit(2, prompt).cached_tokens == 0
    s.m.free(2)
    s.m.swap_in([1])
    s.step([1], 1)
    assert s.m.admit(3, prompt).cached_tokens == 8
    s.m.check_invariants()


def test_recompute_and_resume_hit_the_prefix_cache() -> None:
    s = Sim()
    s.admit(1, list(range(10)))
    s.m.recompute(1)
    assert s.m.seq_state(1) == "recompute" and s.m.seq_len(1) == 10
    assert s.m.block_table(1) == []
    assert s.m.stats().preemptions_recompute == 1
    with pytest.raises(InvalidSequenceStateError):
        s.m.recompute(1)
    with pytest.raises(InvalidSequenceStateError):
        s.m.step([1], 1)
    s.m.check_invariants()
    r = s.m.resume(1, max_new_tokens=1)
    assert r.cached_tokens == 8 and r.num_tokens == 9
    s.m.append(1, [9])
    s.step([1], 2)
    assert s.content(1) == s.tokens[1]
    s.m.check_invariants()


def test_victim_is_most_recent_group_and_keeps_order() -> None:
    m = BlockManager(32, B, watermark_blocks=0, num_host_blocks=16)
    assert m.choose_victim() is None
    m.admit(1, [1])
    m.admit(2, [2])
    m.fork(1, 3)
    assert m.choose_victim() == [2]
    m.swap_out([2])
    assert m.choose_victim() == [1, 3]
    m.swap_in([2])
    assert m.choose_victim() == [2]
    m.recompute(2)
    assert m.choose_victim() == [1, 3]
    m.resume(2)
    assert m.choose_victim() == [2]


def test_cost_model_picks_the_cheaper_mode() -> None:
    m = BlockManager(256, 16, watermark_blocks=0, num_host_blocks=256)
    m.attach_buffers(StepBuffers(4, 4096, 64, device="cpu"))
    m.admit(1, list(range(1000)))
    m.step([1], 1000)
    blocks = len(m.block_table(1))
    fast_link = CostModel(host_link_bytes_per_s=1e12, prefill_tokens_per_s=1e3, kv_bytes_per_token=1e3)
    d = m.decide([1], fast_link)
    assert d.mode == "swap" and d.swap_possible
    assert d.swap_blocks == blocks and d.recompute_tokens == 1000
    assert d.swap_cost_s == pytest.approx(2 * blocks * 16 * 1e3 / 1e12)
    assert d.recompute_cost_s == pytest.approx(1000 / 1e3)
    slow_link = CostModel(1e3, 1e12, 1e3)
    assert m.decide([1], slow_link).mode == "recompute"
    # A prefix another sequence holds survives a recompute: fewer tokens to re-run.
    m.admit(2, list(range(500)) + [7] * 10)
    d2 = m.decide([2], slow_link)
    assert d2.recompute_tokens == 510 - 496
    # The manager's default model; none at all is a typed error.
    m.cost_model = fast_link
    # Seq 1's prefix is now held by seq 2 too: it would survive a recompute of seq 1.
    d1 = m.decide([1])
    assert d1.mode == "swap" and d1.recompute_tokens == 1000 - 496
    m.cost_model = None
    with pytest.raises(InvalidArgumentError):
        m.decide([1])
    with pytest.raises(InvalidArgumentError):
        m.decide([1], CostModel(0.0, 1.0, 1.0))
    # Without host room, recompute whatever the costs.
    small = BlockManager(64, 16, watermark_blocks=0, num_host_blocks=1)
    small.admit(1, list(range(100)))
    assert small.decide([1], fast_link).mode == "recompute"
    assert not small.decide([1], fast_link).swap_possible


def test_step_floor_lets_a_short_recompute_ride_the_running_decodes() -> None:
    m = BlockManager(256, 16, watermark_blocks=0, num_host_blocks=256)
    m.attach_buffers(StepBuffers(8, 4096, 64, device="cpu"))
    for sid, n in ((1, 600), (2, 40), (3, 40), (4, 40)):
        m.admit(sid, [sid * 1000 + i for i in range(n)])
    # 10k tokens/s, a 40 ms step floor: a step is free up to 400 tokens; 2048 a step at most.
    # Swap: 2 × 38 blocks × 16 tokens × 1 kB / 1 GB/s = 1.2 ms.
    cm = CostModel(1e9, 1e4, 1e3, step_floor_s=0.040, max_step_tokens=2048)
    d = m.decide([2], cm)
    # Three other sequences decode beside it: 40 tokens ride a step that costs the floor anyway.
    assert d.batch_tokens == 3 and d.recompute_cost_s == 0.0 and d.mode == "recompute"
    # Alone, the recompute pays a whole step: 40 ms against a 0.1 ms swap.
    alone = m.decide([2], cm, batch_tokens=0)
    assert alone.recompute_cost_s == pytest.approx(0.040) and alone.mode == "swap"
    # 600 tokens beside 3 decodes: the step grows from 40 ms to 60.3 ms.
    d1 = m.decide([1], cm)
    assert d1.recompute_cost_s == pytest.approx(603 / 1e4 - 0.040)
    assert d1.mode == "swap" and d1.swap_cost_s == pytest.approx(2 * 38 * 16 * 1e3 / 1e9)
    # Without a floor the model is linear, as with three rates.
    assert m.decide([1], (1e9, 1e4, 1e3)).recompute_cost_s == pytest.approx(600 / 1e4)
    for bad in (CostModel(1e9, 1e4, 1e3, step_floor_s=-1.0),
                CostModel(1e9, 1e4, 1e3, step_floor_s=float("nan"))):
        with pytest.raises(InvalidArgumentError, match="step_floor_s"):
            m.decide([1], bad)
    for kw in ({"batch_tokens": -1}, {"batch_tokens": True}, {"batch_tokens": 1.5}):
        with pytest.raises(InvalidArgumentError, match="batch_tokens"):
            m.decide([1], cm, **kw)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="max_step_tokens"):
        m.decide([1], CostModel(1e9, 1e4, 1e3, max_step_tokens=-5))
    m.check_invariants()


def test_kv_cache_usage_counts_cached_free_as_free() -> None:
    s = Sim(num_blocks=16)
    s.admit(1, list(range(8)))
    assert s.m.stats().kv_cache_usage == pytest.approx(2 / 16)
    s.m.free(1)
    st_ = s.m.stats()
    assert st_.cached_free_blocks == 2 and st_.kv_cache_usage == 0.0


def test_swap_lists_overflow_stay_queued() -> None:
    s = Sim(max_swaps=1)
    s.admit(1, list(range(12)))
    s.m.swap_out([1])
    # Seq 2 takes a freed block (the last one freed, the tail's): its admission step must emit
    # that block's swap-out, and has room for nothing else.
    s.m.admit(2, [1])
    s.tokens[2] = [1]
    tail = s.m.block_table(2)[0]
    info = s.step([2], 1)
    assert info.num_swap_out == 1
    assert int(s.bufs.host.swap_out[0, 0]) == tail
    assert len(s.m.pending_swap_out()) == 2
    s.step([2], 1)
    s.step([2], 1)
    assert s.m.pending_swap_out() == []
    s.m.swap_in([1])
    # Scheduling seq 1 needs all three swap-ins in this step: the buffer holds one.
    with pytest.raises(BufferTooSmallError) as info:
        s.m.step([1], 1)
    assert info.value.buffer == "swap_in"
    for _ in range(3):
        s.step([2], 1)
    assert s.m.pending_swap_in() == []
    s.step([1], 1)
    assert s.content(1) == s.tokens[1]
    s.m.check_invariants()


def test_stats_and_exports() -> None:
    assert pagedkv.OutOfHostBlocksError is OutOfHostBlocksError
    assert pagedkv.CostModel is CostModel
    d = BlockManager(8, B).stats().as_dict()
    for key in (
        "preemptions_swap",
        "preemptions_recompute",
        "swapped_out_blocks",
        "swapped_in_blocks",
        "host_free_blocks",
        "num_host_blocks",
        "kv_cache_usage",
    ):
        assert key in d


OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "append", "fork", "swap_out", "swap_in", "recompute", "resume", "free", "step"]),
        st.integers(0, 5),
        st.integers(1, 9),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(OPS, st.sampled_from([1, 2, 64]))
def test_random_ops_keep_content_and_invariants(ops, max_swaps) -> None:
    """Every running sequence is kept fully computed (each op that adds tokens steps them), so
    after any mix of swaps, recomputes, forks and frees, each one's table reads back its tokens.
    With small swap buffers, empty steps drain the queues first (what an engine does when a
    step is refused for a full swap list)."""
    s = Sim(num_blocks=24, num_host_blocks=16, max_swaps=max_swaps)
    nxt = 100

    def run(seqs, new):
        for _ in range(64):
            if not s.m.pending_swap_out() and not s.m.pending_swap_in():
                break
            s.step([], [])
        s.step(seqs, new)

    for op, a, n in ops:
        ids = _ids(s.m)
        running = [i for i in ids if s.m.seq_state(i) == "running"]
        try:
            if op == "admit" and a not in s.m:
                toks = list(range(nxt, nxt + n))
                nxt += n
                r = s.m.admit(a, toks)
                s.tokens[a] = toks
                run([a], r.num_tokens - r.cached_tokens)
            elif op == "append" and a in running:
                s.m.append(a, [nxt])
                s.tokens[a].append(nxt)
                nxt += 1
                run([a], 1)
            elif op == "fork" and running and a not in s.m:
                s.fork(running[n % len(running)], a)
            elif op == "swap_out":
                v = s.m.choose_victim()
                if v:
                    s.m.swap_out(v)
            elif op == "swap_in" and a in ids and s.m.seq_state(a) == "swapped":
                s.m.swap_in([a])
            elif op == "recompute" and a in running:
                s.m.recompute(a)
            elif op == "resume" and a in ids and s.m.seq_state(a) == "recompute":
                r = s.m.resume(a)
                run([a], r.num_tokens - r.cached_tokens)
            elif op == "free" and a in ids:
                s.m.free(a)
                del s.tokens[a]
            elif op == "step" and running:
                run(running, 1)
        except (OutOfBlocksError, OutOfHostBlocksError):
            pass
        s.m.check_invariants()
    running = [i for i in _ids(s.m) if s.m.seq_state(i) == "running"]
    if running:
        run(running, 1)
        for i in running:
            assert s.content(i) == s.tokens[i]
