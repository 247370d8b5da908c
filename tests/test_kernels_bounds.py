"""The kernels' bounds contract: whatever the index tensors hold, no kernel reads or writes
outside the pool, the block-table rows, `q` or `out` (docs/kernels.md, "Bounds contract").

Each case feeds one kind of bad index with `check_indices=False` (the default) and checks the
output against `pagedkv.kernels.reference`, which spells the contract out: a length is clamped
to the table row, a query row that would attend to a token of a block id outside the pool gets
zeros, a query row range is clamped to `q`'s rows, rows a too-small `max_q_len` leaves out are
zeros. Valid sequences in the same batch
must come out exactly as in a run without the bad entries (and match the reference). The prefill
cases run unsplit and split along the keys (`config={"SPLITS": 3}`: partial rows in a workspace,
then a merge), where the same contract must hold across the splits. Tensors
that a stray access would hit are views into larger buffers whose guard rows hold a sentinel.

Under the interpreter an access outside a tensor is a segfault or heap corruption, so every case
that could do that runs interpreted in a child process (`run_isolated`): a crash fails that one
test. The `gpu` variants run the same cases compiled, in process.
"""

import pytest

# kernel_common skips this module where kernels cannot run.
from kernel_common import DEVICES, TOL, make_paged, rel_err, run_isolated, torch

from pagedkv import kernels as K
from pagedkv.decode_plan import DecodePlan
from pagedkv.kernels import reference as R

MODULE = "test_kernels_bounds"
SENTINEL = 12345.0


def _isolated(device, case, *args):
    if device == "cpu":
        run_isolated(MODULE, case, *args)
    else:
        globals()[case](device, *args)


