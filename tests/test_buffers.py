"""StepBuffers: allocation, views, host-to-device copies, and registration with a manager."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from pagedkv import BlockManager, StepBuffers, StepInfo
from pagedkv.buffers import FIELDS
from pagedkv.errors import InvalidArgumentError



def test_field_list_is_the_extensions() -> None:
    """One list of field names: the binding's arena, the buffers' shapes and :data:`FIELDS`."""
    b = StepBuffers(2, 4, 2, device="cpu")
    assert tuple(b._arena.fields()) == FIELDS
    assert tuple(b._shapes()) == FIELDS
    assert tuple(name for name, _ in b.host.items()) == FIELDS


def _snapshot(m: BlockManager) -> tuple:
    return (m.stats(), len(m), m.num_free_blocks)


def test_shapes_dtypes_and_defaults() -> None:
    b = StepBuffers(4, 32, 8, device="cpu")
    h = b.host
    assert h.slot_mapping.shape == (32,) and h.slot_mapping.dtype == torch.int64
    assert h.block_tables.shape == (4, 8) and h.block_tables.dtype == torch.int32
    assert h.seq_lens.shape == (4,) and h.seq_lens.dtype == torch.int32
    assert h.query_start_loc.shape == (5,) and h.query_start_loc.dtype == torch.int32
    assert h.kv_indptr.shape == (5,) and h.kv_indptr.dtype == torch.int32
    assert h.kv_indices.shape == (32,) and h.kv_indices.dtype == torch.int32
    assert h.kv_last_page_len.shape == (4,) and h.kv_last_page_len.dtype == torch.int32
    # max_copies defaults to max_seqs.
    assert h.copies.shape == (4, 2) and h.copies.dtype == torch.int64
    assert b.max_copies == 4
    for name, t in h.items():
        assert t.device.type == "cpu", name
        assert t.is_contiguous(), name
        assert t.data_ptr() % 64 == 0, name
        assert not t.any(), name


def test_fields_do_not_overlap() -> None:
    b = StepBuffers(3, 7, 5, max_copies=2, device="cpu")
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for _, t in b.host.items()
    )
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start
    # Writing one field leaves the others zero.
    b.host.seq_lens.fill_(-1)
    for name, t in b.host.items():
        if name != "seq_lens":
            assert not t.any(), name


def test_cpu_device_mirrors_are_the_host_tensors() -> None:
    b = StepBuffers(2, 4, 2, device="cpu")
    assert not b.has_mirror
    for name in FIELDS:
        assert getattr(b.device, name) is getattr(b.host, name)
    info = StepInfo(num_seqs=1, num_tokens=2, num_kv_indices=1, num_copies=0, max_seq_len=2)
    v = b.to_device(info)
    assert v.slot_mapping.data_ptr() == b.host.slot_mapping.data_ptr()


def test_views_cut_to_the_step_extent_at_fixed_addresses() -> None:
    b = StepBuffers(4, 16, 3, max_copies=2, device="cpu")
    # One pair in each swap list too, so every field's view is non-empty (an empty view has no
    # address to compare).
    info = StepInfo(num_seqs=2, num_tokens=5, num_kv_indices=4, num_copies=1, max_seq_len=9,
                    num_swap_out=1, num_swap_in=1)
    v = b.views(info, on_device=False)
    assert v.slot_mapping.shape == (5,)
    assert v.block_tables.shape == (2, 3)
    assert v.seq_lens.shape == (2,)
    assert v.query_start_loc.shape == (3,)
    assert v.kv_indptr.shape == (3,)
    assert v.kv_indices.shape == (4,)
    assert v.kv_last_page_len.shape == (2,)
    assert v.copies.shape == (1, 2)
    for name in FIELDS:
        assert getattr(v, name).data_ptr() == getattr(b.host, name).data_ptr()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_seqs=0, max_tokens=4, max_blocks_per_seq=2),
        dict(max_seqs=2, max_tokens=-1, max_blocks_per_seq=2),
        dict(max_seqs=2, max_tokens=4, max_blocks_per_seq=0),
        dict(max_seqs=2, max_tokens=4, max_blocks_per_seq=2, max_copies=-1),
        dict(max_seqs=2.0, max_tokens=4, max_blocks_per_seq=2),
    ],
)
def test_bad_sizes_raise(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        StepBuffers(device="cpu", **kwargs)


def test_zero_copies_allowed_and_registers() -> None:
    b = StepBuffers(2, 4, 2, max_copies=0, device="cpu")
    assert b.host.copies.shape == (0, 2)
    m = BlockManager(8, 2)
    m.attach_buffers(b)
    m.admit(1, [1, 2, 3])
    info = m.step([1], 3)
    assert info.num_copies == 0


def test_attach_then_step_writes_host_buffers() -> None:
    m = BlockManager(16, 4, watermark_blocks=0)
    b = StepBuffers(2, 16, 4, device="cpu")
    m.attach_buffers(b)
    assert m.buffers is b
    m.admit(7, list(range(6)))
    info = m.step([7], 6)
    assert info == StepInfo(1, 6, 2, 0, 6, max_query_len=6)
    table = m.block_table(7)
    assert b.host.slot_mapping[:6].tolist() == [table[p // 4] * 4 + p % 4 for p in range(6)]
    assert b.host.block_tables[0, :2].tolist() == table
    assert b.host.seq_lens[0].item() == 6
    assert b.host.kv_last_page_len[0].item() == 2


def test_host_tensors_are_views_of_the_extension_arena() -> None:
    # What the core writes (the arena) is what `host` shows; the registration checks live in
    # tests/test_buffer_safety.py.
    b = StepBuffers(3, 7, 5, max_copies=2, device="cpu")
    base = b._arena.address
    for name, (offset, numel) in b._arena.fields().items():
        t = getattr(b.host, name)
        assert t.numel() == numel, name
        if numel:
            assert t.data_ptr() == base + offset, name
    assert b.nbytes == b._arena.nbytes


@pytest.mark.gpu
def test_pinned_host_and_stable_device_mirrors() -> None:
    m = BlockManager(64, 4, watermark_blocks=0)
    b = StepBuffers(4, 64, 8, max_copies=4)
    assert b.has_mirror and b.pinned
    for name, t in b.host.items():
        assert t.is_pinned(), name
    for name, t in b.device.items():
        assert t.is_cuda, name
    ptrs = {name: t.data_ptr() for name, t in b.device.items()}
    m.attach_buffers(b)
    for s in range(3):
        m.admit(s, list(range(5 + s)))
    info = m.step([0, 1, 2], [5, 6, 7])
    for step in range(6):
        dev = b.to_device(info)
        torch.cuda.synchronize()
        host = b.views(info, on_device=False)
        for name in FIELDS:
            assert torch.equal(getattr(dev, name).cpu(), getattr(host, name)), name
        assert {n: t.data_ptr() for n, t in b.device.items()} == ptrs
        m.append_batch([0, 1, 2], [step, step, step])
        info = m.step([0, 1, 2], 1)


def test_without_csr_the_page_table_is_skipped() -> None:
    m = BlockManager(32, 4, watermark_blocks=0)
    b = StepBuffers(2, 16, m.max_blocks_per_seq, device="cpu", csr=False)
    for name in ("kv_indptr", "kv_indices", "kv_last_page_len"):
        assert getattr(b.host, name).numel() == 0
    m.attach_buffers(b)
    m.admit(1, list(range(6)))
    info = m.step([1], 6)
    assert info.num_kv_indices == 0 and info.num_tokens == 6
    table = m.block_table(1)
    assert b.host.slot_mapping[:6].tolist() == [table[p // 4] * 4 + p % 4 for p in range(6)]
    assert b.host.block_tables[0, :2].tolist() == table
    v = b.to_device(info)
    assert v.kv_indices.numel() == 0 and v.kv_indptr.numel() == 0


def test_copy_spans_cover_every_used_byte() -> None:
    b = StepBuffers(64, 256, 512, max_copies=8, device="cpu")
    info = StepInfo(num_seqs=3, num_tokens=40, num_kv_indices=17, num_copies=2, max_seq_len=99)
    spans = b.copy_spans(info)
    base = b.host.slot_mapping.untyped_storage().data_ptr()

    def covered(t: torch.Tensor) -> bool:
        if t.numel() == 0:
            return True
        start = t.data_ptr() - base
        end = start + t.numel() * t.element_size()
        return any(a <= start and end <= z for a, z in spans)

    for name, t in b.views(info, on_device=False).items():
        assert covered(t), name
    # Spans are disjoint, ordered, and inside the arena.
    for (a, z), (a2, _) in zip(spans, spans[1:]):
        assert z < a2
    assert spans[0][0] >= 0 and spans[-1][1] <= b.nbytes
    # The small fields and slot mapping coalesce; the 64x512 block table rows lie 128 KiB on.
    assert len(spans) <= 3
    # An empty batch still has query_start_loc[0] and kv_indptr[0]: one short span.
    spans = b.copy_spans(StepInfo(0, 0, 0, 0, 0))
    assert len(spans) == 1 and spans[0][1] - spans[0][0] < 1024
    for name, t in b.views(StepInfo(0, 0, 0, 0, 0), on_device=False).items():
        assert covered(t), name


def test_views_follow_changing_extents() -> None:
    b = StepBuffers(8, 32, 4, max_copies=3, device="cpu")
    for s, t, k, c in [(2, 5, 3, 0), (2, 5, 4, 1), (3, 9, 4, 1), (2, 5, 3, 0), (8, 32, 32, 3)]:
        v = b.views(StepInfo(s, t, k, c, 1), on_device=False)
        assert v.slot_mapping.shape == (t,)
        assert v.block_tables.shape == (s, 4)
        assert v.query_start_loc.shape == (s + 1,) and v.kv_indptr.shape == (s + 1,)
        assert v.kv_indices.shape == (k,)
        assert v.copies.shape == (c, 2)
    # Replacing a host tensor (as the registration tests do) is seen by the next cut.
    b.host = b.host._replace(seq_lens=torch.arange(8, dtype=torch.int32))
    assert b.views(StepInfo(2, 5, 3, 0, 1), on_device=False).seq_lens.tolist() == [0, 1]


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_views_and_copy_spans_refuse_bad_step_infos(backend: str) -> None:
    b = StepBuffers(8, 32, 4, max_copies=3, max_swaps=2, device="cpu", backend=backend)
    good = StepInfo(2, 5, 3, 1, 7)
    before = b.views(good, on_device=False)
    spans = b.copy_spans(good)
    bad = [
        (None, "info"),
        ("not a step", "info"),
        (StepInfo(-1, 5, 3, 1, 7), "info.num_seqs"),
        (StepInfo(9, 5, 3, 1, 7), "info.num_seqs"),
        (StepInfo(2, -3, 3, 1, 7), "info.num_tokens"),
        (StepInfo(2, 33, 3, 1, 7), "info.num_tokens"),
        (StepInfo(2, 5, 33, 1, 7), "info.num_kv_indices"),
        (StepInfo(2, 5, -1, 1, 7), "info.num_kv_indices"),
        (StepInfo(2, 5, 3, 4, 7), "info.num_copies"),
        (StepInfo(2, 5, 3, -1, 7), "info.num_copies"),
        (StepInfo(2, 5, 3, 1, 7, 3, 0), "info.num_swap_out"),
        (StepInfo(2, 5, 3, 1, 7, 0, -2), "info.num_swap_in"),
        (StepInfo(2, 5.0, 3, 1, 7), "info.num_tokens"),
    ]
    for info, what in bad:
        for call in (lambda: b.views(info, on_device=False), lambda: b.copy_spans(info)):
            with pytest.raises(InvalidArgumentError) as e:
                call()
            assert e.value.what == what, (info, e.value)
            if what != "info":
                assert str(e.value.value) in str(e.value) and "[0, " in str(e.value)
    # Nothing was cut or cached for the bad ones: the good step still gets its views and spans.
    after = b.views(good, on_device=False)
    assert all(x.shape == y.shape for x, y in zip(before, after))
    assert b.copy_spans(good) == spans
    # Without the CSR table there is no room for a kv index at all.
    plain = StepBuffers(8, 32, 4, device="cpu", csr=False, backend=backend)
    with pytest.raises(InvalidArgumentError, match="num_kv_indices"):
        plain.views(StepInfo(2, 5, 1, 0, 7))
    assert plain.views(StepInfo(2, 5, 0, 0, 7)).slot_mapping.shape == (5,)


# ---------------------------------------------------------------------------- numpy backend


def test_numpy_backend_arrays_share_the_torch_layout() -> None:
    b = StepBuffers(3, 7, 5, max_copies=2, device="cpu", backend="numpy")
    t = StepBuffers(3, 7, 5, max_copies=2, device="cpu", backend="torch")
    assert (b.backend, t.backend) == ("numpy", "torch")
    assert not b.has_mirror and not b.pinned and b.mirror_device == "cpu"
    assert "backend='numpy'" in repr(b)
    base = b._arena.address
    for (name, a), (_, ref) in zip(b.host.items(), t.host.items()):
        assert isinstance(a, np.ndarray), name
        assert a.shape == tuple(ref.shape), name
        assert a.dtype == ref.numpy().dtype, name
        assert a.flags.c_contiguous and a.flags.writeable and not a.flags.owndata, name
        assert a.ctypes.data % 64 == 0 and not a.any(), name
        if a.size:
            assert a.ctypes.data == base + b._arena.fields()[name][0], name
        # Views of extension-owned memory: numpy refuses to resize (reallocate) them.
        with pytest.raises(ValueError):
            a.resize(a.size + 1000, refcheck=False)
        assert getattr(b.device, name) is a, name


def test_numpy_backend_steps_match_the_torch_backend() -> None:
    outs = []
    for backend in ("numpy", "torch"):
        m = BlockManager(32, 4, watermark_blocks=0)
        b = StepBuffers(4, 32, m.max_blocks_per_seq, max_copies=2, device="cpu", backend=backend)
        m.attach_buffers(b)
        m.admit(1, list(range(9)))
        m.admit(2, list(range(50, 55)))
        infos = [m.step([1, 2], [9, 5])]
        m.fork(1, 3)
        m.append_batch([1, 3, 2], [1, 2, 3])
        infos.append(m.step([3, 1, 2], 1))
        views = b.to_device(infos[-1])
        assert isinstance(views.slot_mapping, np.ndarray if backend == "numpy" else torch.Tensor)
        outs.append((infos, {n: np.asarray(v).tolist() for n, v in views.items()},
                     {s: m.block_table(s) for s in (1, 2, 3)}))
    (infos, views, tables), ref = outs
    assert (infos, views, tables) == ref
    assert infos[-1].num_copies == 1 and infos[-1].max_query_len == 1
    B = 4
    want = [tables[s][p // B] * B + p % B for s, p in ((3, 9), (1, 9), (2, 5))]
    assert views["slot_mapping"] == want
    assert [row[: len(tables[s])] for row, s in zip(views["block_tables"], (3, 1, 2))] == [
        tables[3], tables[1], tables[2]]


def test_default_backend_is_torch_when_installed() -> None:
    assert StepBuffers(2, 4, 2, device="cpu").backend == "torch"
    assert StepBuffers(2, 4, 2, device=torch.device("cpu"), backend="numpy").backend == "numpy"


@pytest.mark.parametrize(
    "kwargs, what",
    [
        (dict(backend="jax"), "backend"),
        (dict(backend=1), "backend"),
        (dict(backend="numpy", device="cuda"), "device"),
        (dict(backend="numpy", device=torch.device("cuda", 0)), "device"),
    ],
)
def test_bad_backend_arguments_raise(kwargs: dict, what: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        StepBuffers(2, 4, 2, **kwargs)
    assert info.value.what == what
