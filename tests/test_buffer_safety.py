"""Step buffers the core writes into cannot be freed, resized or forged from Python.

The manager's ``step`` writes through the addresses of the attached host buffers with the GIL
released. Each attack below used to make it write freed or foreign memory; a crash there takes the
interpreter down, so every attack runs in its own subprocess and the test checks that the child
exited cleanly and that its steps still wrote what the manager says.

Also covered: one buffer set belongs to one manager at a time, so a manager's incremental
block-table rows can never name another manager's blocks; and the host memory is owned by the
extension (views that keep it alive, non-resizable storage).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import pagedkv
from pagedkv import BlockManager, StepBuffers
from pagedkv.errors import BufferInvalidError, InvalidArgumentError, PagedKVError

PACKAGE_ROOT = str(Path(pagedkv.__file__).resolve().parent.parent)

# A buffer set large enough that its arena is its own mmap (glibc serves allocations above 128 KiB
# that way): freeing it unmaps the pages, so a write through a stale pointer faults instead of
# silently landing in the heap.
PRELUDE = """
import gc, sys, types
import torch
from pagedkv import BlockManager, StepBuffers
from pagedkv.errors import PagedKVError

def manager():
    return BlockManager(4096, 16, watermark_blocks=0)

def big_buffers():
    return StepBuffers(256, 8192, 512, device="cpu")

def run_steps(m, b=None):
    ids = list(range(64))
    for s in ids:
        if s not in m:
            m.admit(s, list(range(100)))
    for _ in range(5):
        info = m.step(ids, 100)
        assert info.num_seqs == 64 and info.num_tokens == 6400, info
    if b is not None:
        host = b.host
        for s in (0, 17, 63):
            table = m.block_table(s)
            assert host.block_tables[s, : len(table)].tolist() == table
            assert host.seq_lens[s].item() == 100
        assert host.slot_mapping[100 * 63].item() == m.block_table(63)[0] * 16

def attack(fn):
    # An attack may be refused with any exception; what matters is what the next steps do.
    try:
        fn()
    except Exception as exc:
        print("refused:", type(exc).__name__, exc)
