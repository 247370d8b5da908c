"""The binding never reads memory Python can free, never deadlocks on its own lock, never aborts.

Each crash case (a read of freed memory, a panic that cannot unwind out of a numpy callback, a
thread waiting forever on a lock it holds, a failed allocation that aborts) takes the interpreter
down, so it runs in its own subprocess with a timeout: a crash or a hang fails the test, not the
run. The child prints ``CHILD-OK`` when every attack was either harmless or refused with a typed
error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import pagedkv
from pagedkv import _core
from pagedkv.errors import InvalidArgumentError

PACKAGE_ROOT = str(Path(pagedkv.__file__).resolve().parent.parent)

PRELUDE = """
import gc, sys, threading
import numpy as np
from pagedkv import _core
from pagedkv.errors import PagedKVError

def race(make, call, resize_to, iters):
    # `call(arr)` runs while another thread waits to resize `arr` in place: it gets the GIL as
    # soon as the call releases it. Arrays above 32 MiB are their own mapping, so a shrink
    # unmaps the pages the core would still be reading; a grow moves the data elsewhere.
    for _ in range(iters):
        arr = make()
        go = threading.Event()
        def resize():
            go.wait()
            arr.resize(resize_to, refcheck=False)
        t = threading.Thread(target=resize)
        t.start()
        go.set()
        try:
            call(arr)
        except PagedKVError as exc:
            print("refused:", type(exc).__name__, exc)
        t.join()
