"""KV cache groups through the Python API: configuration, per-group block tables, the per-group
step buffers (numpy and torch backends), the sizing helpers, and typed errors on bad input."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv import _core
from pagedkv import BlockManager, KVCacheGroup, StepBuffers, StepInfo
from pagedkv.errors import (BufferInvalidError, InvalidArgumentError, InvalidConfigError,
                            OutOfBlocksError, OutOfHostBlocksError)
from pagedkv.groups import bytes_per_token, live_blocks, page_bytes, peak_decode_blocks

B = 4
HYBRID = [KVCacheGroup.full(), KVCacheGroup.sliding(6), KVCacheGroup.chunked(8)]


def _backends() -> list[str]:
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError:
        return ["numpy"]
    return ["numpy", "torch"]


def _np(x: Any) -> np.ndarray:
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def _snapshot(m: BlockManager, seqs: list[int]) -> tuple[Any, ...]:
    tables = tuple(
        tuple(tuple(m.block_table(s, g)) for g in range(m.num_groups)) for s in seqs if s in m
    )
    return (m.stats(), m.num_free_blocks, len(m), tables)


def _check_step(m: BlockManager, buf: StepBuffers, info: StepInfo, batch: list[int],
                counts: list[int]) -> None:
    """Every group's slot mapping and block-table rows are what its block table says."""
    for g in range(m.num_groups):
        v = buf.group_views(info, g, on_device=False)
        slots, rows = _np(v.slot_mapping), _np(v.block_tables)
        tok = 0
        for k, (s, n) in enumerate(zip(batch, counts)):
            table = m.block_table(s, g)
            length = m.seq_len(s)
            assert list(rows[k, : len(table)]) == table
            for p in range(length - n, length):
                assert table[p // B] != -1, "a position the step computes was released"
                assert slots[tok] == table[p // B] * B + p % B
                tok += 1
        assert tok == info.num_tokens


def _workload(m: BlockManager, buf: StepBuffers, seed: int) -> list[Any]:
    """A deterministic admit / step / append / fork / free run; returns everything observable."""
    rng = random.Random(seed)
    m.attach_buffers(buf)
    out: list[Any] = []
    live: list[int] = []
    next_id = 1
    for _ in range(60):
        op = rng.random()
        if op < 0.3 and len(live) < 4:
            prompt = [rng.randrange(6) for _ in range(rng.randrange(1, 14))]
            try:
                out.append(m.admit(next_id, prompt))
            except Exception as e:  # the same refusal must happen on both managers
                out.append(type(e).__name__)
            else:
                info = m.step([next_id], [m.seq_len(next_id)])
                out.append((info, _np(buf.host.slot_mapping[: info.num_tokens]).tolist(),
                            _np(buf.host.block_tables[: info.num_seqs]).tolist()))
                live.append(next_id)
            next_id += 1
        elif op < 0.4 and live and len(live) < 4:
            parent = rng.choice(live)
            m.fork(parent, next_id)
            live.append(next_id)
            next_id += 1
        elif op < 0.5 and live:
            victim = live.pop(rng.randrange(len(live)))
            m.free(victim)
        elif live:
            try:
                m.append_batch(live, [rng.randrange(6) for _ in live])
            except Exception as e:
                out.append(type(e).__name__)
                continue
            info = m.step(live, 1)
            out.append((info, _np(buf.host.slot_mapping[: info.num_tokens]).tolist(),
                        _np(buf.host.block_tables[: info.num_seqs]).tolist(),
                        _np(buf.host.copies[: info.num_copies]).tolist()))
        out.append([m.block_table(s) for s in live])
    m.check_invariants()
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_full_group_equals_no_groups(seed: int) -> None:
    """``groups=[full]`` (as a dataclass or a tuple) is exactly the manager without groups."""
    runs = []
    for groups in (None, [KVCacheGroup.full()], [("full",)]):
        m = BlockManager(48, B, watermark_blocks=0, hash_seed=7, groups=groups)
        assert m.num_groups == 1 and m.groups == (KVCacheGroup.full(),)
        runs.append(_workload(m, StepBuffers(4, 64, 12, backend="numpy"), seed))
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("backend", _backends())
def test_hybrid_releases_and_writes_per_group_buffers(backend: str) -> None:
    m = BlockManager(64, B, watermark_blocks=0, groups=HYBRID)
    assert m.num_groups == 3
    assert m.groups == tuple(HYBRID)
    buf = StepBuffers(4, 64, 16, num_groups=3, backend=backend, device="cpu")
    assert len(buf.groups_host) == 2 and len(buf.groups_device) == 2
    addresses = [g.slot_mapping.__array_interface__["data"][0] if backend == "numpy"
                 else g.slot_mapping.data_ptr() for g in buf.groups_host]
    m.attach_buffers(buf)
    m.admit(1, list(range(10)))
    m.admit(2, list(range(100, 103)))
    info = m.step([1, 2], [10, 3])
    _check_step(m, buf, info, [1, 2], [10, 3])
    for t in range(30):
        m.append_batch([1, 2], [t, t])
        info = m.step([1, 2], 1)
        _check_step(m, buf, info, [1, 2], [1, 1])
        m.check_invariants()
    length = m.seq_len(1)  # 40 tokens: positions [0, 40), the last step computed position 39
    sliding, chunked = m.block_table(1, 1), m.block_table(1, 2)
    # Sliding window 6 at position 39 reads [34, 39]: blocks 0..7 are dead (block 8 holds 32..35).
    assert sliding[:8] == [-1] * 8 and -1 not in sliding[8:]
    # Chunk 8 at position 39 reads [32, 39]: blocks 0..7 are dead.
    assert chunked[:8] == [-1] * 8 and -1 not in chunked[8:]
    assert -1 not in m.block_table(1, 0) and len(m.block_table(1, 0)) == length // B
    for g, kind in enumerate(HYBRID):
        live = sum(b != -1 for b in m.block_table(1, g))
        assert live == live_blocks(kind, length, 1, B)
    # Released blocks went back to the pool: the pool holds exactly the tables' live entries.
    held = sum(b != -1 for s in (1, 2) for g in range(3) for b in m.block_table(s, g))
    assert 64 - m.num_free_blocks == held < 3 * (len(m.block_table(1)) + len(m.block_table(2)))
    # The group buffers never moved.
    again = [g.slot_mapping.__array_interface__["data"][0] if backend == "numpy"
             else g.slot_mapping.data_ptr() for g in buf.groups_host]
    assert again == addresses
    # to_device copies the groups' used parts too (the mirror is the host here).
    spans = buf.copy_spans(info)
    ends = max(e for _, e in spans)
    last = buf._group_offsets[-1][1] + 4 * info.num_seqs * buf.max_blocks_per_seq
    assert ends == last
    m.free(1)
    m.free(2)
    m.check_invariants()


def test_prefix_hit_with_groups_needs_every_group() -> None:
    m = BlockManager(64, B, watermark_blocks=0, groups=HYBRID)
    buf = StepBuffers(2, 64, 16, num_groups=3, backend="numpy")
    m.attach_buffers(buf)
    prompt = list(range(17))
    m.admit(1, prompt)
    m.step([1], [17])
    r = m.admit(2, prompt)
    assert r.cached_tokens == 16
    info = m.step([2], [1])
    _check_step(m, buf, info, [2], [1])
    # The sliding group's needed range for position 16 is [11, 16]: blocks 2..4; blocks 0, 1
    # enter its table released.
    assert m.block_table(2, 1)[:2] == [-1, -1]
    m.check_invariants()


def test_bad_groups_are_typed_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="window"):
        KVCacheGroup.sliding(0)
    with pytest.raises(InvalidArgumentError, match="chunk"):
        KVCacheGroup.chunked(-3)
    with pytest.raises(InvalidArgumentError):
        KVCacheGroup("local", 4)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        KVCacheGroup.sliding(True)
    with pytest.raises(InvalidArgumentError, match="window"):
        BlockManager(16, B, groups=[("full",), ("sliding", 0)])
    # The extension's own check (the core's configuration) names the group.
    with pytest.raises(InvalidConfigError, match="group 1"):
        _core.BlockManager(16, B, groups=[("full",), ("sliding", 0)])
    with pytest.raises(InvalidArgumentError):
        _core.BlockManager(16, B, groups=[("local", 3)])
    with pytest.raises(InvalidConfigError, match="group 0 must be Full"):
        BlockManager(16, B, groups=[KVCacheGroup.sliding(4), KVCacheGroup.full()])
    # Swap and the host tier work with groups.
    assert BlockManager(16, B, groups=HYBRID, num_host_blocks=4).num_host_blocks == 4
    assert BlockManager(16, B, groups=HYBRID, num_host_blocks=4, host_cache=True).num_groups == 3
    with pytest.raises(InvalidArgumentError):
        BlockManager(16, B, groups=KVCacheGroup.full())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        BlockManager(16, B, groups=[("full", 2)])
    with pytest.raises(InvalidArgumentError):
        StepBuffers(2, 8, 4, num_groups=0, backend="numpy")


def test_unknown_group_and_wrong_buffers_leave_the_manager_unchanged() -> None:
    m = BlockManager(32, B, watermark_blocks=0, groups=HYBRID[:2])
    buf = StepBuffers(2, 32, 8, num_groups=2, backend="numpy")
    m.attach_buffers(buf)
    m.admit(1, list(range(9)))
    m.step([1], [9])
    before = _snapshot(m, [1])
    with pytest.raises(InvalidArgumentError, match="unknown KV cache group"):
        m.block_table(1, 2)
    with pytest.raises(InvalidArgumentError):
        m.block_table(1, -1)
    for wrong in (1, 3):
        with pytest.raises(BufferInvalidError, match="KV cache group"):
            m.attach_buffers(StepBuffers(2, 32, 8, num_groups=wrong, backend="numpy"))
    assert _snapshot(m, [1]) == before
    assert m.buffers is buf
    with pytest.raises(InvalidArgumentError):
        buf.group_views(StepInfo(1, 1, 0, 0, 9), 2)
    # The earlier attachment still works.
    m.append(1, [5])
    info = m.step([1], 1)
    _check_step(m, buf, info, [1], [1])


def test_sizing_helpers() -> None:
    assert bytes_per_token(8, 128, 2, 32) == 2 * 8 * 128 * 2 * 32
    assert page_bytes([100, 300, 200], 16) == 4800
    assert peak_decode_blocks(KVCacheGroup.full(), 33, 16) == 3
    assert peak_decode_blocks(("sliding", 128), 100_000, 16) == 9
    for kind in (KVCacheGroup.sliding(5), KVCacheGroup.chunked(6), KVCacheGroup.full()):
        brute = max(live_blocks(kind, n, 1, B) for n in range(1, 60))
        assert peak_decode_blocks(kind, 59, B) >= brute
        if kind.kind != "chunked":
            assert peak_decode_blocks(kind, 59, B) == brute
    with pytest.raises(InvalidArgumentError):
        bytes_per_token(2**32, 2**32, 2**32, 1)
    with pytest.raises(InvalidArgumentError):
        live_blocks(KVCacheGroup.full(), 0, 1, B)
    with pytest.raises(InvalidArgumentError):
        live_blocks(KVCacheGroup.full(), 4, 5, B)
    with pytest.raises(InvalidArgumentError):
        peak_decode_blocks(("sliding", 0), 10, B)
    with pytest.raises(InvalidArgumentError):
        peak_decode_blocks(KVCacheGroup.full(), 10, 0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    window=st.integers(1, 12),
    chunk=st.integers(1, 12),
    ops=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 10**6)), min_size=1, max_size=40),
)
def test_random_walks_keep_invariants(window: int, chunk: int, ops: list[tuple[int, int]]) -> None:
    """Admissions (with prefix hits), forks, frees, appends with steps, and swaps out and in:
    every group's step output matches its table, a swap round trip keeps each group's released
    (``-1``) entries exactly, a refused call changes nothing, and the invariants hold."""
    groups = [KVCacheGroup.full(), KVCacheGroup.sliding(window), KVCacheGroup.chunked(chunk)]
    m = BlockManager(48, B, watermark_blocks=0, groups=groups, num_host_blocks=24)
    buf = StepBuffers(4, 64, 16, num_groups=3, backend="numpy")
    m.attach_buffers(buf)
    live: list[int] = []
    swapped: dict[int, list[list[bool]]] = {}  # id -> each group's released entries
    next_id = 1

    def released(s: int) -> list[list[bool]]:
        return [[b == -1 for b in m.block_table(s, g)] for g in range(m.num_groups)]

    for op, x in ops:
        if op == 0 and len(live) < 4:
            prompt = [x % 5 + i % 3 for i in range(1 + x % 13)]
            try:
                r = m.admit(next_id, prompt)
            except Exception:
                next_id += 1
                continue
            # Recomputing the cached prefix too is allowed only where no windowed group left
            # null entries for it; refused, it changes nothing.
            n = len(prompt)
            if r.cached_tokens:
                before = _snapshot(m, live + [next_id])
                try:
                    info = m.step([next_id], [n])
                except InvalidArgumentError:
                    assert _snapshot(m, live + [next_id]) == before
                    n -= r.cached_tokens
                    info = m.step([next_id], [n])
            else:
                info = m.step([next_id], [n])
            _check_step(m, buf, info, [next_id], [n])
            live.append(next_id)
            next_id += 1
        elif op == 1 and live and len(live) < 4:
            m.fork(live[x % len(live)], next_id)
            live.append(next_id)
            next_id += 1
        elif op == 2 and (live or swapped):
            ids = live + list(swapped)
            victim = ids[x % len(ids)]
            m.free(victim)
            if victim in swapped:
                del swapped[victim]
            else:
                live.remove(victim)
        elif op == 5 and live:
            victim = live[x % len(live)]
            before = _snapshot(m, live + list(swapped))
            nulls = released(victim)
            try:
                pairs = m.swap_out([victim])
            except OutOfHostBlocksError:
                assert _snapshot(m, live + list(swapped)) == before
                continue
            assert released(victim) == nulls
            assert len(pairs) <= sum(not r for g in nulls for r in g)
            live.remove(victim)
            swapped[victim] = nulls
        elif op == 6 and swapped and len(live) < 4:
            ids = list(swapped)
            back = ids[x % len(ids)]
            before = _snapshot(m, live + ids)
            try:
                m.swap_in([back])
            except OutOfBlocksError:
                assert _snapshot(m, live + ids) == before
                continue
            assert released(back) == swapped.pop(back)
            live.append(back)
            # The step emits the swap-ins and shows every group's restored table.
            info = m.step(live, 1)
            _check_step(m, buf, info, live, [1] * len(live))
        elif live:
            before = _snapshot(m, live)
            try:
                m.append_batch(live, [x % 7] * len(live))
            except Exception:
                assert _snapshot(m, live) == before
                continue
            info = m.step(live, 1)
            _check_step(m, buf, info, live, [1] * len(live))
        m.check_invariants()


