"""One manager called from many Python threads: calls are serialized, never refused.

The extension locks the manager for each call and waits for the lock with the GIL released, so a
thread stepping a large batch (GIL released) and threads reading ``stats()`` or admitting never see
an error that a single thread would not see, and never deadlock. What each test checks afterwards:
the core's invariants hold, every thread's own sequences have exactly the lengths it gave them, and
once everything is freed every block is back (none lost, none handed out twice).
"""

from __future__ import annotations

import random
import sys
import threading
import time

import numpy as np

from pagedkv import BlockManager, StepBuffers
from pagedkv.errors import (
    OutOfBlocksError,
    SequenceTooLongError,
    UnknownSequenceError,
)

THREADS = 4
CALLS_PER_THREAD = 100_000
BLOCK = 4
NUM_BLOCKS = 2048

# Shared prompt prefixes, so admissions from different threads hit each other's cached blocks.
PROMPTS = [[(p * 7 + i) % 50 for i in range(64)] for p in range(6)]

# What a caller may see from a race with another thread's calls (documented, typed): another
# thread's sequence freed under a query, the pool full, a sequence outgrowing its row.
EXPECTED = (UnknownSequenceError, OutOfBlocksError, SequenceTooLongError)


def _worker(m: BlockManager, tid: int, calls: int, live: dict, errors: list) -> None:
    rng = random.Random(1000 + tid)
    next_id = (tid + 1) << 40
    others = [(t + 1) << 40 for t in range(THREADS)]
    typed = 0
    try:
        for _ in range(calls):
            op = rng.random()
            try:
                if op < 0.12 or not live:
                    sid, next_id = next_id, next_id + 1
                    prompt = PROMPTS[rng.randrange(len(PROMPTS))][: rng.randrange(1, 64)]
                    m.admit(sid, prompt)
                    live[sid] = len(prompt)
                elif op < 0.40:
                    sid = rng.choice(list(live))
                    k = rng.randrange(1, 4)
                    m.append(sid, [rng.randrange(100) for _ in range(k)])
                    live[sid] += k
                elif op < 0.50:
                    batch = rng.sample(list(live), min(len(live), rng.randrange(1, 9)))
                    m.append_batch(np.array(batch, dtype=np.uint64), [1] * len(batch))
                    for s in batch:
                        live[s] += 1
                elif op < 0.60:
                    batch = rng.sample(list(live), min(len(live), rng.randrange(1, 9)))
                    info = m.step(batch, 1)
                    assert info.num_seqs == len(batch)
                elif op < 0.66:
                    parent = rng.choice(list(live))
                    sid, next_id = next_id, next_id + 1
                    m.fork(parent, sid)
                    live[sid] = live[parent]
                elif op < 0.78:
                    sid = rng.choice(list(live))
                    m.free(sid)
                    del live[sid]
                elif op < 0.86:
                    s = m.stats()
                    assert 0 <= s.used_blocks <= NUM_BLOCKS
                elif op < 0.93:
                    probe = rng.choice(others) + rng.randrange(64)
                    _ = probe in m
                    _ = len(m)
                else:
                    probe = rng.choice(others) + rng.randrange(64)
                    m.seq_len(probe)
            except EXPECTED:
                typed += 1
                if len(live) > 8:
                    # Make room: the pool is shared by every thread.
                    for sid in rng.sample(list(live), len(live) // 2):
                        m.free(sid)
                        del live[sid]
        for sid, n in live.items():
            assert m.seq_len(sid) == n, (sid, m.seq_len(sid), n)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append((tid, repr(exc)))


def test_many_threads_mixed_calls_are_serialized() -> None:
    m = BlockManager(NUM_BLOCKS, BLOCK, watermark_blocks=16)
    m.attach_buffers(StepBuffers(16, 64, m.max_blocks_per_seq, device="cpu"))
    lives: list[dict] = [{} for _ in range(THREADS)]
    errors: list = []
    old = sys.getswitchinterval()
    # Switch threads often, so calls interleave at every point where the GIL can change hands.
    sys.setswitchinterval(1e-5)
    try:
        threads = [
            threading.Thread(target=_worker, args=(m, t, CALLS_PER_THREAD, lives[t], errors))
            for t in range(THREADS)
        ]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        elapsed = time.perf_counter() - t0
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    m.check_invariants()
    live = {sid: n for d in lives for sid, n in d.items()}
    assert len(m) == len(live)
    for sid, n in live.items():
        assert m.seq_len(sid) == n
    # Drain pending copy-on-write sources, then free everything: every block must come back.
    ids = list(live)
    for i in range(0, len(ids), 16):
        m.step(ids[i : i + 16], 1)
    for sid in ids:
        m.free(sid)
    m.check_invariants()
    s = m.stats()
    assert len(m) == 0 and s.used_blocks == 0 and s.num_seqs == 0
    assert m.num_free_blocks == NUM_BLOCKS
    assert s.free_blocks + s.cached_free_blocks == NUM_BLOCKS
    print(f"{THREADS} threads x {CALLS_PER_THREAD} calls in {elapsed:.1f} s")


def test_reads_never_fail_during_long_steps() -> None:
    # The writer's steps and admissions are long enough to run with the GIL released; the reader
    # polls throughout and must only ever get answers.
    m = BlockManager(1 << 15, 16, watermark_blocks=0)
    m.attach_buffers(StepBuffers(256, 256 * 512, 64, device="cpu"))
    stop = threading.Event()
    seen: list = []
    failures: list = []

    def reader() -> None:
        try:
            while not stop.is_set():
                s = m.stats()
                seen.append(s.num_seqs)
                _ = 3 in m
                _ = m.num_free_blocks
        except BaseException as exc:  # noqa: BLE001
            failures.append(repr(exc))

    def writer() -> None:
        try:
            ids = np.arange(256, dtype=np.int64)
            for rnd in range(20):
                for s in ids:
                    m.admit(int(s), np.arange(rnd, rnd + 512, dtype=np.int64))
                m.step(ids, 512)
                for _ in range(8):
                    m.append_batch(ids, np.full(256, 7, dtype=np.int64))
                    m.step(ids, 1)
                for s in ids:
                    m.free(int(s))
        except BaseException as exc:  # noqa: BLE001
            failures.append(repr(exc))
        finally:
            stop.set()

    threads = [threading.Thread(target=reader) for _ in range(3)] + [
        threading.Thread(target=writer)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures
    assert seen
    m.check_invariants()
    assert len(m) == 0


def test_reentrant_call_from_argument_conversion_does_not_deadlock() -> None:
    # Converting an argument can run Python code (`__index__`); that code may call the same manager.
    # Conversion happens before the lock is taken, so this must neither deadlock nor be refused.
    m = BlockManager(64, 4, watermark_blocks=0)
    calls = []

    class Token:
        def __init__(self, v: int) -> None:
            self.v = v

        def __index__(self) -> int:
            calls.append(m.stats().num_seqs)
            _ = 1 in m
            return self.v

    done = threading.Event()
    failures: list = []

    def run() -> None:
        try:
            m.admit(1, [Token(5), Token(6), Token(7)])
            m.append(1, [Token(8)])
            m.admit(Token(2), [1, 2])
        except BaseException as exc:  # noqa: BLE001
            failures.append(repr(exc))
        finally:
            done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert done.wait(30), "deadlocked"
    assert not failures, failures
    assert m.seq_len(1) == 4 and m.seq_len(2) == 2 and len(calls) == 5


def test_errors_raised_under_contention_are_the_typed_ones() -> None:
    # Two threads racing to admit and free the same ids: each call either succeeds or raises the
    # error a sequential interleaving would give (duplicate / unknown), never anything else.
    from pagedkv.errors import DuplicateSequenceError

    m = BlockManager(256, 4, watermark_blocks=0)
    failures: list = []
    counts = {"ok": 0, "typed": 0}
    lock = threading.Lock()

    def run(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(20_000):
                sid = rng.randrange(8)
                try:
                    if rng.random() < 0.5:
                        m.admit(sid, [1, 2, 3, 4, 5])
                    else:
                        m.free(sid)
                    with lock:
                        counts["ok"] += 1
                except (DuplicateSequenceError, UnknownSequenceError, OutOfBlocksError):
                    with lock:
                        counts["typed"] += 1
        except BaseException as exc:  # noqa: BLE001
            failures.append(repr(exc))

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures
    assert counts["ok"] + counts["typed"] == 80_000
    m.check_invariants()
    for sid in range(8):
        if sid in m:
            m.free(sid)
    assert m.num_free_blocks == 256
