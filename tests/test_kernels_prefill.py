"""Paged prefill/extend kernel against the float64 PyTorch reference.

Sequences mix a full prefill (no cached prefix), extends of a cached prefix (chunked prefill),
decode rows (one new token) and empty rows in one launch, on permuted blocks of a NaN-poisoned
pool whose unused block-table columns hold out-of-range garbage. Split mode (the key range cut
into several programs whose partial rows a second kernel merges) is checked against the reference
and the unsplit kernel: forced through `config={"SPLITS": s}` on small shapes, chosen from
`max_seq_len` by the host rule, and at Llama-3-8B shapes on the GPU.
"""

import pytest

# kernel_common skips this module where kernels cannot run.
from kernel_common import DEVICES, TOL, host_tensors_only, make_paged, rel_err, torch

from pagedkv import kernels as K
from pagedkv.kernels import prefill as P
from pagedkv.kernels import reference as R


def make_batch(seqs, block_size, kv_heads, group, head_dim, dtype, device, gen, spare=2):
    """`seqs` is a list of (context_len, new_tokens). Returns the kernel's arguments."""
    lens = [c for c, _ in seqs]
    qlens = [n for _, n in seqs]
    k, vv, bt = make_paged(lens, block_size, kv_heads, head_dim, dtype, "cpu", gen, spare)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], kv_heads * group, head_dim, generator=gen).to(dtype)
    t = lambda x: x.to(device)  # noqa: E731
    return (
        t(q), t(k), t(vv), t(bt),
        torch.tensor(lens, dtype=torch.int32, device=device),
        torch.tensor(qsl, dtype=torch.int32, device=device),
        max(qlens + [0]),
    )


def check(args, dtype, **kw):
    q = args[0]
    out = torch.full_like(q, float("nan"))
    res = K.paged_prefill(*args, out=out, **kw)
    assert res is out
    ref = R.ref_paged_prefill(*args[:6], scale=kw.get("scale"))
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < TOL[dtype], err


def seqs_for(block_size, big):
    b = block_size
    s = [
        (1, 1),                    # a single-token prompt
        (b - 1, b - 1),            # full prefill, one partial block
        (3 * b, 3 * b),            # full prefill, exactly k blocks
        (2 * b + 5, 7),            # extend: cached prefix plus a few new tokens
        (4 * b + 1, 1),            # decode row in the same launch
        (b + 3, 0),                # nothing new this step
    ]
    if big:
        s += [(2048 + 300, 300), (1500, 1500), (4096, 1)]
    return s


CPU_CASES = [
    (torch.float32, 8, 32, 1, 2),
    (torch.float32, 16, 16, 4, 1),
    (torch.float16, 8, 64, 2, 1),
]


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("dtype,block_size,head_dim,group,kv_heads", CPU_CASES)
def test_prefill_matches_reference_cpu(device, dtype, block_size, head_dim, group, kv_heads):
    gen = torch.Generator().manual_seed(block_size * 3 + group)
    args = make_batch(seqs_for(block_size, False), block_size, kv_heads, group, head_dim, dtype, device, gen)
    check(args, dtype)


@pytest.mark.parametrize("device", DEVICES[:1])
def test_prefill_scale_and_decode_consistency_cpu(device):
    gen = torch.Generator().manual_seed(4)
    args = make_batch([(20, 1), (9, 1)], 8, 1, 4, 32, torch.float32, device, gen)
    check(args, torch.float32, scale=0.2)
    # With one new token per sequence prefill is decode: the two kernels agree.
    q, kc, vc, bt, sl, qsl, mq = args
    a = K.paged_prefill(q, kc, vc, bt, sl, qsl, mq)
    b = K.paged_decode(q, kc, vc, bt, sl)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("group,pack", [(3, True), (4, True), (4, False), (5, True)])
def test_prefill_gqa_packing_variants_cpu(device, group, pack):
    # BLOCK_M 64 lets groups up to 4 pack; 5 falls back to one head per tile. Group 3 leaves
    # rows of the tile unused (64 is not a multiple of 3).
    gen = torch.Generator().manual_seed(40 + group)
    args = make_batch(seqs_for(8, False), 8, 2, group, 32, torch.float32, device, gen)
    check(args, torch.float32, config={"BLOCK_M": 64, "PACK_GQA": pack})


GPU_CASES = [
    (dt, bs, hd, g)
    for dt in (torch.bfloat16, torch.float16)
    for bs, hd in ((8, 64), (16, 128), (64, 128), (256, 256), (16, 256))
    for g in (1, 4, 8)
]


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("dtype,block_size,head_dim,group", GPU_CASES)
def test_prefill_matches_reference_gpu(device, dtype, block_size, head_dim, group):
    gen = torch.Generator().manual_seed(block_size + group)
    args = make_batch(seqs_for(block_size, True), block_size, 2, group, head_dim, dtype, device, gen)
    check(args, dtype)


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("group,pack,block_m", [(4, False, 128), (6, True, 128), (8, True, 64), (16, True, 128)])
def test_prefill_packing_variants_gpu(device, group, pack, block_m):
    gen = torch.Generator().manual_seed(60 + group)
    args = make_batch(seqs_for(16, True), 16, 2, group, 128, torch.bfloat16, device, gen)
    check(args, torch.bfloat16, config={"BLOCK_M": block_m, "PACK_GQA": pack})