def test_swap_round_trip_moves_every_group() -> None:
    """Through the Python API: ``decide`` counts every group's blocks, ``swap_out`` copies each
    held block of every group once, released (``-1``) entries stay released on the host and after
    ``swap_in``, and the steps emit every pair."""
    from pagedkv import CostModel

    m = BlockManager(64, B, watermark_blocks=0, groups=HYBRID, num_host_blocks=32)
    buf = StepBuffers(2, 64, 16, num_groups=3, backend="numpy")
    m.attach_buffers(buf)
    m.admit(1, list(range(30)))
    m.step([1], [30])
    for t in range(3):  # decodes release what no later query reads
        m.append(1, [100 + t])
        m.step([1], [1])
    tables = [m.block_table(1, g) for g in range(3)]
    held = sum(b != -1 for t in tables for b in t)
    assert -1 in tables[1] and -1 in tables[2] and held > len(tables[0])
    d = m.decide([1], CostModel(1e9, 1e4, 1e3))
    assert d.swap_blocks == held and d.swap_possible
    pairs = m.swap_out([1])
    assert len(pairs) == held == len({d for d, _ in pairs}) == len({h for _, h in pairs})
    host = [m.block_table(1, g) for g in range(3)]
    assert [[b == -1 for b in t] for t in host] == [[b == -1 for b in t] for t in tables]
    assert m.num_free_host_blocks == 32 - held
    m.check_invariants()
    info = m.step([], [])
    assert info.num_swap_out == held
    back = m.swap_in([1])
    assert len(back) == held
    restored = [m.block_table(1, g) for g in range(3)]
    assert [[b == -1 for b in t] for t in restored] == [[b == -1 for b in t] for t in tables]
    info = m.step([1], [1])
    assert info.num_swap_in == held
    _check_step(m, buf, info, [1], [1])
    assert m.num_free_host_blocks == 32
    m.check_invariants()


