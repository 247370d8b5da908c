"""Local attention in the paged kernels: sliding windows, chunked attention and attention sinks.

Decode and prefill against the float64 reference with `window` (keys `[p - W + 1, p]`, the
convention of transformers' `sliding_window_overlay`), `chunk` (keys `[floor(p / C) * C, p]`) and
`sinks` (one logit per query head in the softmax denominator, no value). Windows smaller than,
equal to and larger than the context, not multiples of the block size; split-K decode (forced
split counts and the ragged planner) and split-K prefill. Skip, not mask: every block-table
entry wholly before the first key a sequence's queries reach is set to -1 and its pool block to
NaN, so a kernel that reads one returns zeros or NaN instead of the reference.
"""

import pytest

# kernel_common skips this module where kernels cannot run.
from kernel_common import DEVICES, TOL, host_tensors_only, make_paged, rel_err, torch

from pagedkv import kernels as K
from pagedkv.decode_plan import DecodePlan
from pagedkv.kernels import reference as R


def _poison_before(k, vv, bt, lens, first_keys, block_size):
    """Releases (table entry -1, pool block NaN) every block wholly before `first_keys[i]`."""
    for i, lo in enumerate(first_keys):
        for j in range(min(lo // block_size, -(-lens[i] // block_size))):
            b = int(bt[i, j])
            k[b] = float("nan")
            vv[b] = float("nan")
            bt[i, j] = -1


def _sinks(q_heads, gen, dtype=torch.float32):
    return (torch.randn(q_heads, generator=gen) * 2.0).to(dtype)


def decode_case(device, dtype, lens, block_size, kv_heads, group, head_dim, seed, *, window=None,
                chunk=None, sinks=False, num_splits=None, plan=False):
    gen = torch.Generator().manual_seed(seed)
    k, vv, bt = make_paged(lens, block_size, kv_heads, head_dim, dtype, "cpu", gen)
    firsts = [R.first_key(n - 1, window, chunk) for n in lens]
    _poison_before(k, vv, bt, lens, firsts, block_size)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    sk = _sinks(kv_heads * group, gen) if sinks else None
    sl = torch.tensor(lens, dtype=torch.int32)
    ref = R.ref_paged_decode(q, k, vv, bt, sl, window=window, chunk=chunk, sinks=sk)
    t = lambda x: None if x is None else x.to(device)  # noqa: E731
    out = torch.full_like(t(q), float("nan"))
    kw = dict(window=window, chunk=chunk, sinks=t(sk))
    if plan:
        p = DecodePlan(len(lens) + 1, kv_heads * group, kv_heads, head_dim, device=device,
                         programs=64, min_chunk=8)
        # Planned over the clipped lengths, as a sliding layer's plan is built.
        reach = [n - f for n, f in zip(lens, firsts)]
        p.update(reach)
        kw["plan"] = p
    else:
        kw["num_splits"] = num_splits
    res = K.paged_decode(t(q), t(k), t(vv), t(bt), t(sl), out=out, **kw)
    assert res is out
    assert torch.isfinite(out).all()
    return rel_err(out.cpu(), ref)


LENS = [1, 5, 8, 37, 64, 100, 131]


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("window", [1, 3, 8, 13, 64, 1000])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_window_matches_reference(device, window, num_splits):
    # window 64 equals one context, 1000 exceeds them all, 13 is no multiple of the block.
    err = decode_case(device, torch.float32, LENS, 8, 2, 4, 32, seed=window, window=window,
                      num_splits=num_splits)
    assert err < TOL[torch.float32], err


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("chunk", [1, 8, 24, 64])
def test_decode_chunked_matches_reference(device, chunk):
    err = decode_case(device, torch.float32, LENS, 8, 2, 2, 32, seed=7 + chunk, chunk=chunk,
                      num_splits=2)
    assert err < TOL[torch.float32], err


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("window,num_splits", [(None, 1), (None, 4), (20, 1), (20, 2)])
def test_decode_sinks_match_reference(device, window, num_splits):
    err = decode_case(device, torch.float32, LENS, 8, 2, 4, 32, seed=11, window=window,
                      sinks=True, num_splits=num_splits)
    assert err < TOL[torch.float32], err


@pytest.mark.parametrize("device", DEVICES[:1])
def test_decode_window_fp16_gqa8(device):
    err = decode_case(device, torch.float16, LENS, 16, 1, 8, 64, seed=5, window=40, sinks=True,
                      num_splits=2)
    assert err < TOL[torch.float16], err


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("window,sinks", [(16, False), (16, True), (None, True)])
def test_planned_decode_window(device, window, sinks):
    err = decode_case(device, torch.float32, [3, 40, 90, 200], 8, 2, 2, 32, seed=3,
                      window=window, sinks=sinks, plan=True)
    assert err < TOL[torch.float32], err


def test_decode_sink_weights_match_transformers_formula():
    # gpt-oss (transformers' eager attention): softmax over [logits, sink], the sink column
    # dropped, so the weights sum to 1 - softmax(sink).
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 16, dtype=torch.float64, generator=gen)
    k = torch.randn(5, 1, 16, dtype=torch.float64, generator=gen)
    v = torch.eye(16, dtype=torch.float64)[:5, None, :]
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    o = R._attend(q, k, v, 0.25, torch.tensor([4]), torch.float64, sinks=sinks)[0]
    logits = torch.einsum("hd,ld->hl", q[0], k[:, 0]) * 0.25
    comb = torch.cat([logits, sinks[:, None]], 1)
    w = torch.softmax(comb - comb.max(1, keepdim=True).values, 1)[:, :-1]
    assert torch.allclose(o[:, :5], w)


def test_window_convention_matches_transformers():
    # The window counts the query: transformers' overlay keeps kv_idx > q_idx - W.
    tmu = pytest.importorskip("transformers.masking_utils")
    f = tmu.sliding_window_overlay(4)
    seen = [kv for kv in range(10) if kv <= 9 and f(0, 0, 9, kv)]
    assert seen == list(range(R.first_key(9, window=4), 10)) == [6, 7, 8, 9]
    g = tmu.chunked_overlay(4, torch.zeros(1, dtype=torch.long))
    seen = [kv for kv in range(10) if kv <= 9 and bool(g(0, 0, 9, kv))]
    assert seen == list(range(R.first_key(9, chunk=4), 10)) == [8, 9]


# ---------------------------------------------------------------------------------------------
# Prefill


def prefill_case(device, dtype, seqs, block_size, kv_heads, group, head_dim, seed, *, window=None,
                 chunk=None, sinks=False, config=None, max_seq_len=None):
    gen = torch.Generator().manual_seed(seed)
    lens = [c for c, _ in seqs]
    k, vv, bt = make_paged(lens, block_size, kv_heads, head_dim, dtype, "cpu", gen)
    firsts = [R.first_key(c - n, window, chunk) if n else c for c, n in seqs]
    _poison_before(k, vv, bt, lens, firsts, block_size)
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], kv_heads * group, head_dim, generator=gen).to(dtype)
    sk = _sinks(kv_heads * group, gen) if sinks else None
    sl = torch.tensor(lens, dtype=torch.int32)
    qs = torch.tensor(qsl, dtype=torch.int32)
    ref = R.ref_paged_prefill(q, k, vv, bt, sl, qs, window=window, chunk=chunk, sinks=sk)
    t = lambda x: None if x is None else x.to(device)  # noqa: E731
    out = torch.full_like(t(q), float("nan"))
    K.paged_prefill(t(q), t(k), t(vv), t(bt), t(sl), t(qs), max(n for _, n in seqs), out=out,
                    window=window, chunk=chunk, sinks=t(sk), config=config,
                    max_seq_len=max_seq_len)
    assert torch.isfinite(out).all()
    return rel_err(out.cpu(), ref)


