"""Paged decode kernel against the float64 PyTorch reference.

CPU runs use Triton's interpreter (export TRITON_INTERPRET=1) on tiny shapes; the `gpu` variants
run the compiled kernels on CUDA with larger shapes and bf16. Pools and outputs are poisoned with
NaN and block-table columns past each sequence's blocks hold out-of-range garbage, so an
unwritten output or a read of a stale column fails.
"""

import numpy as np
import pytest

# kernel_common skips this module where kernels cannot run.
from kernel_common import DEVICES, TOL, host_tensors_only, make_paged, rel_err, torch

from pagedkv import kernels as K
from pagedkv.decode_plan import DecodePlan
from pagedkv.kernels import reference as R


def lens_for(block_size, big):
    base = [1, block_size - 1, 3 * block_size, 2 * block_size + 5]
    base.append(1500 if big else 5 * block_size + 3)
    if big:
        base += [4097, 64]
    return [max(1, n) for n in base]


def run_case(device, dtype, block_size, head_dim, group, kv_heads, seed, **kw):
    gen = torch.Generator().manual_seed(seed)
    lens = lens_for(block_size, device == "cuda")
    kc, vc, bt = make_paged(lens, block_size, kv_heads, head_dim, dtype, device, gen)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype).to(device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    res = K.paged_decode(q, kc, vc, bt, sl, out=out, **kw)
    assert res is out
    ref = R.ref_paged_decode(q, kc, vc, bt, sl, scale=kw.get("scale"))
    assert torch.isfinite(out).all()
    return rel_err(out, ref)


CPU_CASES = [
    # dtype, block_size, head_dim, group, kv_heads
    (torch.float32, 16, 64, 1, 2),
    (torch.float32, 8, 64, 4, 1),
    (torch.float16, 16, 32, 8, 1),
    (torch.float32, 32, 16, 4, 2),
    (torch.float16, 8, 128, 1, 1),
]


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("dtype,block_size,head_dim,group,kv_heads", CPU_CASES)
def test_decode_matches_reference_cpu(device, dtype, block_size, head_dim, group, kv_heads):
    err = run_case(device, dtype, block_size, head_dim, group, kv_heads, seed=block_size + group)
    assert err < TOL[dtype]


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("dtype,block_size,head_dim,group,kv_heads", CPU_CASES[1:3])
def test_decode_transposed_products_cpu(device, dtype, block_size, head_dim, group, kv_heads):
    # SWAP_AB: the same attention through K·qᵀ and Vᵀ·pᵀ.
    err = run_case(device, dtype, block_size, head_dim, group, kv_heads, seed=5,
                   config={"SWAP_AB": True})
    assert err < TOL[dtype]


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_matches_unsplit_cpu(device, num_splits):
    gen = torch.Generator().manual_seed(7)
    lens = [1, 7, 40, 100]
    kc, vc, bt = make_paged(lens, 8, 2, 32, torch.float32, device, gen)
    q = torch.randn(4, 8, 32, generator=gen).to(device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    a = K.paged_decode(q, kc, vc, bt, sl, num_splits=1)
    b = K.paged_decode(q, kc, vc, bt, sl, num_splits=num_splits)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    ref = R.ref_paged_decode(q, kc, vc, bt, sl)
    assert rel_err(b, ref) < 1e-5


GPU_CASES = [
    (dt, bs, hd, g)
    for dt in (torch.bfloat16, torch.float16)
    for bs, hd in ((8, 64), (16, 128), (64, 128), (256, 256), (32, 256))
    for g in (1, 4, 8)
]


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("dtype,block_size,head_dim,group", GPU_CASES)
def test_decode_matches_reference_gpu(device, dtype, block_size, head_dim, group):
    err = run_case(device, dtype, block_size, head_dim, group, 2, seed=block_size * group)
    assert err < TOL[dtype]


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("num_splits", [1, 2, 7, 32])
def test_decode_splits_gpu(device, num_splits):
    err = run_case(device, torch.bfloat16, 16, 128, 4, 8, seed=3, num_splits=num_splits)
    assert err < TOL[torch.bfloat16]


@pytest.mark.parametrize("device", DEVICES[1:])
def test_decode_mqa_and_fp32_gpu(device):
    assert run_case(device, torch.float32, 16, 128, 16, 1, seed=11) < 1e-5
    assert run_case(device, torch.bfloat16, 16, 64, 32, 1, seed=12) < TOL[torch.bfloat16]


@pytest.mark.parametrize("device", DEVICES)
def test_scale_override_and_empty_sequence(device):
    gen = torch.Generator().manual_seed(5)
    lens = [0, 9, 17]
    kc, vc, bt = make_paged(lens, 8, 1, 32, torch.float32, device, gen)
    q = torch.randn(3, 2, 32, generator=gen).to(device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    for ns in (1, 3):
        out = K.paged_decode(q, kc, vc, bt, sl, scale=0.3, num_splits=ns)
        ref = R.ref_paged_decode(q, kc, vc, bt, sl, scale=0.3)
        assert torch.equal(out[0].cpu(), torch.zeros(2, 32))
        assert rel_err(out, ref) < 1e-5
        # A different scale is a different function: the test would notice an ignored override.
        assert rel_err(K.paged_decode(q, kc, vc, bt, sl, num_splits=ns), ref) > 1e-3


@pytest.mark.parametrize("device", DEVICES)
def test_workspace_is_reused_without_allocation(device):
    gen = torch.Generator().manual_seed(9)
    lens = [30, 61]
    kc, vc, bt = make_paged(lens, 8, 2, 32, torch.float32, device, gen)
    q = torch.randn(2, 4, 32, generator=gen).to(device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    ws = K.DecodeWorkspace(4, 4, 2, 32, device=device, max_splits=8)
    ptr = ws.partial_out.data_ptr()
    out = torch.full_like(q, float("nan"))
    K.paged_decode(q, kc, vc, bt, sl, out=out, workspace=ws, num_splits=4)
    assert ws.partial_out.data_ptr() == ptr
    assert rel_err(out, R.ref_paged_decode(q, kc, vc, bt, sl)) < 1e-5
    with pytest.raises(K.KernelShapeError, match="capacity"):
        K.paged_decode(q, kc, vc, bt, sl, workspace=ws, num_splits=ws.max_seq_splits)


def test_split_heuristic():
    sms = 132
    # Enough (sequence, kv head) programs: no split.
    assert K.choose_num_splits(256, 8, 1024, sms) == 1
    assert K.choose_num_splits(128, 8, 2048, sms) == 1
    # One long sequence: split until the grid has several waves, capped by max_splits.
    s1 = K.choose_num_splits(1, 8, 32768, sms)
    assert 1 < s1 <= 64 and 8 * s1 >= sms
    # Short contexts are not cut into pieces shorter than the minimum.
    assert K.choose_num_splits(1, 8, 300, sms) == 1
    # Never more splits for a larger batch.
    prev = 10**9
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        s = K.choose_num_splits(n, 8, 1 << 20, sms)
        assert s <= prev
        prev = s
    assert K.choose_num_splits(1, 1, 1 << 20, sms, max_splits=5) == 4
    # Powers of two that keep the grid within the target of 4 programs per SM.
    assert K.choose_num_splits(8, 8, 8192, sms) == 8
    assert K.choose_num_splits(1, 8, 32768, sms) == 64
    assert K.choose_num_splits(64, 8, 4096, sms) == 1
    for n in range(1, 70):
        s = K.choose_num_splits(n, 8, 1 << 20, sms)
        assert s & (s - 1) == 0 and (s == 1 or n * 8 * s <= 4 * sms)


def _args(device="cpu"):
    q = torch.randn(2, 4, 32, device=device)
    kc = torch.randn(10, 8, 2, 32, device=device)
    vc = torch.randn(10, 8, 2, 32, device=device)
    bt = torch.zeros(2, 4, dtype=torch.int32, device=device)
    sl = torch.ones(2, dtype=torch.int32, device=device)
    return q, kc, vc, bt, sl


@host_tensors_only
@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: (a[0].half(),) + a[1:], K.KernelDTypeError, "q: dtype"),
        (lambda a: (a[0][..., :16],) + a[1:], K.KernelShapeError, "head_dim"),
        (lambda a: (a[0][:, :3],) + a[1:], K.KernelShapeError, "multiple"),
        (lambda a: a[:3] + (a[3].long(), a[4]), K.KernelDTypeError, "block_tables"),
        (lambda a: a[:4] + (a[4][:1],), K.KernelShapeError, "seq_lens"),
        (lambda a: (a[0], a[1].transpose(1, 2).contiguous().transpose(1, 2)) + a[2:], K.KernelLayoutError, "k_cache"),
        (lambda a: (a[0], a[1], a[2][:, :4]) + a[3:], K.KernelShapeError, "v_cache"),
        (lambda a: (a[0], a[1][:, :, :, :24].contiguous(), a[2][:, :, :, :24].contiguous()) + a[3:], K.KernelShapeError, "power of two"),
        (lambda a: a[:3] + (a[3][:, ::2],) + a[4:], K.KernelLayoutError, "column stride"),
        (lambda a: (a[0].to("meta"),) + a[1:], K.KernelDeviceError, "q: is on meta"),
    ],
)
def test_validation_errors(mutate, exc, match):
    args = mutate(_args())
    with pytest.raises(exc, match=match):
        K.paged_decode(*args)


@host_tensors_only
def test_validation_errors_are_value_and_type_errors():
    from pagedkv.errors import PagedKVError

    for cls in (K.KernelShapeError, K.KernelDeviceError, K.KernelLayoutError, K.KernelIndexError):
        assert issubclass(cls, ValueError) and issubclass(cls, PagedKVError)
    assert issubclass(K.KernelDTypeError, TypeError) and issubclass(K.KernelDTypeError, PagedKVError)
    q, kc, vc, bt, sl = _args()
    with pytest.raises(ValueError):
        K.paged_decode(q[:, :3], kc, vc, bt, sl)
    with pytest.raises(TypeError):
        K.paged_decode(q.double(), kc, vc, bt, sl)
    with pytest.raises(K.KernelArgumentError, match="scale"):
        K.paged_decode(q, kc, vc, bt, sl, scale=-1.0)
    with pytest.raises(K.KernelShapeError, match="out"):
        K.paged_decode(q, kc, vc, bt, sl, out=torch.empty(2, 4, 16))
    with pytest.raises(K.KernelShapeError, match="workspace"):
        K.paged_decode(q, kc, vc, bt, sl, workspace=K.DecodeWorkspace(2, 8, 2, 32, device="cpu"))


@pytest.mark.parametrize("device", DEVICES[:1])
def test_check_indices_rejects_bad_tables(device):
    q, kc, vc, bt, sl = _args(device)
    bad = bt.clone()
    bad[1, 0] = 10
    with pytest.raises(K.KernelIndexError, match=r"block_tables\[1, 0\]"):
        K.paged_decode(q, kc, vc, bad, sl, check_indices=True)
    with pytest.raises(K.KernelIndexError, match=r"seq_lens\[0\]"):
        K.paged_decode(q, kc, vc, bt, torch.tensor([33, 1], dtype=torch.int32), check_indices=True)
    # Columns past ceil(seq_len / block_size) are not checked: they may hold anything.
    ok = bt.clone()
    ok[:, 1:] = -5
    K.paged_decode(q, kc, vc, ok, sl, check_indices=True)


@pytest.mark.parametrize("device", DEVICES[1:])
def test_decode_cuda_graph_capture(device):
    gen = torch.Generator().manual_seed(21)
    lens = [700, 3000, 5]
    kv_heads, group, hd, bs = 4, 4, 128, 16
    kc, vc, bt = make_paged(lens + [3100], bs, kv_heads, hd, torch.bfloat16, device, gen)
    bt = bt[:3].contiguous()
    q = torch.randn(3, kv_heads * group, hd, generator=gen).to(torch.bfloat16).to(device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    ws = K.DecodeWorkspace(8, kv_heads * group, kv_heads, hd, device=device)
    K.paged_decode(q, kc, vc, bt, sl, out=out, workspace=ws, max_seq_len=4096)  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        K.paged_decode(q, kc, vc, bt, sl, out=out, workspace=ws, max_seq_len=4096)
    # New inputs in place, then replay: the graph must read them, not the captured values.
    for new_lens in ([700, 3000, 5], [1, 2900, 3]):
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        sl.copy_(torch.tensor(new_lens, dtype=torch.int32))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = R.ref_paged_decode(q, kc, vc, bt, sl)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < TOL[torch.bfloat16]


# ---------------------------------------------------------------------------------------------
# Ragged planner (DecodePlan)


def test_plan_host_covers_every_token_once():
    plan = DecodePlan(16, 8, 2, 32, device="cpu", programs=40, min_chunk=64)
    lens = [1, 7, 300, 33, 0, 129, 64, 1000]
    chunk, items, indptr = plan.plan_host(lens)
    assert chunk % plan.tile == 0 and chunk >= 64
    assert DecodePlan(4, 8, 2, 32, device='cpu', min_chunk=8).plan_host([40])[0] == 8
    assert items.shape[0] <= plan.capacity
    assert indptr[-1] == items.shape[0]
    for i, n in enumerate(lens):
        mine = items[items[:, 0] == i]
        assert len(mine) == indptr[i + 1] - indptr[i] >= 1
        mine = mine[np.argsort(mine[:, 1])]
        # Contiguous pieces from 0; the last one runs to the sequence's real end.
        assert mine[0, 1] == 0
        assert all(mine[j, 2] == mine[j + 1, 1] for j in range(len(mine) - 1))
        assert mine[-1, 2] == (1 << 31) - 1
        if len(mine) == 1:
            assert mine[0, 3] == -1  # written directly, no merge
        else:
            assert sorted(mine[:, 3].tolist()) == list(range(indptr[i], indptr[i + 1]))
    # Heaviest first.
    work = np.minimum(items[:, 2], np.asarray(lens)[items[:, 0]]) - items[:, 1]
    assert np.all(np.diff(work) <= 0)
    # The capacity bound holds for any lengths, skewed ones included.
    for lens in ([0] * 16, [10**6] + [1] * 15, [5000] * 16, list(range(0, 16000, 1000))):
        _, items, _ = plan.plan_host(lens)
        assert items.shape[0] <= plan.capacity


def _planned_case(device, dtype, lens, block_size, kv_heads, group, head_dim, seed,
                  plan_lens=None, **plan_kw):
    gen = torch.Generator().manual_seed(seed)
    kc, vc, bt = make_paged(lens, block_size, kv_heads, head_dim, dtype, device, gen)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype).to(device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    plan = DecodePlan(len(lens) + 2, kv_heads * group, kv_heads, head_dim, device=device,
                        **plan_kw)
    plan.update(lens if plan_lens is None else plan_lens)
    out = torch.full_like(q, float("nan"))
    res = K.paged_decode(q, kc, vc, bt, sl, out=out, plan=plan)
    assert res is out
    ref = R.ref_paged_decode(q, kc, vc, bt, sl)
    assert torch.isfinite(out).all()
    # A second call with the same plan gives the same output (the plan is reusable as is).
    first = out.clone()
    out.fill_(float("nan"))
    K.paged_decode(q, kc, vc, bt, sl, out=out, plan=plan)
    assert torch.equal(out, first)
    return rel_err(out, ref), plan


@pytest.mark.parametrize("device", DEVICES[:1])
def test_planned_decode_matches_reference_cpu(device):
    lens = [1, 7, 300, 33, 0, 129, 64, 200]
    err, plan = _planned_case(device, torch.float32, lens, 8, 2, 4, 32, seed=31,
                              programs=40, min_chunk=64)
    assert plan.num_items > len(lens)  # the long sequences were split
    assert err < 1e-5
    # A plan built from other lengths (stale, or all zero) changes only the balance.
    for wrong in ([0] * len(lens), [400] * len(lens)):
        err, _ = _planned_case(device, torch.float32, lens, 8, 2, 4, 32, seed=31,
                               plan_lens=wrong, programs=40, min_chunk=64)
        assert err < 1e-5
    err, plan = _planned_case(device, torch.float16, [5, 70, 3], 16, 1, 8, 16, seed=32,
                              programs=200, min_chunk=16)
    assert err < TOL[torch.float16]


@pytest.mark.parametrize("device", DEVICES[:1])
def test_planned_decode_checks_cpu(device):
    q, kc, vc, bt, sl = _args(device)
    plan = DecodePlan(4, 4, 2, 32, device=device)
    plan.update([1, 1, 1])
    with pytest.raises(K.KernelShapeError, match="plan: was built for 3"):
        K.paged_decode(q, kc, vc, bt, sl, plan=plan)
    plan.update([1, 1])
    K.paged_decode(q, kc, vc, bt, sl, plan=plan)
    plan.update([1, 1, 1])  # the cached call checks the batch size again
    with pytest.raises(K.KernelShapeError, match="plan: was built for 3"):
        K.paged_decode(q, kc, vc, bt, sl, plan=plan)
    with pytest.raises(K.KernelArgumentError, match="either a plan"):
        K.paged_decode(q, kc, vc, bt, sl, plan=plan, num_splits=2)
    with pytest.raises(K.KernelShapeError, match="plan: built for"):
        K.paged_decode(q, kc, vc, bt, sl, plan=DecodePlan(4, 8, 2, 32, device=device))
    with pytest.raises(K.KernelShapeError, match="num_seqs"):
        plan.update([1] * 5)


@pytest.mark.parametrize("device", DEVICES[:1])
def test_cached_launch_revalidates_new_signatures(device):
    from pagedkv.kernels import decode as D

    q, kc, vc, bt, sl = _args(device)
    D._CACHE.clear()
    a = K.paged_decode(q, kc, vc, bt, sl)
    assert len(D._CACHE) == 1
    b = K.paged_decode(q, kc, vc, bt, sl)
    assert torch.equal(a, b) and len(D._CACHE) == 1
    # Another dtype, shape or stride is another signature: checked again, so bad ones raise.
    with pytest.raises(K.KernelDTypeError):
        K.paged_decode(q.half(), kc, vc, bt, sl)
    with pytest.raises(K.KernelLayoutError):
        K.paged_decode(q, kc, vc, bt[:, ::2], sl)
    wide = torch.zeros(2, 8, dtype=torch.int32, device=device)[:, :4]  # row stride 8
    c = K.paged_decode(q, kc, vc, wide, sl)
    assert torch.equal(a, c) and len(D._CACHE) == 2


GPU_RAGGED = [
    # lens, block_size, head_dim, group, kv_heads
    ([31, 15380, 900, 4097, 1, 2000, 64, 7000] * 4, 16, 128, 4, 8),
    ([1, 3000, 5, 12000, 255], 64, 128, 8, 2),
    ([9000, 17, 300, 4500], 16, 64, 16, 1),
    ([700, 2500, 33], 32, 256, 4, 2),
]


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("lens,block_size,head_dim,group,kv_heads", GPU_RAGGED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_planned_decode_matches_reference_gpu(device, lens, block_size, head_dim, group, kv_heads,
                                              dtype):
    err, plan = _planned_case(device, dtype, lens, block_size, kv_heads, group, head_dim,
                              seed=len(lens) + head_dim)
    assert err < TOL[dtype]
    # A small program target and chunk floor, so the long sequences are split (in every case).
    err, plan = _planned_case(device, dtype, lens, block_size, kv_heads, group, head_dim,
                              seed=3, programs=32 * kv_heads, min_chunk=64)
    assert err < TOL[dtype]
    assert plan.num_items > len(lens)


@pytest.mark.parametrize("device", DEVICES[1:])
def test_planned_decode_cuda_graph(device):
    gen = torch.Generator().manual_seed(41)
    lens = [700, 13000, 5, 2100]
    kv_heads, group, hd, bs = 8, 4, 128, 16
    kc, vc, bt = make_paged(lens + [13100], bs, kv_heads, hd, torch.bfloat16, device, gen)
    bt = bt[:4].contiguous()
    q = torch.randn(4, kv_heads * group, hd, generator=gen).to(torch.bfloat16).to(device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    plan = DecodePlan(8, kv_heads * group, kv_heads, hd, device=device)
    plan.update(lens)
    K.paged_decode(q, kc, vc, bt, sl, out=out, plan=plan)  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        K.paged_decode(q, kc, vc, bt, sl, out=out, plan=plan)
    for new_lens in ([700, 13000, 5, 2100], [13050, 1, 2, 3], [0, 64, 13099, 6000]):
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        sl.copy_(torch.tensor(new_lens, dtype=torch.int32))
        plan.update(new_lens)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = R.ref_paged_decode(q, kc, vc, bt, sl)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < TOL[torch.bfloat16]
