"""fp8 (float8_e4m3fn) KV cache: quantizing scatter, dequantizing decode and prefill, block copy.

Reference: the float64 kernels' references run on the *dequantized* pool (`k8 * k_scale`), so
the attention kernels are checked to the usual tolerance of their activation dtype; the
quantization itself is checked bit for bit against torch's own fp32 -> e4m3 conversion (round to
nearest even, saturated to +-448). The error of fp8 against the unquantized cache is measured
too and held to a stated bound (`FP8_VS_FULL`). CPU runs are interpreted (fp16/fp32
activations), the `gpu` variants compiled with bf16.
"""

import pytest

from kernel_common import DEVICES, TOL, host_tensors_only, make_paged, rel_err, torch

from pagedkv import kernels as K
from pagedkv.decode_plan import DecodePlan
from pagedkv.kernels import reference as R

FP8 = torch.float8_e4m3fn
#: fp8 against the unquantized cache, unit-variance data, per-head scales fitted to the data
#: (3 mantissa bits: about 2-3% relative error of attention outputs).
FP8_VS_FULL = 6e-2


def quantize(x, scale):
    """What scatter_kv stores: x * (1 / scale) in fp32, saturated, rounded to e4m3."""
    inv = 1.0 / scale.float()
    return (x.float() * inv).clamp(-448.0, 448.0).to(FP8)


def fp8_pool(kc, vc, per_head=True):
    """Quantized copies of a (NaN-poisoned) pool, their scales and the dequantized pools."""
    h = kc.shape[2]
    live = torch.nan_to_num(kc.float(), nan=0.0).abs().amax(dim=(0, 1, 3))
    if per_head:
        ks = (live / 224.0).clamp_min(1e-6).float()
        vlive = torch.nan_to_num(vc.float(), nan=0.0).abs().amax(dim=(0, 1, 3))
        vs = (vlive / 224.0).clamp_min(1e-6)
    else:
        ks = torch.full((h,), float(live.max()) / 224.0)
        vs = torch.full((h,), float(torch.nan_to_num(vc.float(), nan=0.0).abs().max()) / 224.0)
    k8 = quantize(kc, ks.view(1, 1, h, 1))
    v8 = quantize(vc, vs.view(1, 1, h, 1))
    kd = k8.double() * ks.double().view(1, 1, h, 1)
    vd = v8.double() * vs.double().view(1, 1, h, 1)
    return k8, v8, ks.float(), vs.float(), kd, vd


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_quantizes_like_torch(device):
    gen = torch.Generator().manual_seed(1)
    act = torch.float16 if device == "cpu" else torch.bfloat16
    kc = torch.zeros(6, 8, 2, 64, dtype=FP8)
    key = (torch.randn(20, 2, 64, generator=gen) * 3).to(act)
    val = (torch.randn(20, 2, 64, generator=gen) * 1e-2).to(act)
    key[0, 0, :3] = torch.tensor([1e4, -460.0, 1e-5]).to(act)  # saturation and subnormals
    slots = torch.randperm(48, generator=gen)[:20]
    slots[4] = -1
    ks, vs = torch.tensor([0.5, 1.7]), torch.tensor([1.0, 0.3])
    for k_scale, v_scale, kref, vref in (
        (ks, vs, ks, vs),
        (0.75, 0.02, torch.tensor([0.75, 0.75]), torch.tensor([0.02, 0.02])),
    ):
        k2, v2 = kc.clone().to(device), kc.clone().to(device)
        sk = k_scale.to(device) if isinstance(k_scale, torch.Tensor) else k_scale
        sv = v_scale.to(device) if isinstance(v_scale, torch.Tensor) else v_scale
        K.scatter_kv(key.to(device), val.to(device), k2, v2, slots.to(device), k_scale=sk,
                     v_scale=sv)
        ok = slots >= 0
        got_k = k2.cpu().view(48, 2, 64)[slots[ok]]
        got_v = v2.cpu().view(48, 2, 64)[slots[ok]]
        want_k = quantize(key[ok], kref.view(1, 2, 1))
        want_v = quantize(val[ok], vref.view(1, 2, 1))
        assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
        # Padding wrote nothing: every other slot is still zero.
        untouched = torch.ones(48, dtype=torch.bool)
        untouched[slots[ok]] = False
        assert torch.all(k2.cpu().view(48, 2, 64)[untouched].float() == 0)