def _dtype(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


def _finite_pool(kc, vc, gen):
    """Replaces the NaN poison with random values (for cases whose clamped lengths read slots
    past a sequence's real end, which the contract defines as ordinary pool contents)."""
    for c in (kc, vc):
        bad = torch.isnan(c)
        c[bad] = torch.randn(int(bad.sum()), generator=gen).to(c.dtype).to(c.device)


def _guarded(shape, dtype, device, guard, fill=SENTINEL):
    """A `[shape[0] + guard, ...]` buffer filled with `fill`, and its leading `shape[0]` rows as a
    contiguous view."""
    buf = torch.full((shape[0] + guard, *shape[1:]), fill, dtype=dtype, device=device)
    return buf, buf[: shape[0]]


# ---------------------------------------------------------------------------------------------
# Decode (split-K merge included)


def _decode_setup(device, gen, lens, block_size=8, kv_heads=2, group=2, head_dim=32, finite=False):
    dtype = _dtype(device)
    kc, vc, bt = make_paged(lens, block_size, kv_heads, head_dim, dtype, "cpu", gen)
    if finite:
        _finite_pool(kc, vc, gen)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    return q.to(device), kc.to(device), vc.to(device), bt


def _decode(q, kc, vc, bt, sl, num_splits):
    buf, out = _guarded(q.shape, q.dtype, q.device, guard=4)
    out.fill_(float("nan"))
    if num_splits == "plan":
        # The ragged planner with chunks small enough to split these sequences. The host
        # lengths are fixed (64 each: 8-token chunks), so a valid sequence is split the same way
        # in every run whatever the device lengths say; they need not match (only balance does).
        plan = DecodePlan(q.shape[0], q.shape[1], kc.shape[2], q.shape[2], device=q.device,
                            programs=64, min_chunk=8)
        plan.update([64] * q.shape[0])
        assert plan.chunk == 8 and plan.num_items > q.shape[0]
        K.paged_decode(q, kc, vc, bt.to(q.device), sl.to(q.device), out=out, plan=plan)
    else:
        K.paged_decode(q, kc, vc, bt.to(q.device), sl.to(q.device), out=out,
                       num_splits=num_splits)
    assert torch.all(buf[q.shape[0]:] == SENTINEL), "wrote past out"
    return out


def decode_out_of_pool_entries(device, kind, num_splits):
    gen = torch.Generator().manual_seed(11)
    lens = [13, 40, 25, 17]
    q, kc, vc, bt = _decode_setup(device, gen, lens)
    num_blocks = kc.shape[0]
    values = {"big": [num_blocks, 1 << 30, (1 << 31) - 1], "negative": [-1, -(1 << 31)]}[kind]
    sl = torch.tensor(lens, dtype=torch.int32)
    clean = _decode(q, kc, vc, bt, sl, num_splits)
    assert rel_err(clean.cpu(), R.ref_paged_decode(q.cpu(), kc.cpu(), vc.cpu(), bt, sl)) < TOL[q.dtype]
    for val in values:
        bad = bt.clone()
        bad[1, 2] = val  # one block in the middle of sequence 1
        bad[2, :] = val  # every block of sequence 2
        bad[3, 3] = val  # a column past sequence 3's 3 blocks: never used, no effect
        out = _decode(q, kc, vc, bad, sl, num_splits)
        # Valid sequences: bit-identical to the run without bad entries.
        assert torch.equal(out[[0, 3]], clean[[0, 3]]), val
        # A sequence that uses an out-of-pool id gets zeros, every head, however it is split.
        assert torch.equal(out[1:3].cpu(), torch.zeros_like(out[1:3].cpu())), val
        ref = R.ref_paged_decode(q.cpu(), kc.cpu(), vc.cpu(), bad, sl)
        assert rel_err(out.cpu(), ref) < TOL[q.dtype], val


def decode_seq_len_past_row(device, num_splits):
    gen = torch.Generator().manual_seed(12)
    lens = [13, 40, 25, 9]
    q, kc, vc, bt = _decode_setup(device, gen, lens, finite=True)
    width, bs = bt.shape[1], kc.shape[1]
    assert width * bs == 56
    bt[1, 5:] = bt[0, :2]  # sequence 1's columns past its blocks name real blocks
    clean = _decode(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), num_splits)
    for long in (width * bs + 1, 1 << 20, (1 << 31) - 1):
        sl = torch.tensor([13, long, -5, long], dtype=torch.int32)
        out = _decode(q, kc, vc, bt, sl, num_splits)
        assert torch.isfinite(out).all(), long
        assert torch.equal(out[0], clean[0]), long
        # Negative: empty. Sequence 3's clamped length reaches its out-of-range columns: zeros.
        assert torch.equal(out[2:].cpu(), torch.zeros_like(out[2:].cpu())), long
        # Sequence 1: clamped to the row, width * block_size tokens.
        clamped = torch.tensor([13, width * bs, 0, 0], dtype=torch.int32)
        ref = R.ref_paged_decode(q.cpu(), kc.cpu(), vc.cpu(), bt, clamped)
        assert rel_err(out.cpu(), ref) < TOL[q.dtype], long
        assert rel_err(out.cpu(), R.ref_paged_decode(q.cpu(), kc.cpu(), vc.cpu(), bt, sl)) < TOL[q.dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 3, "plan"])
@pytest.mark.parametrize("kind", ["big", "negative"])
def test_decode_out_of_pool_entries(device, kind, num_splits):
    _isolated(device, "decode_out_of_pool_entries", kind, num_splits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 3, "plan"])
def test_decode_seq_len_past_row(device, num_splits):
    _isolated(device, "decode_seq_len_past_row", num_splits)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_check_indices_raises_before_launch(device):
    gen = torch.Generator().manual_seed(13)
    q, kc, vc, bt = _decode_setup(device, gen, [13, 40])
    sl = torch.tensor([13, 40], dtype=torch.int32, device=device)
    bt = bt.to(device)
    out = torch.full_like(q, SENTINEL)
    for val, where in ((1 << 30, r"block_tables\[1, 2\]"), (-1, r"block_tables\[1, 2\]")):
        bad = bt.clone()
        bad[1, 2] = val
        with pytest.raises(K.KernelIndexError, match=where):
            K.paged_decode(q, kc, vc, bad, sl, out=out, check_indices=True)
    for n in (1 << 20, -1):
        with pytest.raises(K.KernelIndexError, match=r"seq_lens\[1\]"):
            K.paged_decode(q, kc, vc, bt, torch.tensor([13, n], dtype=torch.int32, device=device),
                           out=out, check_indices=True)
    assert torch.all(out == SENTINEL)


