"""The core's decode planner (`_core.plan_decode`) against the numpy reference `plan_host`.

`DecodePlan.update` writes its host buffer through the core; before, it wrote the arrays of
`plan_host` (count, indptr, items). These check the two write the same bytes for any lengths
(zeros, negatives, huge values, every integer dtype, strided and byte-swapped arrays, an empty
batch and a full one), that `update` fills the device buffer and its fields as before, and that
bad buffers raise typed errors and leave the buffer as it was. No kernel runs here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedkv import _core
from pagedkv import errors as E
from pagedkv import decode_plan as D

INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


def reference_words(plan, lens, base: np.ndarray):
    """`base` with what the numpy path of `update` wrote into it: (words, n_items, chunk)."""
    chunk, items, indptr = plan.plan_host(lens)
    h = base.copy()
    m, n = items.shape[0], len(indptr) - 1
    h[0] = m
    h[1 : 2 + n] = indptr
    h[plan.items_off : plan.items_off + 4 * m] = items.reshape(-1)
    return h, m, chunk


def core_plan(plan, lens, out):
    return _core.plan_decode(lens, out, plan.num_kv_heads, plan.programs, plan.min_chunk,
                             plan.granule, plan.items_off, plan.capacity)


def _fresh(plan: D.DecodePlan, seed: int) -> np.ndarray:
    # Stale words from an earlier step: only the words a plan writes may change.
    return np.random.default_rng(seed).integers(-9, 9, plan._host_np[0].shape, dtype=np.int32)


LENGTH = st.one_of(
    st.integers(0, 64),
    st.integers(0, 20_000),
    st.just(0),
    st.integers(-(1 << 40), -1),
    st.integers(1 << 29, 1 << 31),
    st.integers(-(1 << 63), (1 << 63) - 1),
)

PLANS = st.builds(
    lambda max_seqs, kv, group, head_dim, programs, min_chunk: D.DecodePlan(
        max_seqs, kv * group, kv, head_dim, device="cpu", programs=programs, min_chunk=min_chunk
    ),
    max_seqs=st.integers(1, 300),
    kv=st.sampled_from([1, 2, 4, 8]),
    group=st.sampled_from([1, 4]),
    head_dim=st.sampled_from([32, 64, 128, 256]),
    programs=st.one_of(st.integers(1, 64), st.integers(1, 1200), st.just(528)),
    min_chunk=st.one_of(st.integers(1, 300), st.just(256), st.integers(1, 1 << 20)),
)


@st.composite
def plan_and_lens(draw):
    plan = draw(PLANS)
    n = draw(st.one_of(st.integers(0, plan.max_num_seqs), st.just(plan.max_num_seqs),
                       st.just(0)))
    dtype = draw(st.sampled_from(INT_DTYPES))
    raw = draw(st.lists(LENGTH, min_size=n, max_size=n))
    # Wrapped into the dtype's range as numpy's cast would, so every dtype sees big and
    # negative values too.
    lens = np.array([v & ((1 << 64) - 1) for v in raw], dtype=np.uint64).astype(dtype)
    return plan, lens


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=plan_and_lens(), seed=st.integers(0, 2**32 - 1))
def test_core_writes_the_reference_bytes(case, seed):
    plan, lens = case
    base = _fresh(plan, seed)
    want, m, chunk = reference_words(plan, lens, base)
    event("split" if m > len(lens) else "no split")
    out = base.copy()
    got_m, got_chunk = core_plan(plan, lens, out)
    assert (got_m, got_chunk) == (m, chunk)
    assert out.tobytes() == want.tobytes()
    assert m <= plan.capacity


@settings(max_examples=60, deadline=None)
@given(case=plan_and_lens())
def test_strided_and_byteswapped_lengths(case):
    plan, lens = case
    base = _fresh(plan, 0)
    want, _, _ = reference_words(plan, lens, base)
    wide = np.repeat(lens, 2)[::2]  # a strided view of the same values
    swapped = lens.astype(lens.dtype.newbyteorder())
    for view in (wide, swapped):
        out = base.copy()
        core_plan(plan, view, out)
        assert out.tobytes() == want.tobytes()


def test_extremes():
    plan = D.DecodePlan(256, 32, 8, 128, device="cpu", programs=528)
    cases = [
        [],
        [0] * 256,
        [(1 << 63) - 1] * 256,
        [1 << 30] + [0] * 255,
        [1] * 255 + [15380],
        list(range(256)),
    ]
    for lens in cases:
        arr = np.asarray(lens, dtype=np.int64)
        base = _fresh(plan, 1)
        want, m, _ = reference_words(plan, arr, base)
        out = base.copy()
        assert core_plan(plan, arr, out)[0] == m
        assert out.tobytes() == want.tobytes()
    # uint64 values at or above 2^63 are read as numpy's int64 cast reads them (negative: 0).
    u = np.array([2**64 - 1, 2**63, 5000, 1], dtype=np.uint64)
    base = _fresh(plan, 2)
    want, _, _ = reference_words(plan, u, base)
    out = base.copy()
    core_plan(plan, u, out)
    assert out.tobytes() == want.tobytes()
    # A chunk beyond 64 bits (total x kv_heads / programs), where numpy's reference overflows
    # int64: exact, and nothing splits. (Parameters only: a real plan with 2^32 - 1 kv heads
    # would size its scratch by them.)
    lens = np.full(8, 1 << 30, dtype=np.int64)
    out = np.full(12 + 4 * 10, 7, dtype=np.int32)
    m, chunk = _core.plan_decode(lens, out, 2**32 - 1, 1, 256, 64, 12, 10)
    assert (m, chunk) == (8, -(-(8 << 30) * (2**32 - 1) // 64) * 64) and chunk > 2**64
    items = [[s, 0, D._TO_END, -1] for s in range(8)]
    assert out.tolist() == [8, *range(9), 7, 7] + sum(items, []) + [7] * 8


@pytest.mark.parametrize("kind", ["list", "numpy", "tensor", "float", "bool"])
def test_update_fills_the_device_buffer_as_before(kind):
    plan = D.DecodePlan(16, 8, 2, 32, device="cpu", programs=40, min_chunk=64)
    lens = [1, 7, 300, 33, 0, 129, 64, 1000, 5]
    seq_lens = {
        "list": lens,
        "numpy": np.asarray(lens, dtype=np.int32),
        "tensor": torch.tensor(lens, dtype=torch.int32),
        "float": np.asarray(lens, dtype=np.float64) + 0.5,  # truncated, as plan_host reads it
        "bool": np.asarray(lens, dtype=bool),
    }[kind]
    ref_lens = np.asarray(lens, dtype=bool) if kind == "bool" else lens
    for num_seqs in (None, 4, 0):
        plan.update(seq_lens, num_seqs)
        n = len(lens) if num_seqs is None else num_seqs
        chunk, items, indptr = plan.plan_host(np.asarray(ref_lens)[:n])
        m = items.shape[0]
        assert (plan.num_seqs, plan.num_items, plan.chunk) == (n, m, chunk)
        meta = plan.meta.numpy()
        assert meta[0] == m
        assert np.array_equal(meta[1 : 2 + n], indptr)
        assert np.array_equal(meta[plan.items_off : plan.items_off + 4 * m], items.reshape(-1))


def test_bad_buffers_raise_typed_errors_and_write_nothing():
    plan = D.DecodePlan(8, 8, 2, 32, device="cpu", programs=40, min_chunk=64)
    lens = np.array([5, 700, 3], dtype=np.int32)
    good = _fresh(plan, 3)

    def fails(exc, out, seq_lens=lens, match=None, **over):
        args = dict(kv_heads=plan.num_kv_heads, programs=plan.programs, min_chunk=plan.min_chunk,
                    granule=plan.granule, items_off=plan.items_off, capacity=plan.capacity)
        args.update(over)
        before = np.array(out, copy=True) if isinstance(out, np.ndarray) else None
        with pytest.raises(exc, match=match):
            _core.plan_decode(seq_lens, out, *args.values())
        if before is not None:
            assert np.array_equal(np.asarray(out), before)

    # The buffer: dtype, dimensions, contiguity, writability, byte order, type, length.
    fails(E.BufferInvalidError, good.astype(np.int64), match="dtype int64|<i8")
    fails(E.BufferInvalidError, good.astype(np.uint32))
    fails(E.BufferInvalidError, good.reshape(-1, 2))
    fails(E.BufferInvalidError, np.repeat(good, 2)[::2], match="non-contiguous")
    ro = good.copy()
    ro.setflags(write=False)
    fails(E.BufferInvalidError, ro)
    fails(E.BufferInvalidError, good.astype(good.dtype.newbyteorder()))
    fails(E.BufferInvalidError, good.tolist())
    fails(E.BufferInvalidError, torch.from_numpy(good.copy()))
    fails(E.BufferTooSmallError, good[: plan.items_off + 3], match="plan")
    # The lengths share the buffer's memory.
    alias = good.copy()
    fails(E.BufferInvalidError, alias, seq_lens=alias[:3])
    # The lengths: type, dtype, dimensions.
    fails(E.InvalidArgumentError, good.copy(), seq_lens=[5, 700, 3])
    fails(E.InvalidArgumentError, good.copy(), seq_lens=lens.astype(np.float32))
    fails(E.InvalidArgumentError, good.copy(), seq_lens=lens.astype(bool))
    fails(E.InvalidArgumentError, good.copy(), seq_lens=lens.reshape(3, 1))
    # Parameters, and a batch the buffer's regions cannot hold.
    fails(E.InvalidConfigError, good.copy(), kv_heads=0)
    fails(E.InvalidConfigError, good.copy(), min_chunk=(1 << 30) + 1)
    fails(E.InvalidArgumentError, good.copy(), programs=-1)
    fails(E.InvalidArgumentError, good.copy(), granule=True)
    fails(E.BufferTooSmallError, good.copy(), items_off=4, match="plan indptr")
    fails(E.BufferTooSmallError, good.copy(), capacity=3, match="plan items")
    # The buffer DecodePlan owns is accepted as it is.
    out = plan._host_np[0]
    assert core_plan(plan, lens, out)[0] == reference_words(plan, lens, out)[1]


def test_kernels_import_without_the_extension() -> None:
    """The kernels take device tensors only; the planner that needs the extension lives beside
    the other binding wrappers (pagedkv.decode_plan), not in the kernels package."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['pagedkv._core'] = None\n"
        "import pagedkv.kernels as K\n"
        "assert K.paged_decode and K.DecodePlanBuffers\n"
        "del sys.modules['pagedkv._core']\n"
        "from pagedkv.decode_plan import DecodePlan\n"
        "assert issubclass(DecodePlan, K.DecodePlanBuffers)\n"
        "assert not hasattr(K, 'DecodePlan') and 'DecodePlan' not in K.__all__\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