"""


def run_child(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = PACKAGE_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    script = PRELUDE + textwrap.dedent(body) + "\nprint('CHILD-OK')\n"
    try:
        return subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"child hung for {timeout} s (a deadlock)\nstdout:\n{exc.stdout}")


def assert_clean(proc: subprocess.CompletedProcess) -> None:
    detail = f"exit status {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, detail
    assert "CHILD-OK" in proc.stdout, detail


# ---------------------------------------------------------------- arrays resized during a call

BIG = 16 << 20  # tokens: 64 MiB of uint32


def test_hash_blocks_never_reads_a_freed_array() -> None:
    assert_clean(
        run_child(
            f"""
            race(lambda: np.arange({BIG}, dtype=np.uint32),
                 lambda a: _core.hash_blocks(a, 16, hash_seed=1), 16, 4)
            """
        )
    )


def test_admit_and_append_never_read_a_freed_array() -> None:
    assert_clean(
        run_child(
            f"""
            m = _core.BlockManager({BIG // 16 + 64}, 16, watermark_blocks=0,
                                   max_blocks_per_seq={BIG // 16 + 64},
                                   enable_prefix_caching=False)
            n = [0]
            def admit(a):
                n[0] += 1
                m.admit(n[0], a)
                m.free(n[0])
            race(lambda: np.arange({BIG}, dtype=np.uint32), admit, 16, 3)
            m.admit(0, [1])
            def append(a):
                m.append(0, a)
                m.free(0)
                m.admit(0, [1])
            race(lambda: np.arange({BIG}, dtype=np.uint32), append, 16, 3)
            m.check_invariants()
            """
        )
    )


def test_batch_calls_never_abort_when_an_array_moves() -> None:
    # Before, numpy's borrow tracking could not find the borrow of a moved array on release and
    # panicked inside an `extern "C"` callback: "panic in a function that cannot unwind".
    assert_clean(
        run_child(
            """
            m = _core.BlockManager(1 << 16, 16, watermark_blocks=0)
            seqs = 4096
            for s in range(seqs):
                m.admit(s, [1, 2, 3])
            race(lambda: np.arange(seqs, dtype=np.int64),
                 lambda a: m.append_batch(a, np.full(seqs, 7, dtype=np.uint32)), 1 << 22, 30)
            race(lambda: np.full(seqs, 7, dtype=np.uint32),
                 lambda a: m.append_batch(np.arange(seqs, dtype=np.int64), a), 1 << 22, 30)
            race(lambda: np.arange(seqs, dtype=np.int64),
                 lambda a: m.free_batch(a[:0]), 1 << 22, 4)
            m.check_invariants()
            """
        )
    )


def test_step_never_aborts_when_an_array_moves() -> None:
    assert_clean(
        run_child(
            """
            from pagedkv import StepBuffers
            seqs = 1024
            m = _core.BlockManager(1 << 15, 16, watermark_blocks=0)
            b = StepBuffers(seqs, seqs * 4, 64, device="cpu")
            m.attach_buffers(b._arena)
            for s in range(seqs):
                m.admit(s, [1, 2, 3])
            race(lambda: np.arange(seqs, dtype=np.int64), lambda a: m.step(a, 1), 1 << 22, 20)
            race(lambda: np.ones(seqs, dtype=np.uint32),
                 lambda a: m.step(np.arange(seqs, dtype=np.int64), a), 1 << 22, 20)
            m.check_invariants()
            """
        )
    )


def test_short_append_waiting_on_a_held_lock_never_aborts() -> None:
    # 31 tokens stay under the size at which the GIL is released, but a contended lock is waited
    # for with the GIL released too: the array could be moved during that wait.
    assert_clean(
        run_child(
            """
            m = _core.BlockManager(1 << 16, 16, watermark_blocks=0)
            for s in range(2048):
                m.admit(s, list(range(64)))
            m.admit(100000, [1])
            stop = threading.Event()
            def hold():
                while not stop.is_set():
                    m.check_invariants()
            h = threading.Thread(target=hold)
            h.start()
            race(lambda: np.arange(31, dtype=np.uint32),
                 lambda a: m.append(100000, a), 1 << 22, 40)
            stop.set()
            h.join()
            m.check_invariants()
            """
        )
    )


# ---------------------------------------------------------------- keyed pool


@pytest.mark.parametrize("which", ["keyed_pool", "block_manager"])
def test_gc_finalizer_touching_the_object_during_an_error_does_not_deadlock(which: str) -> None:
    # The cyclic GC can run while the exception is being built (here: at every allocation), and
    # its callbacks and finalizers may call the object back; its lock must already be free.
    assert_clean(
        run_child(
            f"""
            if {which!r} == "keyed_pool":
                obj = _core.KeyedBlockPool(8)
                touch = lambda: obj.num_free
                bad = lambda: obj.set_ref(10**6, 1)
            else:
                obj = _core.BlockManager(64, 16)
                touch = lambda: obj.num_free_blocks()
                bad = lambda: obj.free(12345)
            seen = [0]
            def callback(phase, info):
                if phase == "start":
                    seen[0] += 1
                    touch()
            gc.callbacks.append(callback)
            gc.set_threshold(1)
            for _ in range(20):
                try:
                    bad()
                except PagedKVError:
                    pass
            gc.callbacks.remove(callback)
            gc.set_threshold(700)
            assert seen[0] > 0
            """,
            timeout=30,
        )
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="address-space limit: Linux")
@pytest.mark.parametrize(
    ("blocks", "headroom_mib"),
    [
        # Only the key lists (96 MiB) fail to fit: the last array, before, built unguarded.
        (1 << 22, 100),
        # ~48 GiB of key lists; the accepted maximum.
        (2**31 - 1, 2048),
    ],
)
def test_keyed_pool_too_large_for_the_host_raises_allocation_failed(
    blocks: int, headroom_mib: int
) -> None:
    # The address space is capped so the outcome does not depend on the host's memory.
    assert_clean(
        run_child(
            f"""
            import resource
            from pagedkv.errors import AllocationFailedError
            vm = int([l.split()[1] for l in open("/proc/self/status") if l.startswith("VmSize")][0])
            cap = vm * 1024 + ({headroom_mib} << 20)
            resource.setrlimit(resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))
            try:
                _core.KeyedBlockPool({blocks})
            except AllocationFailedError as exc:
                assert exc.bytes >= {blocks} and "keyed pool" in exc.what, exc
            else:
                raise AssertionError("no error")
            assert _core.KeyedBlockPool(1024).num_free == 1023
            """
        )
    )


def test_keyed_pool_refuses_to_key_the_null_block() -> None:
    p = _core.KeyedBlockPool(4)
    with pytest.raises(InvalidArgumentError) as e:
        p.insert(b"k" * 8, 0)
    assert e.value.what == "block" and e.value.value == 0
    assert p.num_keys == 0 and p.lookup(b"k" * 8) is None and p.keys_of(0) == []
    p.check_invariants()
    # Without a reserved null block, block 0 is ordinary.
    q = _core.KeyedBlockPool(4, reserve_null=False)
    assert q.insert(b"k" * 8, 0) and q.lookup(b"k" * 8) == 0


def test_keyed_pool_keys_the_null_block_only_when_asked() -> None:
    # vLLM's drop-in asks (vLLM's own map keys any block its caller names); nothing else does.
    p = _core.KeyedBlockPool(4, null_keys=True)
    assert p.null_block == 0 and p.insert(b"k" * 8, 0) and p.lookup(b"k" * 8) == 0
    p.check_invariants()
    assert p.remove(b"k" * 8, 0) and p.num_keys == 0
    with pytest.raises(InvalidArgumentError):
        _core.KeyedBlockPool(4, null_keys=1)


@pytest.mark.parametrize(
    "call",
    [
        lambda p: p.insert("abc", 1),
        lambda p: p.insert(None, 1),
        lambda p: p.insert(bytearray(b"abc"), 1),
        lambda p: p.remove(7, 1),
        lambda p: p.contains(["a"], 1),
        lambda p: p.lookup(3),
        lambda p: p.lookup_groups("h", [0]),
    ],
)
def test_keyed_pool_key_type_errors_are_typed(call) -> None:
    p = _core.KeyedBlockPool(4)
    p.insert(b"ok", 1)
    before = (p.entries(), p.stats())
    with pytest.raises(InvalidArgumentError) as e:
        call(p)
    assert e.value.what in ("key", "hash") and "must be bytes" in str(e.value)
    assert (p.entries(), p.stats()) == before


# ---------------------------------------------------------------- list conversion


class _Clears:
    """An id whose ``__index__`` empties (or grows) the list it sits in."""

    def __init__(self, lst: list, grow: bool = False) -> None:
        self.lst, self.grow = lst, grow

    def __index__(self) -> int:
        if self.grow:
            self.lst.extend([1] * 100)
        else:
            self.lst.clear()
        return 1


@pytest.mark.parametrize("grow", [False, True])
def test_index_that_changes_the_list_being_read_is_a_typed_error(grow: bool) -> None:
    m = _core.BlockManager(64, 16, watermark_blocks=0)
    m.admit(1, [5])

    def evil() -> list:
        lst: list = list(range(40))
        lst[10] = _Clears(lst, grow)
        return lst

    calls = [
        lambda: m.admit(2, evil()),
        lambda: m.append(1, evil()),
        lambda: m.can_admit(evil()),
        lambda: _core.hash_blocks(evil(), 16, hash_seed=1),
        lambda: m.append_batch(evil(), [1] * 40),
        lambda: m.step(evil(), 1),
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError) as e:
            call()
        assert "changed size" in str(e.value)
    assert len(m) == 1 and m.seq_len(1) == 1 and 2 not in m
    m.check_invariants()


def test_array_values_out_of_range_still_name_the_element() -> None:
    m = _core.BlockManager(64, 16)
    a = np.arange(40, dtype=np.int64)
    a[17] = -3
    with pytest.raises(InvalidArgumentError) as e:
        m.admit(1, a)
    assert "element 17" in str(e.value) and e.value.value == -3
    b = np.arange(80, dtype=np.int64)
    b[6] = -100
    with pytest.raises(InvalidArgumentError) as e:
        m.admit(1, b[::2])  # strided: read element by element
    assert "element 3" in str(e.value) and e.value.value == -100
    assert len(m) == 0


# ---------------------------------------------------------------- step arena


def test_pinning_callback_that_reads_the_arena_does_not_deadlock() -> None:
    # `pin` calls into Python (the cudart module); code there that asks the arena whether it is
    # pinned must find its lock free.
    assert_clean(
        run_child(
            """
            arena = _core.StepArena(4, 16, 4, 4, False)
            seen = []
            class FakeCudart:
                def cudaHostRegister(self, addr, size, flags):
                    seen.append(arena.pinned)
                    return 0
                def cudaHostUnregister(self, addr):
                    return 0
            arena.pin(FakeCudart())
            assert seen == [False] and arena.pinned
            arena.pin(FakeCudart())
            assert seen == [False]
            """,
            timeout=30,
        )
    )
