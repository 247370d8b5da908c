"""Paged prefill/extend kernel against the float64 PyTorch reference.

Sequences mix a full prefill (no cached prefix), extends of a cached prefix (chunked prefill),
decode rows (one new token) and empty rows in one launch, on permuted blocks of a NaN-poisoned
pool whose unused block-table columns hold out-of-range garbage.
"""

import pytest

# kernel_common skips this module where kernels cannot run.
from kernel_common import DEVICES, TOL, host_tensors_only, make_paged, rel_err, torch

from pagedkv import kernels as K
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