@pytest.mark.parametrize("backend", _backends())
def test_every_group_windowed_releases_group_0(backend: str) -> None:
    """A manager whose every group is windowed (a model without a full layer): group 0 releases
    what no later query reads (``-1`` in its table and rows), a resent prompt hits up to its last
    full block with only the window held, and the host tier is refused."""
    m = BlockManager(64, B, groups=[KVCacheGroup.sliding(6)], watermark_blocks=0)
    assert m.num_groups == 1 and m.groups == (KVCacheGroup.sliding(6),)
    buf = StepBuffers(4, 64, 16, backend=backend, device="cpu")
    m.attach_buffers(buf)
    prompt = list(range(10))
    m.admit(1, prompt)
    info = m.step([1], [10])
    _check_step(m, buf, info, [1], [10])
    for t in range(30):
        m.append_batch([1], [t])
        info = m.step([1], 1)
        _check_step(m, buf, info, [1], [1])
        table = m.block_table(1)
        # Window 6 at position p reads [p - 5, p]: at most ceil(5 / 4) + 1 = 3 blocks held.
        assert sum(b >= 0 for b in table) <= 3
        m.check_invariants()
    table = m.block_table(1)
    assert table[:8] == [-1] * 8 and -1 not in table[8:]
    assert m.block_hashes(1)[:8] == [None] * 8
    # The prompt again: boundary 8 tokens (two blocks) needs only [dead(8), 2) = [0, 2), still
    # cached; past it, the first sequence's window has moved on.
    r = m.admit(2, prompt)
    assert r.cached_tokens == 8
    m.free(1)
    m.free(2)
    m.check_invariants()
    assert m.num_free_blocks == 64
    with pytest.raises(InvalidConfigError, match="windowed group 0"):
        BlockManager(16, B, groups=[KVCacheGroup.sliding(6)], num_host_blocks=8,
                     host_cache=True)