# ---------------------------------------------------------------------------------------------
# Prefill


def _prefill_setup(device, gen, seqs, block_size=8, kv_heads=2, group=2, head_dim=32, finite=False):
    """`seqs`: (context_len, new_tokens) pairs. Returns q, k_cache, v_cache, block_tables (CPU),
    seq_lens (CPU), query_start_loc (CPU)."""
    dtype = _dtype(device)
    lens = [c for c, _ in seqs]
    kc, vc, bt = make_paged(lens, block_size, kv_heads, head_dim, dtype, "cpu", gen)
    if finite:
        _finite_pool(kc, vc, gen)
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], kv_heads * group, head_dim, generator=gen).to(dtype)
    return (q.to(device), kc.to(device), vc.to(device), bt,
            torch.tensor(lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32))


def _prefill(q, kc, vc, bt, sl, qsl, max_q_len, fill=float("nan"), splits=None, max_seq_len=None):
    buf, out = _guarded(q.shape, q.dtype, q.device, guard=96)
    out.fill_(fill)
    dev = q.device
    K.paged_prefill(q, kc, vc, bt.to(dev), sl.to(dev), qsl.to(dev), max_q_len, out=out,
                    config=None if splits is None else {"SPLITS": splits}, max_seq_len=max_seq_len)
    assert torch.all(buf[q.shape[0]:] == SENTINEL), "wrote past out"
    return out


def _prefill_ref(q, kc, vc, bt, sl, qsl, max_q_len=None):
    return R.ref_paged_prefill(q.cpu(), kc.cpu(), vc.cpu(), bt, sl, qsl, max_q_len=max_q_len)


def prefill_rows_past_q(device, splits=None):
    gen = torch.Generator().manual_seed(21)
    # The case: query_start_loc = [0, 64] for a 4-row q.
    q, kc, vc, bt, sl, _ = _prefill_setup(device, gen, [(64, 4)], finite=True)
    qsl = torch.tensor([0, 64], dtype=torch.int32)
    out = _prefill(q, kc, vc, bt, sl, qsl, 64, splits=splits)
    assert torch.isfinite(out).all()
    # Clamped to q's 4 rows: the new tokens are positions 60..63 of the 64-token sequence.
    ref = _prefill_ref(q, kc, vc, bt, sl, torch.tensor([0, 4], dtype=torch.int32))
    assert rel_err(out.cpu(), ref) < TOL[q.dtype]
    assert rel_err(out.cpu(), _prefill_ref(q, kc, vc, bt, sl, qsl)) < TOL[q.dtype]
    # Offsets that start before row 0, run past the end, or decrease.
    seqs = [(10, 2), (20, 4), (5, 0)]
    q, kc, vc, bt, sl, _ = _prefill_setup(device, gen, seqs, finite=True)
    qsl = torch.tensor([-8, 2, 9, 3], dtype=torch.int32)
    out = _prefill(q, kc, vc, bt, sl, qsl, 10, splits=splits)
    assert torch.isfinite(out).all()
    assert rel_err(out.cpu(), _prefill_ref(q, kc, vc, bt, sl, qsl)) < TOL[q.dtype]