def _decode_case(device, act, lens, block_size, kv_heads, group, head_dim, seed, mode,
                 per_head=True, swap=True):
    gen = torch.Generator().manual_seed(seed)
    kc, vc, bt = make_paged(lens, block_size, kv_heads, head_dim, torch.float32, "cpu", gen)
    k8, v8, ks, vs, kd, vd = fp8_pool(kc, vc, per_head)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(act)
    sl = torch.tensor(lens, dtype=torch.int32)
    out = torch.full_like(q, float("nan")).to(device)
    kw = {}
    if mode == "plan":
        kw["plan"] = DecodePlan(len(lens), q.shape[1], kv_heads, head_dim, device=device,
                                  programs=32, min_chunk=16).update(lens)
    elif mode == "split":
        kw["num_splits"] = 3
    kw["config"] = {"SWAP_AB": swap}
    sk, sv = (ks.to(device), vs.to(device)) if per_head else (float(ks[0]), float(vs[0]))
    K.paged_decode(q.to(device), k8.to(device), v8.to(device), bt.to(device), sl.to(device),
                   out=out, k_scale=sk, v_scale=sv, **kw)
    assert torch.isfinite(out).all()
    ref = R.ref_paged_decode(q, kd, vd, bt, sl)
    full = R.ref_paged_decode(q, kc, vc, bt, sl)
    return rel_err(out.cpu(), ref), rel_err(out.cpu(), full)


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("mode", ["one", "split", "plan"])
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("swap", [False, True])
def test_decode_fp8_cpu(device, mode, per_head, swap):
    err, vs_full = _decode_case(device, torch.float16, [1, 7, 40, 100, 0], 8, 2, 4, 32, 3, mode,
                                per_head, swap)
    assert err < TOL[torch.float16]
    assert vs_full < FP8_VS_FULL


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("mode", ["one", "split", "plan"])
@pytest.mark.parametrize("block_size,head_dim,group", [(16, 128, 4), (64, 128, 8), (16, 64, 16)])
@pytest.mark.parametrize("swap", [False, True])
def test_decode_fp8_gpu(device, mode, block_size, head_dim, group, swap):
    lens = [1, 15, 3000, 64, 777, 4097]
    err, vs_full = _decode_case(device, torch.bfloat16, lens, block_size, 2, group, head_dim,
                                block_size + group, mode, swap=swap)
    assert err < TOL[torch.bfloat16]
    assert vs_full < FP8_VS_FULL


