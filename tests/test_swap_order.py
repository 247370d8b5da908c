"""The swap engine's GPU ordering, checked on the CPU by a happens-before race detector.

The CUDA branches of :class:`pagedkv.tiers.host.SwapEngine` (swap-outs and swap-ins with their
per-block order) run here against stand-in streams and events. Every copy the engine queues, and
every read and write of the cache the test's forward queues on the compute stream the way the
model runner does (``wait`` before the forward), is recorded with the bytes it reads and writes
and a vector clock. Two accesses to the same bytes, at least one a write, are a
race unless the first happens before the second through the streams' order and the engine's own
event waits. The stand-in events report completion only when a seeded coin says so (a GPU may
be arbitrarily slow or fast; a completion the host observes orders what the event covers before
the host's later work), so the ordering the engine needs must come from its waits.

The copies also run eagerly in program order, so the final bytes are checked as well; only the
clocks can find a missing wait. Random workloads follow the block manager's rules: a step evicts
some live device blocks to free host slots (write-back), loads some host slots into free device
blocks (often the ones just evicted), frees some host slots for later write-backs, then its
forward reads every live block and writes new tokens into fresh blocks.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv.tiers import host as S  # noqa: E402
from pagedkv.config import CacheSpec  # noqa: E402
from pagedkv.kv_pool import KVPool  # noqa: E402

Clock = Dict[Any, int]


def _join(a: Clock, b: Clock) -> Clock:
    out = dict(a)
    for k, v in b.items():
        if v > out.get(k, 0):
            out[k] = v
    return out


class Race(AssertionError):
    pass


class World:
    """Streams, events and the recorded accesses of one run."""

    def __init__(self, cell: int, seed: int, completes: float) -> None:
        self.cell = cell
        self.rng = random.Random(seed)
        self.completes = completes
        self.host: Clock = {}
        self.streams: List["FakeStream"] = []
        self.default = FakeStream(self, name="compute")
        self.current = self.default
        # per cell: (last write, reads since it); an access is (stream id, clock, what)
        self.cells: Dict[int, Tuple[Optional[tuple], list]] = {}
        self.num_accesses = 0

    def _cells(self, ranges: List[Tuple[int, int]]) -> List[int]:
        out = []
        # Every access covers whole K or V slices of one block and layer (the engine copies
        # nothing smaller), at multiples of that size from its buffer's start: so one cell per
        # slice, and two accesses to a slice name the same cells.
        for a, b in ranges:
            assert (b - a) % self.cell == 0, "an access smaller than a block's slice"
            out.extend(range(a, b, self.cell))
        return out

    def access(self, stream: "FakeStream", reads, writes, what: str) -> None:
        """Queues one operation on ``stream``: after the host's work so far, after the stream's
        earlier work; checks it against the cells' earlier accesses."""
        stream.vc = _join(stream.vc, self.host)
        stream.n += 1
        stream.vc = dict(stream.vc)
        stream.vc[stream.id] = stream.n
        me = (stream.id, dict(stream.vc), what)
        self.num_accesses += 1
        for c in self._cells(reads):
            w, rs = self.cells.get(c, (None, []))
            self._ordered(w, me, c)
            rs.append(me)
            self.cells[c] = (w, rs)
        for c in self._cells(writes):
            w, rs = self.cells.get(c, (None, []))
            self._ordered(w, me, c)
            for r in rs:
                self._ordered(r, me, c)
            self.cells[c] = (me, [])

    @staticmethod
    def _ordered(before: Optional[tuple], after: tuple, c: int) -> None:
        if before is None or before[0] == after[0]:
            return
        sid, vc, what = before
        if vc[sid] > after[1].get(sid, 0):
            raise Race(f"unordered accesses to byte {c:#x}: {what!r} (stream {sid}) and "
                       f"{after[2]!r} (stream {after[0]})")


class FakeStream:
    def __init__(self, world: World, *a: Any, name: str = "", **k: Any) -> None:
        self.world, self.name = world, name
        self.id = len(world.streams)
        world.streams.append(self)
        self.vc: Clock = {}
        self.n = 0

    def wait_stream(self, other: "FakeStream") -> None:
        self.vc = _join(self.vc, other.vc)

    def wait_event(self, ev: "FakeEvent") -> None:
        if ev.vc is not None:
            self.vc = _join(self.vc, ev.vc)

    def synchronize(self) -> None:
        self.world.host = _join(self.world.host, self.vc)