def test_a_shared_prefix_longer_than_the_window_keeps_hitting() -> None:
    """A document prefix (1536 tokens) longer than a sliding window (1024), read by one request
    after another, with other work evicting the LRU's oldest blocks in between. The first request
    computes it cold: its windows, released mid-run, go to the evicting end (the second may still
    find them), and are evicted. The next request finds group 0's run cached but not the window
    ending there, and recomputes; group 0's run has then ended at the same cached block for two
    admissions, so the window ending there keeps its recency when released (and group 0's cached
    run is refreshed, not left to age behind the recomputed copy), and every later request hits
    the whole prefix. Before, every request after the window's eviction recomputed it."""
    bs, chunk = 16, 512
    groups = [KVCacheGroup("full", 0), KVCacheGroup("sliding", 1024)]
    mgr = BlockManager(800, bs, groups=groups, watermark_blocks=0,
                       max_blocks_per_seq=8192 // bs + 2)
    buf = StepBuffers(4, 8192 + 4, 8192 // bs + 2, device="cpu", backend="numpy", num_groups=2)
    mgr.attach_buffers(buf)
    doc = list(range(10_000, 10_000 + 1536))
    fresh = iter(range(100_000, 10**9))

    def run(rid: int, prompt: list, decode: int) -> int:
        res = mgr.admit(rid, prompt, max_new_tokens=chunk)
        mgr.step([rid], [res.num_tokens - res.cached_tokens])
        held = res.num_tokens
        while held < len(prompt):
            part = prompt[held:held + chunk]
            mgr.append(rid, part)
            mgr.step([rid], [len(part)])
            held += len(part)
        for _ in range(decode):
            mgr.append_batch([rid], [7])
            mgr.step([rid], 1)
        mgr.free(rid)
        mgr.check_invariants()
        return int(res.cached_tokens)

    hits = []
    for r in range(6):
        hits.append(run(2 * r, doc + [next(fresh) for _ in range(1500)], 50))
        # Unrelated work whose blocks take the pool's free list and the LRU's oldest entries.
        run(2 * r + 1, [next(fresh) for _ in range(4000)], 0)
    assert hits[0] == 0 and hits[2] == 0, hits
    assert hits[3:] == [1536, 1536, 1536], hits