def _prefill_case(device, act, seed, config=None):
    gen = torch.Generator().manual_seed(seed)
    lens, qls = [5, 40, 23, 70], [5, 9, 1, 33]
    kc, vc, bt = make_paged(lens, 8, 2, 32, torch.float32, "cpu", gen)
    k8, v8, ks, vs, kd, vd = fp8_pool(kc, vc)
    q = torch.randn(sum(qls), 8, 32, generator=gen).to(act)
    sl = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.tensor([0, 5, 14, 15, 48], dtype=torch.int32)
    out = torch.full_like(q, float("nan")).to(device)
    K.paged_prefill(q.to(device), k8.to(device), v8.to(device), bt.to(device), sl.to(device),
                    qsl.to(device), 33, out=out, k_scale=ks.to(device), v_scale=vs.to(device),
                    config=config)
    assert torch.isfinite(out).all()
    return (rel_err(out.cpu(), R.ref_paged_prefill(q, kd, vd, bt, sl, qsl)),
            rel_err(out.cpu(), R.ref_paged_prefill(q, kc, vc, bt, sl, qsl)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compute", ["fp16", "q"])
def test_prefill_fp8(device, compute):
    # "fp16" (the default) widens q, the e4m3 tiles and p to fp16; "q" widens to q's dtype
    # (the same thing for an fp16 q; the interpreter's bf16 products are not usable, so the
    # bf16 q runs on the GPU only).
    act = torch.float16 if device == "cpu" else torch.bfloat16
    err, vs_full = _prefill_case(device, act, 5, config={"FP8_COMPUTE": compute})
    assert err < TOL[act]
    assert vs_full < FP8_VS_FULL


def test_prefill_fp8_compute_is_checked():
    with pytest.raises(K.KernelArgumentError, match="FP8_COMPUTE"):
        _prefill_case("cpu", torch.float16, 5, config={"FP8_COMPUTE": "fp8"})


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_then_decode_fp8(device):
    """The write path and the read path agree: scatter quantizes, decode dequantizes."""
    gen = torch.Generator().manual_seed(8)
    act = torch.float16 if device == "cpu" else torch.bfloat16
    n, bs, h, d = 37, 8, 2, 32
    key = torch.randn(n, h, d, generator=gen).to(act)
    val = torch.randn(n, h, d, generator=gen).to(act)
    kc = torch.zeros(6, bs, h, d, dtype=FP8, device=device)
    vc = torch.zeros_like(kc)
    ks = torch.tensor([0.01, 0.02], device=device)
    vs = torch.tensor([0.015, 0.01], device=device)
    K.scatter_kv(key.to(device), val.to(device), kc, vc, torch.arange(n, device=device),
                 k_scale=ks, v_scale=vs)
    bt = torch.arange(6, dtype=torch.int32).view(1, 6)
    q = torch.randn(1, 4, d, generator=gen).to(act)
    sl = torch.tensor([n], dtype=torch.int32)
    out = K.paged_decode(q.to(device), kc, vc, bt.to(device), sl.to(device), k_scale=ks,
                         v_scale=vs)
    kf = torch.zeros(6, bs, h, d)
    vf = torch.zeros(6, bs, h, d)
    kf.view(-1, h, d)[:n] = key.float()
    vf.view(-1, h, d)[:n] = val.float()
    assert rel_err(out.cpu(), R.ref_paged_decode(q, kf, vf, bt, sl)) < FP8_VS_FULL


@pytest.mark.parametrize("device", DEVICES)
def test_block_copy_fp8_is_bit_exact(device):
    gen = torch.Generator().manual_seed(9)
    kv = torch.randn(2, 2, 5, 8, 2, 32, generator=gen).to(FP8).to(device)
    caches = [kv[layer, i] for layer in range(2) for i in range(2)]
    before = kv.clone()
    K.BlockCopier(caches)(torch.tensor([[0, 3], [4, 1]], device=device))
    after = kv.cpu().view(torch.uint8)
    b = before.cpu().view(torch.uint8)
    assert torch.equal(after[:, :, 3], b[:, :, 0]) and torch.equal(after[:, :, 1], b[:, :, 4])
    assert torch.equal(after[:, :, [0, 2, 4]], b[:, :, [0, 2, 4]])


@host_tensors_only
def test_fp8_argument_checks():
    kc = torch.zeros(4, 8, 2, 32, dtype=FP8)
    q = torch.randn(2, 4, 32).half()
    bt = torch.zeros(2, 4, dtype=torch.int32)
    sl = torch.ones(2, dtype=torch.int32)
    with pytest.raises(K.KernelDTypeError, match="q: dtype"):
        K.paged_decode(q.to(FP8), kc, kc, bt, sl)
    with pytest.raises(K.KernelShapeError, match="k_scale"):
        K.paged_decode(q, kc, kc, bt, sl, k_scale=torch.ones(3))
    with pytest.raises(K.KernelDTypeError, match="k_scale"):
        K.paged_decode(q, kc, kc, bt, sl, k_scale=torch.ones(2, dtype=torch.float64))
    with pytest.raises(K.KernelArgumentError, match="v_scale"):
        K.paged_decode(q, kc, kc, bt, sl, v_scale=-1.0)
    with pytest.raises(K.KernelShapeError, match="mixed"):
        K.paged_decode(q, kc, kc, bt, sl, k_scale=torch.ones(2), v_scale=1.0)
    full = torch.zeros(4, 8, 2, 32)
    with pytest.raises(K.KernelArgumentError, match="non-fp8"):
        K.paged_decode(q.float(), full, full, bt, sl, k_scale=1.0)
    with pytest.raises(K.KernelArgumentError, match="non-fp8"):
        K.scatter_kv(torch.zeros(1, 2, 32), torch.zeros(1, 2, 32), full, full,
                     torch.zeros(1, dtype=torch.int64), v_scale=2.0)


def test_pool_fp8_scales():
    from pagedkv.config import CacheSpec
    from pagedkv.kv_pool import KVPool

    pool = KVPool(CacheSpec(3, 2, 32, dtype="float8_e4m3fn", block_size=8), 4)
    assert pool.kv.dtype == FP8 and pool.spec.bytes_per_token == 2 * 2 * 32 * 1 * 3
    assert len(pool.k_scales) == 3 and tuple(pool.k_scales[0].shape) == (2,)
    assert torch.all(pool.scales == 1.0) and pool.v_scales[2].dtype == torch.float32
    assert KVPool(CacheSpec(1, 2, 32), 2).k_scales == []