class FakeEvent:
    world: World

    def __init__(self, *a: Any, **k: Any) -> None:
        self.vc: Optional[Clock] = None

    def record(self, stream: Optional[FakeStream] = None) -> None:
        s = stream or self.world.current
        self.vc = dict(s.vc)

    def query(self) -> bool:
        if self.vc is None:
            return True
        if self.world.rng.random() < self.world.completes:
            self.synchronize()  # the host saw it complete: what it covers is done
            return True
        return False

    def synchronize(self) -> None:
        if self.vc is not None:
            self.world.host = _join(self.world.host, self.vc)


def ranges(t: torch.Tensor) -> List[Tuple[int, int]]:
    """The byte intervals a (possibly strided) tensor covers."""
    if t.numel() == 0:
        return []
    if t.is_contiguous():
        p = t.data_ptr()
        return [(p, p + t.numel() * t.element_size())]
    return [r for i in range(t.shape[0]) for r in ranges(t[i])]


def _rows(t: torch.Tensor, dim: int, idx: torch.Tensor) -> List[Tuple[int, int]]:
    return [r for i in idx.tolist() for r in ranges(t.select(dim, i))]


@contextlib.contextmanager
def instrumented(world: World, monkeypatch: Any):
    """Routes torch.cuda's streams and events and the engine's copies through ``world``."""
    FakeEvent.world = world
    real_copy, real_index_copy = torch.Tensor.copy_, torch.Tensor.index_copy_
    real_index_select = torch.index_select

    @contextlib.contextmanager
    def use(stream):
        prev, world.current = world.current, stream
        try:
            yield
        finally:
            world.current = prev

    def copy_(self, src, non_blocking=False):
        world.access(world.current, ranges(src), ranges(self), "copy_")
        return real_copy(self, src)

    def index_copy_(self, dim, index, src):
        world.access(world.current, ranges(src), _rows(self, dim, index), "index_copy_")
        return real_index_copy(self, dim, index, src)

    def index_select(src, dim, index, *, out=None):
        world.access(world.current, _rows(src, dim, index), ranges(out), "index_select")
        return real_index_select(src, dim, index, out=out)

    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: FakeStream(world))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: world.current)
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch.Tensor, "index_copy_", index_copy_)
    monkeypatch.setattr(torch, "index_select", index_select)
    yield


def _engine(layers: int, blocks: int, host_blocks: int, staging: int) -> Tuple[S.SwapEngine, Any]:
    spec = CacheSpec(num_layers=layers, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
    pool = KVPool(spec, blocks, "cpu")
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(1)))
    eng = S.SwapEngine(pool, host_blocks, staging_blocks=staging, pin_memory=False)
    return eng, pool


def _cell(pool: Any) -> int:
    """Bytes of one block of one layer's K (or V): the unit the engine's copies index."""
    return pool.kv[0, 0, 0].numel() * pool.kv.element_size()


def _forward(world: World, eng: S.SwapEngine, pool: Any, reads: List[int], writes: List[int],
             rng: random.Random) -> None:
    """The runner's protocol around one eager forward on the compute stream: wait for the
    swaps, then per layer read the live blocks and write new tokens into ``writes``."""
    eng.wait()
    kv = pool.kv.view(torch.uint8)
    for layer in range(pool.spec.num_layers):
        r = [x for b in reads for kvi in (0, 1) for x in ranges(kv[layer, kvi, b])]
        w = [x for b in writes for kvi in (0, 1) for x in ranges(kv[layer, kvi, b])]
        world.access(world.default, r, w, f"forward layer {layer}")
        for b in writes:
            kv[layer, :, b].fill_(rng.randrange(256))  # its own bytes: unrecorded, not a copy