def prefill_out_of_pool_entries(device, kind, splits=None):
    gen = torch.Generator().manual_seed(22)
    f = 1 if device == "cpu" else 8  # compiled tiles are larger: longer contexts reach both loops
    seqs = [(64 * f, 8), (30 * f, 30 * f), (20, 5), (40 * f, 40 * f), (40 * f, 40 * f)]
    q, kc, vc, bt, sl, qsl = _prefill_setup(device, gen, seqs, head_dim=32 if f == 1 else 64)
    num_blocks, bs = kc.shape[:2]
    mq = max(n for _, n in seqs)
    clean = _prefill(q, kc, vc, bt, sl, qsl, mq, splits=splits)
    assert rel_err(clean.cpu(), _prefill_ref(q, kc, vc, bt, sl, qsl)) < TOL[q.dtype]
    values = {"big": [num_blocks, 1 << 30], "negative": [-1, -(1 << 31)]}[kind]
    rows = lambda i: slice(int(qsl[i]), int(qsl[i + 1]))  # noqa: E731
    zero = lambda t: torch.equal(t.cpu(), torch.zeros_like(t.cpu()))  # noqa: E731
    last4 = int(sl[4]) // bs - 1
    for val in values:
        bad = bt.clone()
        bad[0, 1] = val  # far before the new tokens (the unmasked key loop)
        bad[1, 1] = val  # inside the first row tile's diagonal: rows 0..bs-1 stay exact
        bad[2, :] = val  # every block
        bad[3, -(-int(sl[3]) // bs)] = val  # a column past sequence 3's blocks: never used
        bad[4, last4] = val  # on the last tile's diagonal
        out = _prefill(q, kc, vc, bt=bad, sl=sl, qsl=qsl, max_q_len=mq, splits=splits)
        assert torch.isfinite(out).all(), val
        assert torch.equal(out[rows(3)], clean[rows(3)]), val
        # A row that would attend to a token of an out-of-pool block is zero; rows before
        # that block's first position are exactly what the clean table gives.
        assert zero(out[rows(0)]) and zero(out[rows(2)]), val
        a1, a4 = int(qsl[1]), int(qsl[4])
        assert torch.equal(out[a1 : a1 + bs], clean[a1 : a1 + bs]), val
        assert zero(out[a1 + bs : int(qsl[2])]), val
        assert torch.equal(out[a4 : a4 + last4 * bs], clean[a4 : a4 + last4 * bs]), val
        assert zero(out[a4 + last4 * bs : int(qsl[5])]), val
        ref = _prefill_ref(q, kc, vc, bad, sl, qsl)
        assert rel_err(out.cpu(), ref) < TOL[q.dtype], val


def prefill_seq_len_bounds(device, splits=None):
    gen = torch.Generator().manual_seed(23)
    seqs = [(13, 4), (6, 6), (9, 2), (21, 5), (7, 3)]
    q, kc, vc, bt, sl, qsl = _prefill_setup(device, gen, seqs, finite=True)
    width, bs = bt.shape[1], kc.shape[1]
    bt[0, 2:] = bt[3, : width - 2]  # sequence 0's columns past its blocks name real blocks
    clean = _prefill(q, kc, vc, bt, sl, qsl, 6, splits=splits)
    rows = lambda i: slice(int(qsl[i]), int(qsl[i + 1]))  # noqa: E731
    for long in (width * bs + 3, 1 << 20, (1 << 31) - 1):
        # Past the row (clamped), fewer tokens than new rows (zeros), negative (zeros), past
        # the row into out-of-pool columns (zeros).
        bad = torch.tensor([long, 3, -7, 21, long], dtype=torch.int32)
        out = _prefill(q, kc, vc, bt, bad, qsl, 6, splits=splits)
        assert torch.isfinite(out).all(), long
        assert torch.equal(out[rows(3)], clean[rows(3)]), long
        for i in (1, 2, 4):
            assert torch.equal(out[rows(i)].cpu(), torch.zeros_like(out[rows(i)].cpu())), long
        clamped = torch.tensor([width * bs, 3, 0, 21, 0], dtype=torch.int32)
        assert rel_err(out.cpu(), _prefill_ref(q, kc, vc, bt, clamped, qsl)) < TOL[q.dtype], long
        assert rel_err(out.cpu(), _prefill_ref(q, kc, vc, bt, bad, qsl)) < TOL[q.dtype], long


def prefill_max_seq_len_too_small(device, splits):
    # A host bound below the real lengths: the splits are cut for the bound, the last one runs
    # to each sequence's end, so every key is still seen once.
    gen = torch.Generator().manual_seed(27)
    f = 1 if device == "cpu" else 8
    seqs = [(90 * f, 5), (40 * f, 40 * f), (61 * f, 1), (30, 0)]
    q, kc, vc, bt, sl, qsl = _prefill_setup(device, gen, seqs)
    mq = max(n for _, n in seqs)
    ref = _prefill_ref(q, kc, vc, bt, sl, qsl)
    for msl in (0, 1, 20 * f, 89 * f):
        out = _prefill(q, kc, vc, bt, sl, qsl, mq, splits=splits, max_seq_len=msl)
        assert torch.isfinite(out).all(), msl
        assert rel_err(out.cpu(), ref) < TOL[q.dtype], msl


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [None, 3])
def test_prefill_rows_past_q(device, splits):
    _isolated(device, "prefill_rows_past_q", splits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("kind", ["big", "negative"])
def test_prefill_out_of_pool_entries(device, kind, splits):
    _isolated(device, "prefill_out_of_pool_entries", kind, splits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [None, 3])
def test_prefill_seq_len_bounds(device, splits):
    _isolated(device, "prefill_seq_len_bounds", splits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [2, 4])
def test_prefill_max_seq_len_too_small(device, splits):
    _isolated(device, "prefill_max_seq_len_too_small", splits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [None, 3])
def test_prefill_max_q_len_too_small_zero_fills(device, splits):
    # Not a crash on the old kernels, but rows left unwritten: runs in process.
    gen = torch.Generator().manual_seed(24)
    f = 1 if device == "cpu" else 4
    seqs = [(80 * f, 80 * f), (50, 20), (9, 9), (30, 0)]
    q, kc, vc, bt, sl, qsl = _prefill_setup(device, gen, seqs)
    full = _prefill(q, kc, vc, bt, sl, qsl, 80 * f, splits=splits)
    for mq in (32, 9 * f, 1, 0):
        out = _prefill(q, kc, vc, bt, sl, qsl, mq, splits=splits)
        assert torch.isfinite(out).all(), mq
        ref = _prefill_ref(q, kc, vc, bt, sl, qsl, max_q_len=mq)
        assert rel_err(out.cpu(), ref) < TOL[q.dtype], mq
        for i, (_, n) in enumerate(seqs):
            a = int(qsl[i])
            run = min(n, mq)
            # The first max_q_len rows are what a right bound gives; the rest are zeros.
            assert torch.equal(out[a : a + run], full[a : a + run]), (mq, i)
            assert torch.all(out[a + run : a + n] == 0), (mq, i)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [None, 2])
def test_prefill_leaves_unclaimed_rows_alone(device, splits):
    gen = torch.Generator().manual_seed(25)
    q, kc, vc, bt, sl, qsl = _prefill_setup(device, gen, [(10, 3), (7, 2)])
    q = torch.cat([q, torch.randn(3, *q.shape[1:], generator=gen).to(q.dtype).to(device)])
    out = _prefill(q, kc, vc, bt, sl, qsl, 3, fill=7.0, splits=splits)
    assert torch.all(out[5:] == 7.0)
    assert torch.isfinite(out[:5]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_check_indices_raises_before_launch(device):
    gen = torch.Generator().manual_seed(26)
    q, kc, vc, bt, sl, qsl = _prefill_setup(device, gen, [(64, 4)])
    dev = q.device
    out = torch.full_like(q, SENTINEL)
    cases = [
        (bt, sl, torch.tensor([0, 64], dtype=torch.int32), 64, "query_start_loc"),
        (bt, sl, qsl, 3, "new tokens"),
        (bt, torch.tensor([1 << 20], dtype=torch.int32), qsl, 4, r"seq_lens\[0\]"),
    ]
    for val in (1 << 30, -1):
        bad = bt.clone()
        bad[0, 2] = val
        cases.append((bad, sl, qsl, 4, r"block_tables\[0, 2\]"))
    for b, s, ql, mq, match in cases:
        with pytest.raises(K.KernelIndexError, match=match):
            K.paged_prefill(q, kc, vc, b.to(dev), s.to(dev), ql.to(dev), mq, out=out,
                            check_indices=True)
    assert torch.all(out == SENTINEL)


# ---------------------------------------------------------------------------------------------
# Scatter and block copy (these already skipped out-of-range ids; the cases pin it down)


def scatter_out_of_pool_slots(device):
    gen = torch.Generator().manual_seed(31)
    nb, bs, h, d = 6, 8, 2, 32
    kbuf, kc = _guarded((nb, bs, h, d), torch.float32, device, guard=3)
    vbuf, vc = _guarded((nb, bs, h, d), torch.float32, device, guard=3)
    kc.copy_(torch.randn(kc.shape, generator=gen))
    vc.copy_(torch.randn(vc.shape, generator=gen))
    slots = [5, nb * bs, 1 << 40, -1, -(1 << 62), 1 << 62, (1 << 63) - 1, nb * bs - 1, -(1 << 63)]
    key = torch.randn(len(slots), h, d, generator=gen).to(device)
    val = torch.randn(len(slots), h, d, generator=gen).to(device)
    sm = torch.tensor(slots, dtype=torch.int64, device=device)
    rk, rv = R.ref_scatter_kv(key.cpu(), val.cpu(), kc.cpu(), vc.cpu(), sm.cpu())
    K.scatter_kv(key, val, kc, vc, sm)
    assert torch.equal(kc.cpu(), rk) and torch.equal(vc.cpu(), rv)
    assert torch.all(kbuf[nb:] == SENTINEL) and torch.all(vbuf[nb:] == SENTINEL)
    assert torch.equal(kc.reshape(-1, h, d)[5].cpu(), key[0].cpu())
    assert torch.equal(vc.reshape(-1, h, d)[nb * bs - 1].cpu(), val[7].cpu())


def copy_out_of_pool_ids(device):
    gen = torch.Generator().manual_seed(32)
    nb = 8
    bufs, caches = [], []
    for _ in range(4):
        buf, c = _guarded((nb, 4, 2, 16), torch.float32, device, guard=2)
        c.copy_(torch.randn(c.shape, generator=gen))
        bufs.append(buf)
        caches.append(c)
    pairs = [[0, 5], [nb, 1], [2, nb], [-1, 3], [4, 1 << 40], [1 << 62, 6], [7, -(1 << 62)],
             [(1 << 63) - 1, 2], [1, 2]]
    mapping = torch.tensor(pairs, dtype=torch.int64, device=device)
    ref = R.ref_copy_blocks([c.cpu() for c in caches], mapping.cpu())
    K.BlockCopier(caches)(mapping)
    for c, r, buf in zip(caches, ref, bufs):
        assert torch.equal(c.cpu(), r)
        assert torch.all(buf[nb:] == SENTINEL)
    assert torch.equal(caches[0][5].cpu(), ref[0][0]) and torch.equal(ref[0][2], caches[0][1].cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_out_of_pool_slots(device):
    _isolated(device, "scatter_out_of_pool_slots")


@pytest.mark.parametrize("device", DEVICES)
def test_copy_out_of_pool_ids(device):
    _isolated(device, "copy_out_of_pool_ids")


@pytest.mark.parametrize("device", DEVICES)
def test_copy_check_indices_raises_before_launch(device):
    caches = [torch.full((8, 4, 2, 16), SENTINEL, device=device) for _ in range(2)]
    copier = K.BlockCopier(caches)
    for pair in ([0, 8], [1 << 40, 1], [-1, 2]):
        with pytest.raises(K.KernelIndexError, match="block_mapping"):
            copier(torch.tensor([[3, 4], pair], device=device), check_indices=True)
    assert all(torch.all(c == SENTINEL) for c in caches)