@pytest.mark.parametrize("device", DEVICES[1:])
def test_prefill_fp32_gpu(device):
    gen = torch.Generator().manual_seed(99)
    args = make_batch(seqs_for(16, True), 16, 2, 4, 128, torch.float32, device, gen)
    check(args, torch.float32)


def _args():
    gen = torch.Generator().manual_seed(1)
    return list(make_batch([(10, 4), (5, 5)], 8, 2, 2, 32, torch.float32, "cpu", gen))


@host_tensors_only
@pytest.mark.parametrize(
    "i,bad,exc,match",
    [
        (0, lambda t: t.half(), K.KernelDTypeError, "q: dtype"),
        (0, lambda t: t[:, :3], K.KernelShapeError, "multiple"),
        (3, lambda t: t.long(), K.KernelDTypeError, "block_tables"),
        (5, lambda t: t[:2], K.KernelShapeError, "query_start_loc"),
        (4, lambda t: t.long(), K.KernelDTypeError, "seq_lens"),
        (6, lambda t: -1, K.KernelArgumentError, "max_q_len"),
        (6, lambda t: 4.0, K.KernelDTypeError, "max_q_len"),
        (1, lambda t: t.to("meta"), K.KernelDeviceError, "v_cache: is on cpu, expected meta"),
        (0, lambda t: t.to("meta"), K.KernelDeviceError, "q: is on meta"),
    ],
)
def test_validation_errors(i, bad, exc, match):
    args = _args()
    args[i] = bad(args[i])
    with pytest.raises(exc, match=match):
        K.paged_prefill(*args)


@pytest.mark.parametrize("device", DEVICES[:1])
def test_check_indices(device):
    args = _args()
    ok = K.paged_prefill(*args, check_indices=True)
    assert torch.isfinite(ok).all()
    bad = list(args)
    bad[6] = 3  # max_q_len below the real 5
    with pytest.raises(K.KernelIndexError, match="new tokens"):
        K.paged_prefill(*bad, check_indices=True)
    bad = list(args)
    bad[4] = torch.tensor([3, 5], dtype=torch.int32)  # context shorter than the new tokens
    with pytest.raises(K.KernelIndexError, match=r"seq_lens\[0\]"):
        K.paged_prefill(*bad, check_indices=True)
    # A length above the host's max_seq_len breaks the strict contract (the kernel tolerates it).
    with pytest.raises(K.KernelIndexError, match=r"seq_lens\[0\]: is 10, expected in \[4, 9\]"):
        K.paged_prefill(*args, check_indices=True, max_seq_len=9)


# ---------------------------------------------------------------------------------------------
# Split along the keys


def split_seqs(b):
    return [
        (18 * b + 12, 5),   # a few new tokens over a long cached context
        (16 * b + 4, 1),    # a decode row
        (3 * b, 3 * b),     # full prefill: q_len == seq_len
        (7 * b + 8, 0),     # nothing new
        (12 * b + 8, 16),   # a chat turn after some history
    ]


def check_split(args, dtype, splits, max_seq_len=None, config=None):
    """Split output against the reference and against the unsplit kernel; returns it."""
    q = args[0]
    ref = R.ref_paged_prefill(*args[:6])
    base = K.paged_prefill(*args, out=torch.full_like(q, float("nan")), config=config)
    out = torch.full_like(q, float("nan"))
    K.paged_prefill(*args, out=out, max_seq_len=max_seq_len,
                    config={**(config or {}), "SPLITS": splits})
    assert torch.isfinite(out).all()
    err = rel_err(out.cpu(), ref.cpu())
    assert err < TOL[dtype], err
    assert rel_err(out.cpu(), base.cpu().double()) < TOL[dtype]
    return out


SPLIT_CPU_CASES = [
    # dtype, group, kv_heads, head_dim, splits, config
    (torch.float32, 1, 2, 32, 2, None),
    (torch.float32, 4, 1, 32, 3, {"BLOCK_M": 64}),  # 16 tokens x 4 heads per tile
    (torch.float16, 4, 2, 16, 4, None),  # one head per tile (a group of 4 does not pack in 32)
    (torch.float16, 2, 1, 32, 3, None),
]


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("dtype,group,kv_heads,head_dim,splits,config", SPLIT_CPU_CASES)
def test_prefill_split_matches_reference_cpu(device, dtype, group, kv_heads, head_dim, splits,
                                             config):
    gen = torch.Generator().manual_seed(70 + splits * group)
    args = make_batch(split_seqs(16), 16, kv_heads, group, head_dim, dtype, device, gen)
    check_split(args, dtype, splits, config=config)


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("splits,max_seq_len", [(4, 1 << 20), (6, None)])
def test_prefill_split_ranges_past_the_end_cpu(device, splits, max_seq_len):
    # The table holds 5 blocks (80 tokens); the chunk is cut for that (a larger bound is taken as
    # the row's width), so the last splits start past every row tile's end and are empty.
    gen = torch.Generator().manual_seed(81)
    args = make_batch([(40, 3), (20, 20)], 16, 1, 2, 32, torch.float32, device, gen)
    assert args[3].shape[1] * 16 == 80
    check_split(args, torch.float32, splits, max_seq_len=max_seq_len)