def prefill_seqs(b):
    return [(1, 1), (b - 1, b - 1), (3 * b + 2, 3 * b + 2), (6 * b + 5, 9), (9 * b + 1, 1),
            (b + 3, 0), (12 * b, 2 * b + 3)]


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("window", [1, 5, 16, 37, 500])
@pytest.mark.parametrize("splits", [1, 3])
def test_prefill_window_matches_reference(device, window, splits):
    err = prefill_case(device, torch.float32, prefill_seqs(8), 8, 2, 2, 32, seed=window,
                       window=window, config={"SPLITS": splits})
    assert err < TOL[torch.float32], err


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("chunk,splits", [(8, 1), (24, 1), (24, 2), (40, 1)])
def test_prefill_chunked_matches_reference(device, chunk, splits):
    err = prefill_case(device, torch.float32, prefill_seqs(8), 8, 2, 2, 32, seed=chunk,
                       chunk=chunk, config={"SPLITS": splits})
    assert err < TOL[torch.float32], err


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("window,splits", [(None, 1), (None, 2), (21, 1), (21, 2)])
def test_prefill_sinks_match_reference(device, window, splits):
    err = prefill_case(device, torch.float32, prefill_seqs(8), 8, 1, 4, 32, seed=17,
                       window=window, sinks=True, config={"SPLITS": splits})
    assert err < TOL[torch.float32], err


@pytest.mark.parametrize("device", DEVICES[:1])
def test_prefill_window_unpacked_heads(device):
    # One query head per row tile (GQA packing off): the window per row still holds.
    err = prefill_case(device, torch.float16, prefill_seqs(16), 16, 2, 1, 64, seed=9, window=29,
                       sinks=True)
    assert err < TOL[torch.float16], err