"""


def run_child(body: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = PACKAGE_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    script = PRELUDE + textwrap.dedent(body) + "\nprint('CHILD-OK')\n"
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )


def assert_clean(proc: subprocess.CompletedProcess) -> None:
    detail = f"exit status {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, detail
    assert "CHILD-OK" in proc.stdout, detail


def test_storage_resized_to_zero_cannot_free_registered_memory() -> None:
    assert_clean(
        run_child(
            """
            m, b = manager(), big_buffers()
            m.attach_buffers(b)
            attack(lambda: b.host.slot_mapping.untyped_storage().resize_(0))
            attack(lambda: b.host.block_tables.untyped_storage().resize_(0))
            gc.collect()
            run_steps(m, b)
            """
        )
    )


def test_growing_a_host_tensor_cannot_reallocate_registered_memory() -> None:
    assert_clean(
        run_child(
            """
            m, b = manager(), big_buffers()
            m.attach_buffers(b)
            attack(lambda: b.host.seq_lens.resize_(10_000_000))
            attack(lambda: b.host.kv_indices.resize_(50_000_000))
            gc.collect()
            run_steps(m, b)
            """
        )
    )


def test_dropping_the_buffers_cannot_unmap_registered_memory() -> None:
    assert_clean(
        run_child(
            """
            m, b = manager(), big_buffers()
            # The extension itself must offer no way to register memory by address: a raw
            # registration whose owner is then dropped is exactly a write into unmapped pages.
            raw = getattr(m._core, "register_buffers", None)
            if raw is not None:
                ptrs = [(t.data_ptr(), t.numel(), str(t.dtype)) for _, t in b.host.items()]
                attack(lambda: raw(256, 8192, 512, b.max_copies, *ptrs, keepalive=None))
            else:
                m.attach_buffers(b)
            del b
            gc.collect()
            run_steps(m)
            # The manager keeps what it writes alive: the same through the public path.
            m2, b2 = manager(), big_buffers()
            m2.attach_buffers(b2)
            host = b2.host
            del b2
            gc.collect()
            run_steps(m2)
            # ... and detaching lets the memory go only once nothing refers to it.
            m2.detach_buffers() if hasattr(m2, "detach_buffers") else None
            gc.collect()
            assert host.block_tables[0, 0].item() == m2.block_table(0)[0]
            """
        )
    )


def test_forged_data_ptr_is_never_written_through() -> None:
    assert_clean(
        run_child(
            """
            class Forged:
                # Looks enough like a host tensor to pass a duck-typed check; points at low pages
                # nothing maps.
                def __init__(self, t, address):
                    self.t, self.device, self.dtype, self.address = t, t.device, t.dtype, address
                def data_ptr(self):
                    return self.address
                def numel(self):
                    return self.t.numel()
                def is_contiguous(self):
                    return True
                def stride(self):
                    return self.t.stride()

            m, b = manager(), big_buffers()
            b.host = b.host._replace(slot_mapping=Forged(b.host.slot_mapping, 0x1000),
                                     block_tables=Forged(b.host.block_tables, 0x1000000))
            attack(lambda: m.attach_buffers(b))
            if m.buffers is not None:
                run_steps(m)
            # A duck-typed buffer set with forged tensors and no extension-owned memory.
            fake = types.SimpleNamespace(
                host=b.host, max_seqs=256, max_tokens=8192, max_blocks_per_seq=512,
                max_copies=256, csr=True)
            m2 = manager()
            attack(lambda: m2.attach_buffers(fake))
            if m2.buffers is not None:
                run_steps(m2)
            """
        )
    )


def test_buffers_attached_to_a_second_manager_never_hold_stale_rows() -> None:
    # m1 writes row 0 for its sequence 1; m2 (whose sequence 1 holds other block ids) then writes
    # its own row 0 into the same memory. m1's next step writes row 0 incrementally: if it still
    # believed its earlier entries were in place, the row would name m2's blocks.
    m1 = BlockManager(64, 4, watermark_blocks=0)
    m2 = BlockManager(64, 4, watermark_blocks=0)
    b = StepBuffers(2, 64, 16, device="cpu")
    m1.attach_buffers(b)
    m1.admit(1, list(range(8)))
    m1.step([1], 8)
    m2.admit(99, list(range(40)))
    m2.admit(1, list(range(8)))
    assert set(m2.block_table(1)).isdisjoint(m1.block_table(1))
    try:
        m2.attach_buffers(b)
    except PagedKVError:
        pass
    else:
        m2.step([1], 8)
    m1.append(1, [8])
    info = m1.step([1], 1)
    table = m1.block_table(1)
    assert info.num_seqs == 1 and len(table) == 3
    assert b.host.block_tables[0, :3].tolist() == table


def test_a_buffer_set_belongs_to_one_manager_at_a_time() -> None:
    m1 = BlockManager(64, 4, watermark_blocks=0)
    m2 = BlockManager(64, 4, watermark_blocks=0)
    b = StepBuffers(2, 64, 16, device="cpu")
    m1.attach_buffers(b)
    m1.attach_buffers(b)  # attaching again to the same manager is fine
    with pytest.raises(BufferInvalidError) as info:
        m2.attach_buffers(b)
    assert "another" in str(info.value)
    assert m2.buffers is None and not m2._core.has_buffers
    # Released by detaching: then m2 may take it, and m1 may not.
    m1.admit(1, list(range(8)))
    m1.step([1], 8)
    m1.detach_buffers()
    assert m1.buffers is None
    m2.admit(99, list(range(40)))
    m2.admit(1, list(range(8)))
    m2.attach_buffers(b)
    m2.step([1], 8)
    assert b.host.block_tables[0, :2].tolist() == m2.block_table(1)
    with pytest.raises(BufferInvalidError):
        m1.attach_buffers(b)
    # Released when the owner is dropped; the next owner's first step rewrites its rows in full.
    # (`info` holds a traceback whose frames still refer to m2.)
    del m2, info
    gc.collect()
    m1.attach_buffers(b)
    m1.append(1, [8])
    m1.step([1], 1)
    assert b.host.block_tables[0, :3].tolist() == m1.block_table(1)
    # Released when the owner moves to another buffer set.
    m3 = BlockManager(64, 4, watermark_blocks=0)
    m1.attach_buffers(StepBuffers(2, 64, 16, device="cpu"))
    m3.attach_buffers(b)


def test_failed_attach_keeps_the_earlier_registration() -> None:
    m1 = BlockManager(64, 4, watermark_blocks=0)
    m2 = BlockManager(64, 4, watermark_blocks=0)
    mine, theirs = StepBuffers(2, 64, 16, device="cpu"), StepBuffers(2, 64, 16, device="cpu")
    m1.attach_buffers(mine)
    m2.attach_buffers(theirs)
    with pytest.raises(BufferInvalidError):
        m1.attach_buffers(theirs)
    assert m1.buffers is mine
    m1.admit(1, list(range(5)))
    m1.step([1], 5)
    assert mine.host.seq_lens[0].item() == 5


def test_host_memory_is_owned_by_the_extension_and_not_resizable() -> None:
    b = StepBuffers(4, 64, 8, device="cpu")
    for name, t in b.host.items():
        with pytest.raises(RuntimeError, match="not resizable"):
            t.untyped_storage().resize_(0)
        if t.numel():
            with pytest.raises(RuntimeError, match="not resizable"):
                t.resize_(t.numel() * 1000)
    arena = b._arena
    assert isinstance(arena, pagedkv._core.StepArena)
    assert arena.nbytes >= b.nbytes
    # numpy views of the arena have the arena object as their base and cannot be resized either.
    arr = arena.array()
    assert arr.base is arena and arr.flags.writeable and not arr.flags.owndata
    with pytest.raises(ValueError):
        arr.resize(1)
    host = b.host.seq_lens.untyped_storage().data_ptr()
    assert host == arr.ctypes.data == arena.address


def test_views_keep_the_arena_alive() -> None:
    import weakref

    b = StepBuffers(2, 8, 2, device="cpu")
    ref = weakref.ref(b._arena)
    seq_lens = b.host.seq_lens
    del b
    gc.collect()
    assert ref() is not None
    seq_lens.fill_(3)
    assert seq_lens.tolist() == [3, 3]
    del seq_lens
    gc.collect()
    assert ref() is None


def test_manager_keeps_the_arena_alive_until_detached() -> None:
    import weakref

    m = BlockManager(16, 4, watermark_blocks=0)
    b = StepBuffers(2, 16, 4, device="cpu")
    ref = weakref.ref(b._arena)
    m.attach_buffers(b)
    del b
    gc.collect()
    assert ref() is not None
    m.admit(1, [1, 2, 3])
    m.step([1], 3)
    assert m.buffers.host.seq_lens[0].item() == 3
    m.detach_buffers()
    gc.collect()
    assert ref() is None
    assert m.buffers is None


def test_no_public_path_takes_an_address() -> None:
    assert not hasattr(pagedkv._core.BlockManager, "register_buffers")
    m = pagedkv._core.BlockManager(8, 4, 0)
    for bad in (None, 0x1000, (0x1000, 16, "int64"), np.zeros(64, dtype=np.uint8), object()):
        with pytest.raises(InvalidArgumentError):
            m.attach_buffers(bad)
    assert not m.has_buffers


@pytest.mark.parametrize("bad", [None, 0, "buffers", object()])
def test_attach_buffers_rejects_non_buffers(bad: object) -> None:
    m = BlockManager(8, 4)
    with pytest.raises(InvalidArgumentError):
        m.attach_buffers(bad)  # type: ignore[arg-type]
    assert m.buffers is None


def test_replacing_host_tensors_does_not_redirect_the_core() -> None:
    # `host` is a convenience view; the core writes the arena whatever Python rebinds it to.
    m = BlockManager(16, 4, watermark_blocks=0)
    b = StepBuffers(2, 16, 4, device="cpu")
    arena_seq_lens = b.host.seq_lens
    b.host = b.host._replace(seq_lens=torch.zeros(2, dtype=torch.int64))
    m.attach_buffers(b)
    m.admit(1, [1, 2, 3, 4, 5])
    m.step([1], 5)
    assert arena_seq_lens[0].item() == 5
    assert b.host.seq_lens[0].item() == 0


def test_step_arena_allocation_failure_is_typed() -> None:
    from pagedkv.errors import AllocationFailedError

    # 2**31 - 1 rows of 2**31 - 1 blocks: far beyond any address space.
    with pytest.raises(AllocationFailedError) as info:
        StepBuffers(2**31 - 1, 16, 2**31 - 1, device="cpu")
    assert isinstance(info.value, PagedKVError) and isinstance(info.value, MemoryError)
    assert info.value.bytes > 2**60 and "step buffers" in info.value.what
    # Large but addressable: refused by the allocator, not by arithmetic.
    with pytest.raises(AllocationFailedError) as info:
        StepBuffers(2**20, 16, 2**25, device="cpu", csr=False)
    assert info.value.bytes >= 2**20 * 2**25 * 4


@pytest.mark.gpu
def test_arena_is_pinned_with_cuda() -> None:
    b = StepBuffers(4, 64, 8)
    assert b.pinned
    for name, t in b.host.items():
        if t.numel():
            assert t.is_pinned(), name
    m = BlockManager(64, 4, watermark_blocks=0)
    m.attach_buffers(b)
    m.admit(1, list(range(9)))
    info = m.step([1], 9)
    dev = b.to_device(info)
    torch.cuda.synchronize()
    assert dev.slot_mapping.cpu().tolist() == b.views(info, on_device=False).slot_mapping.tolist()


@pytest.mark.gpu
def test_pinned_arena_is_unpinned_before_it_is_freed() -> None:
    # The allocator hands freed ranges out again; a range still registered with CUDA would make
    # the next cudaHostRegister fail (and the pin raise AllocationFailedError).
    m = BlockManager(4096, 16, watermark_blocks=0)
    m.admit(1, list(range(100)))
    addresses = set()
    for _ in range(20):
        b = StepBuffers(256, 8192, 512)
        assert b.pinned
        addresses.add(b._arena.address)
        m.attach_buffers(b)
        info = m.step([1], 100)
        b.to_device(info, non_blocking=True)
        m.detach_buffers()
        del b
        gc.collect()
    torch.cuda.synchronize()
    assert len(addresses) < 20  # ranges were reused, so unregistering was exercised