@pytest.mark.parametrize("device", DEVICES[:1])
def test_prefill_split_fp8_cpu(device):
    from test_kernels_fp8 import FP8_VS_FULL, _prefill_case

    err, vs_full = _prefill_case(device, torch.float16, 5, config={"SPLITS": 3})
    assert err < TOL[torch.float16]
    assert vs_full < FP8_VS_FULL


def test_num_splits_rule():
    # A grid that fills the SMs, or a context too short for two MIN_CHUNK pieces: no split.
    assert P._num_splits(132, 1 << 15, 128, 132) == 1
    assert P._num_splits(8, 2 * P.MIN_CHUNK - 1, 128, 132) == 1
    # Llama-3-8B at GQA 4: one row tile x 8 kv groups. 32K: 33 splits wanted, 1024-key chunks
    # cover it in 32; 8K: 16 splits of MIN_CHUNK keys.
    assert P._num_splits(8, 32768, 128, 132) == 32
    assert P._num_splits(8, 8192, 128, 132) == 16
    assert P._num_splits(100, 1 << 15, 128, 132) == 3
    for programs in (1, 3, 8, 50, 131):
        for msl in (1024, 1100, 5000, 32768, 100003):
            for bn in (16, 64, 128):
                s = P._num_splits(programs, msl, bn, 132)
                chunk = P._split_chunk(msl, s, bn)
                assert 2 <= s <= -(-2 * 132 // programs), (programs, msl, bn)
                assert chunk % bn == 0 and chunk >= P.MIN_CHUNK
                # Every split has keys below the bound, and together they cover it.
                assert (s - 1) * chunk < msl <= s * chunk, (programs, msl, bn)


@pytest.mark.parametrize("device", DEVICES[:1])
def test_prefill_automatic_split_cpu(device, monkeypatch):
    picked = []
    real = P._num_splits
    monkeypatch.setattr(P, "_num_splits", lambda *a: picked.append(real(*a)) or picked[-1])
    gen = torch.Generator().manual_seed(82)
    # Two sequences of one packed row tile each: a grid of 2 programs, far below 132 SMs.
    args = make_batch([(1100, 4), (600, 1)], 16, 1, 2, 16, torch.float32, device, gen)
    ref = R.ref_paged_prefill(*args[:6])
    out = torch.full_like(args[0], float("nan"))
    K.paged_prefill(*args, out=out, max_seq_len=1100)
    assert picked == [2]
    assert rel_err(out, ref) < TOL[torch.float32]
    # Without the bound the host has no length to split by: the single-kernel path.
    picked.clear()
    out2 = K.paged_prefill(*args)
    assert picked == []
    assert rel_err(out2, ref) < TOL[torch.float32]


@host_tensors_only
@pytest.mark.parametrize(
    "kw,exc,match",
    [
        ({"max_seq_len": -1}, K.KernelArgumentError, "max_seq_len"),
        ({"max_seq_len": 4.0}, K.KernelDTypeError, "max_seq_len"),
        ({"max_seq_len": True}, K.KernelDTypeError, "max_seq_len"),
        ({"config": {"SPLITS": 0}}, K.KernelArgumentError, "SPLITS"),
        ({"config": {"SPLITS": 2.0}}, K.KernelDTypeError, "SPLITS"),
    ],
)
def test_split_validation_errors(kw, exc, match):
    args = _args()
    K.paged_prefill(*args, max_seq_len=10)  # a cached signature must not skip the checks
    with pytest.raises(exc, match=match):
        K.paged_prefill(*args, **kw)


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize(
    "seqs", [[(8192, 16)], [(32768, 16)], [(32768, 16), (8192, 1), (700, 300)]]
)
def test_prefill_split_long_context_gpu(device, seqs, monkeypatch):
    # Llama-3-8B attention (32 query / 8 kv heads, head_dim 128), bf16: a few new tokens over a
    # long cached context, the shape split mode is for.
    picked = []
    real = P._num_splits
    monkeypatch.setattr(P, "_num_splits", lambda *a: picked.append(real(*a)) or picked[-1])
    gen = torch.Generator().manual_seed(len(seqs))
    args = make_batch(seqs, 16, 8, 4, 128, torch.bfloat16, device, gen)
    msl = max(c for c, _ in seqs)
    out = check_split(args, torch.bfloat16, None, max_seq_len=msl)
    assert picked and picked[-1] > 1, picked
    # Forced, with chunks cut for a bound far below the real lengths.
    forced = check_split(args, torch.bfloat16, 4, max_seq_len=1000)
    assert rel_err(forced.cpu(), out.cpu().double()) < TOL[torch.bfloat16]