# ---------------------------------------------------------------------------------------------
# Argument checks


@host_tensors_only
@pytest.mark.parametrize("kw,exc", [
    (dict(window=0), K.KernelArgumentError),
    (dict(window=-3), K.KernelArgumentError),
    (dict(chunk=0), K.KernelArgumentError),
    (dict(window=2.5), K.KernelDTypeError),
    (dict(sinks=torch.zeros(3)), K.KernelShapeError),
    (dict(sinks=torch.zeros(8, dtype=torch.int32)), K.KernelDTypeError),
    (dict(sinks=torch.zeros(8, 2)[:, 0]), K.KernelLayoutError),
])
def test_bad_local_arguments_raise(kw, exc):
    gen = torch.Generator().manual_seed(0)
    k, vv, bt = make_paged([10], 8, 2, 32, torch.float32, "cpu", gen)
    q = torch.randn(1, 8, 32)
    sl = torch.tensor([10], dtype=torch.int32)
    with pytest.raises(exc):
        K.paged_decode(q, k, vv, bt, sl, **kw)
    with pytest.raises(exc):
        K.paged_prefill(q, k, vv, bt, sl, torch.tensor([0, 1], dtype=torch.int32), 1, **kw)


@host_tensors_only
def test_check_indices_ignores_released_entries_before_window():
    gen = torch.Generator().manual_seed(1)
    k, vv, bt = make_paged([40], 8, 1, 32, torch.float32, "cpu", gen)
    bt[0, :3] = -1  # blocks 0..2 released; window 16 reaches keys 24..39 (blocks 3, 4)
    q = torch.randn(1, 2, 32)
    sl = torch.tensor([40], dtype=torch.int32)
    K.paged_decode(q, k, vv, bt, sl, window=16, check_indices=True)
    with pytest.raises(K.KernelIndexError):
        K.paged_decode(q, k, vv, bt, sl, window=17, check_indices=True)


# ---------------------------------------------------------------------------------------------
# Compiled (GPU) runs at serving shapes


@pytest.mark.gpu
@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,chunk,sinks", [(128, None, True), (1024, None, False),
                                                (None, 512, False), (4096, None, False)])
def test_decode_local_gpu(device, dtype, window, chunk, sinks):
    lens = [1, 100, 1024, 1025, 3000, 8191]
    for splits in (None, 1, 4):
        err = decode_case(device, dtype, lens, 16, 8, 8, 128, seed=1, window=window,
                          chunk=chunk, sinks=sinks, num_splits=splits)
        assert err < TOL[dtype], (splits, err)
    err = decode_case(device, dtype, lens, 16, 8, 8, 128, seed=2, window=window, chunk=chunk,
                      sinks=sinks, plan=True)
    assert err < TOL[dtype], err


@pytest.mark.gpu
@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("window,chunk,sinks", [(128, None, True), (1024, None, False),
                                                (None, 512, False)])
def test_prefill_local_gpu(device, dtype, window, chunk, sinks):
    seqs = [(1, 1), (700, 700), (3000, 600), (5000, 1), (1500, 300), (4100, 5)]
    for msl in (None, 5000):
        err = prefill_case(device, dtype, seqs, 16, 8, 4, 128, seed=3, window=window,
                           chunk=chunk, sinks=sinks, max_seq_len=msl)
        assert err < TOL[dtype], (msl, err)


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_window_bounds(device, num_splits):
    # An out-of-pool id inside the window zeroes its sequence (bounds contract); garbage ids
    # wholly before the window are never read, so their sequence stays exact.
    gen = torch.Generator().manual_seed(4)
    lens = [50, 50, 50]
    k, vv, bt = make_paged(lens, 8, 1, 32, torch.float32, "cpu", gen)
    bt[0, 5] = 1 << 30          # block 5 holds keys 40..47: inside the window of 20 (30..49)
    bt[1, :3] = -(1 << 31)      # keys 0..23: wholly before the window
    bt[2, :3] = 1 << 30
    q = torch.randn(3, 2, 32, generator=gen)
    sl = torch.tensor(lens, dtype=torch.int32)
    ref = R.ref_paged_decode(q, k, vv, bt, sl, window=20)
    assert ref[0].abs().sum() == 0 and ref[1].abs().sum() > 0
    t = lambda x: x.to(device)  # noqa: E731
    out = K.paged_decode(t(q), t(k), t(vv), t(bt), t(sl), window=20, num_splits=num_splits)
    assert out[0].abs().sum() == 0
    assert rel_err(out[1:].cpu(), ref[1:]) < TOL[torch.float32]