def _workload(world: World, eng: S.SwapEngine, pool: Any, seed: int, steps: int,
              skip_forward: float) -> Dict[str, int]:
    rng = random.Random(seed)
    n, nh = pool.num_blocks, eng.host.num_blocks
    kv = pool.kv.view(torch.uint8)
    live = set(rng.sample(range(n), n // 2))
    free = set(range(n)) - live
    host_free = set(range(nh))
    host_held: Dict[int, torch.Tensor] = {}  # host slot -> the bytes it must hold
    counts = {"out": 0, "in": 0, "bursts": 0}
    for _ in range(steps):
        # Write-back: some live blocks leave the GPU for free host slots.
        k = min(len(live) - 1, len(host_free), rng.randrange(0, 7))
        out_dev = rng.sample(sorted(live), max(0, k))
        out_host = rng.sample(sorted(host_free), len(out_dev))
        if rng.random() < 0.5:
            out_host = sorted(out_host)  # runs of consecutive host slots, often
        for d, h in zip(out_dev, out_host):
            host_held[h] = kv[:, :, d].clone()
        eng.swap_out(list(zip(out_dev, out_host)))
        counts["out"] += len(out_dev)
        live -= set(out_dev)
        free |= set(out_dev)
        host_free -= set(out_host)
        # Loads: some held host slots into free device blocks, preferring the ones just evicted.
        k = min(len(host_held), len(free), rng.randrange(0, 7))
        in_host = rng.sample(sorted(host_held), k)
        pref = [d for d in out_dev if d in free] + sorted(free - set(out_dev))
        in_dev = pref[:k] if rng.random() < 0.7 else rng.sample(sorted(free), k)
        eng.swap_in(list(zip(in_host, in_dev)))
        counts["in"] += len(in_host)
        expect = {d: host_held[h] for h, d in zip(in_host, in_dev)}
        live |= set(in_dev)
        free -= set(in_dev)
        # Some host slots are dropped (the tier demotes them): a later write-back may reuse
        # them while a load may still be reading.
        for h in rng.sample(sorted(host_held), rng.randrange(0, len(host_held) + 1) // 2):
            del host_held[h]
            host_free.add(h)
        # Its reads will see the loaded bytes (the copies ran in program order here).
        for d, want in expect.items():
            assert torch.equal(kv[:, :, d], want), d
        if rng.random() < skip_forward:
            # Swaps queued back to back, no forward and so no wait between them: the engine's
            # per-block order alone must keep the next swaps behind these.
            counts["bursts"] += 1
            continue
        # The forward: reads every live block, writes new tokens into fresh blocks.
        fresh = rng.sample(sorted(free), min(len(free), rng.randrange(0, 3)))
        _forward(world, eng, pool, sorted(live), fresh, rng)
        live |= set(fresh)
        free -= set(fresh)
        # Some sequences finish: their blocks are free without a write-back, and a later load
        # may fill them while this forward still reads them.
        done = rng.sample(sorted(live), min(len(live) - 1, rng.randrange(0, 3)))
        live -= set(done)
        free |= set(done)
    return counts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("staging", [2, 5, 16])
def test_swaps_and_forwards_have_no_unordered_access(monkeypatch, seed, staging):
    """Random write-backs, loads, host slots dropped and reused,
    blocks freed without a write-back and reloaded, steps whose swaps follow the last ones with
    no forward (no wait) between, and forwards: every pair of conflicting accesses is ordered,
    with events that complete (0.3) or never do (0.0)."""
    for completes in (0.0, 0.3):
        eng, pool = _engine(layers=3, blocks=24, host_blocks=20, staging=staging)
        world = World(cell=_cell(pool), seed=seed, completes=completes)
        with instrumented(world, monkeypatch):
            eng.is_cuda, eng.host.pinned = True, True
            eng._init_streams()
            counts = _workload(world, eng, pool, seed, steps=12, skip_forward=0.3)
        monkeypatch.undo()
        assert counts["out"] and counts["in"], counts
        assert world.num_accesses > 50


def test_the_detector_finds_a_missing_wait(monkeypatch):
    """The checker is not vacuous: a forward that skips the runner's wait is reported, and one
    that waits is not."""
    for skip in (True, False):
        eng, pool = _engine(layers=3, blocks=12, host_blocks=8, staging=4)
        world = World(cell=_cell(pool), seed=0, completes=0.0)
        with instrumented(world, monkeypatch):
            eng.is_cuda, eng.host.pinned = True, True
            eng._init_streams()
            eng.swap_out([(0, 0), (1, 1)])
            eng.synchronize()
            eng.swap_in([(0, 5), (1, 6)])
            read = ranges(pool.kv.view(torch.uint8)[0, 0, 5])
            if skip:
                with pytest.raises(Race, match="forward layer 0"):
                    world.access(world.default, read, [], "forward layer 0")
            else:
                eng.wait()
                world.access(world.default, read, [], "forward layer 0")
        monkeypatch.undo()
