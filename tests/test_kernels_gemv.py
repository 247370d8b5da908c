"""linear_small_m (weight-streaming GEMV for 1..16 rows) against torch.nn.functional.linear.

CPU runs use Triton's interpreter (export TRITON_INTERPRET=1) on small shapes; the `gpu` variants
run compiled, and the last tests run the Llama-3-8B projection shapes.
"""

import pytest

# kernel_common skips this module where kernels cannot run.
from kernel_common import CUDA, DEVICES, INTERP, host_tensors_only, torch
from pagedkv import kernels as K
from pagedkv.kernels import gemv as G

F = torch.nn.functional

# Max-abs-error bounds, relative to the largest |reference| entry, per dtype: fp32 accumulates
# in another order than the reference; fp16/bf16 round the output once (half an ulp is 2^-11 and
# 2^-8 relative) and their inputs are exact in fp32.
REL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def dtypes_for(device):
    # The interpreter mishandles bfloat16 (no numpy type); it is covered by the compiled runs.
    if device == "cpu":
        return (torch.float32, torch.float16)
    return (torch.bfloat16, torch.float16, torch.float32)


def make(m, n, k, dtype, device, gen, bias=True, row_pad=0):
    """x [m, k] (a row-strided view when row_pad > 0), weight [n, k], bias [n] or None."""
    xb = torch.randn(m, k + row_pad, generator=gen)
    x = xb.to(dtype).to(device)[:, row_pad // 2: row_pad // 2 + k]
    w = torch.randn(n, k, generator=gen).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    return x, w, b


def check(out, x, w, b):
    """`out` against F.linear computed in fp32 on the same (rounded) inputs."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == x.dtype and tuple(out.shape) == tuple(ref.shape)
    scale = ref.abs().max().clamp_min(1.0)
    err = ((out.float() - ref).abs().max() / scale).item()
    assert err < REL[x.dtype], f"max error {err:.2e} (relative to max |ref|)"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (200, 160), (48, 32), (200, 96)])
def test_matches_linear(device, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    for dtype in dtypes_for(device):
        for bias in (False, True):
            x, w, b = make(m, n, k, dtype, device, gen, bias=bias)
            check(G.linear_small_m(x, w, b), x, w, b)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_x_and_out_views(device):
    gen = torch.Generator().manual_seed(7)
    for dtype in dtypes_for(device):
        for m in (1, 5, 9):
            # x a column slice of a wider buffer (row stride 160 + 24, data offset not 16-aligned).
            x, w, b = make(m, 72, 160, dtype, device, gen, row_pad=24)
            assert x.stride(0) != x.shape[1]
            wide = torch.full((m, 100), 7.0, dtype=dtype, device=device)
            res = G.linear_small_m(x, w, b, out=wide[:, 9:81])
            assert res.data_ptr() == wide[:, 9:81].data_ptr()
            check(wide[:, 9:81], x, w, b)
            # Columns outside the view are untouched.
            assert bool((wide[:, :9] == 7).all()) and bool((wide[:, 81:] == 7).all())


# Forced configurations: both paths, tails in N (rows clamped) and K (masked), split-K with
# ranges that do not divide K, a split count past the K tiles (shrinks), 1-row and wide tiles.
FORCED = [
    {"DOT": False, "BLOCK_N": 1, "BLOCK_K": 16},
    {"DOT": False, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2},
    {"DOT": False, "BLOCK_N": 4, "BLOCK_K": 16, "SPLIT_K": 3},
    {"DOT": False, "BLOCK_N": 8, "BLOCK_K": 32, "SPLIT_K": 64, "num_stages": 3},
    {"DOT": True, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 4},
    {"DOT": True, "BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 3, "num_warps": 2},
    {"DOT": True, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1, "num_stages": 1},
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", FORCED, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_forced_configs(device, cfg):
    gen = torch.Generator().manual_seed(len(str(cfg)))
    ms = (1,) if not cfg["DOT"] else (1, 3, 16)
    for dtype in dtypes_for(device):
        for m in ms:
            for n, k in ((200, 160), (48, 96)):
                x, w, b = make(m, n, k, dtype, device, gen, bias=m != 3, row_pad=8)
                out = G.linear_small_m(x, w, b, config=cfg)
                check(out, x, w, b)
                if cfg.get("SPLIT_K", 1) > 1:
                    # The splits are summed in a fixed order: every call gives the same bits.
                    assert torch.equal(out, G.linear_small_m(x, w, b, config=cfg))


@pytest.mark.parametrize("device", DEVICES)
def test_paths_agree_and_cache(device):
    gen = torch.Generator().manual_seed(11)
    x, w, b = make(1, 48, 96, torch.float32, device, gen)
    a = G.linear_small_m(x, w, b, config={"DOT": False})
    d = G.linear_small_m(x, w, b, config={"DOT": True})
    assert torch.allclose(a, d, rtol=1e-5, atol=1e-5)
    # A repeated signature takes the cached launch and gives the same bits; new data, new result.
    assert torch.equal(G.linear_small_m(x, w, b, config={"DOT": False}), a)
    x2 = torch.randn(x.shape, generator=gen).to(device)
    check(G.linear_small_m(x2, w, b, config={"DOT": False}), x2, w, b)
    # Exported from the package.
    assert K.linear_small_m is G.linear_small_m


@pytest.mark.parametrize("device", DEVICES)
def test_empty_sizes(device):
    gen = torch.Generator().manual_seed(5)
    x, w, b = make(2, 6, 0, torch.float32, device, gen)
    assert torch.equal(G.linear_small_m(x, w, b), F.linear(x, w, b))  # K = 0: the bias
    assert torch.equal(G.linear_small_m(x, w), torch.zeros(2, 6, device=device))
    x, w, _ = make(2, 0, 8, torch.float32, device, gen)
    assert G.linear_small_m(x, w).shape == (2, 0)


def test_config_heuristic():
    llama = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
    for m in range(1, G.MAX_M + 1):
        for n, k in llama:
            cfg = G.gemv_config(m, n, k)
            assert cfg == G.gemv_config(m, n, k)  # deterministic
            assert set(cfg) == {"DOT", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"}
            assert cfg["DOT"] == (m > 1)
            # Enough N tiles for every SM of an H200: no second launch.
            assert cfg["SPLIT_K"] == 1
            assert -(-n // cfg["BLOCK_N"]) >= 132
            assert cfg["BLOCK_N"] * cfg["BLOCK_K"] * 2 <= 16384
    # A narrow N with a long K splits, into ranges of at least MIN_K_PER_SPLIT.
    cfg = G.gemv_config(1, 64, 8192)
    assert cfg["SPLIT_K"] > 1 and 8192 // cfg["SPLIT_K"] >= G.MIN_K_PER_SPLIT
    assert G.gemv_config(1, 256, 8192)["SPLIT_K"] == 1  # 1-row tiles already give 256 programs
    assert G.gemv_config(4, 1024, 4096)["SPLIT_K"] > 1
    assert G.gemv_config(4, 1024, 4096, num_sms=16)["SPLIT_K"] == 1
    # Small K is not padded to a big tile; tl.dot's 16 is the floor.
    assert G.gemv_config(3, 48, 32)["BLOCK_K"] == 32
    assert G.gemv_config(3, 48, 8)["BLOCK_K"] == 16
    assert not G.gemv_config(8, 48, 32, dot=False)["DOT"]


@host_tensors_only
def test_validation():
    x = torch.zeros(2, 32)
    w = torch.zeros(48, 32)
    b = torch.zeros(48)
    f = G.linear_small_m
    with pytest.raises(K.KernelDTypeError, match="x: expected a torch.Tensor"):
        f([[0.0]], w)
    with pytest.raises(K.KernelDTypeError, match="x: dtype is torch.int32"):
        f(x.int(), w)
    with pytest.raises(K.KernelDTypeError, match="weight: dtype is torch.float16"):
        f(x, w.half())
    with pytest.raises(K.KernelDTypeError, match="bias: dtype"):
        f(x, w, b.half())
    with pytest.raises(K.KernelDTypeError, match="out: dtype"):
        f(x, w, out=torch.zeros(2, 48, dtype=torch.float16))
    with pytest.raises(K.KernelShapeError, match="x: has 1 dimensions"):
        f(x[0], w)
    with pytest.raises(K.KernelShapeError, match="x: has 3 dimensions"):
        f(x[None], w)
    with pytest.raises(K.KernelShapeError, match="x: has 0 rows"):
        f(x[:0], w)
    with pytest.raises(K.KernelShapeError, match="x: has 17 rows"):
        f(torch.zeros(17, 32), w)
    with pytest.raises(K.KernelShapeError, match="weight: size of dim 1 is 32, expected 31"):
        f(x[:, :31], w)
    with pytest.raises(K.KernelShapeError, match="bias: size of dim 0 is 47"):
        f(x, w, b[:47])
    with pytest.raises(K.KernelShapeError, match="out: shape is"):
        f(x, w, out=torch.zeros(2, 47))
    with pytest.raises(K.KernelLayoutError, match="weight"):
        f(x, torch.zeros(32, 48).t())
    with pytest.raises(K.KernelLayoutError, match="x"):
        f(torch.zeros(32, 2).t(), w)
    with pytest.raises(K.KernelLayoutError, match="out"):
        f(x, w, out=torch.zeros(48, 2).t())
    with pytest.raises(K.KernelLayoutError, match="bias"):
        f(x, w, torch.zeros(96)[::2])
    with pytest.raises(K.KernelDeviceError, match="weight: is on meta"):
        f(x, w.to("meta"))
    with pytest.raises(K.KernelDeviceError, match="bias: is on meta"):
        f(x, w, b.to("meta"))
    with pytest.raises(K.KernelArgumentError, match="config: unknown keys"):
        f(x, w, config={"BLOCK_M": 16})
    with pytest.raises(K.KernelArgumentError, match="FMA path"):
        f(x, w, config={"DOT": False})
    with pytest.raises(K.KernelShapeError, match="BLOCK_N"):
        f(x, w, config={"BLOCK_N": 8})  # the DOT path's tiles start at 16
    with pytest.raises(K.KernelShapeError, match="BLOCK_K"):
        f(x, w, config={"BLOCK_K": 48})
    with pytest.raises(K.KernelArgumentError, match="SPLIT_K"):
        f(x, w, config={"SPLIT_K": 0})
    with pytest.raises(K.KernelDTypeError, match="num_warps"):
        f(x, w, config={"num_warps": 4.0})
    with pytest.raises(K.KernelDTypeError, match="config: expected a dict"):
        f(x, w, config=[("SPLIT_K", 2)])
    # Nothing was cached for a failing signature: the same tensors still raise.
    with pytest.raises(K.KernelShapeError, match="x: has 17 rows"):
        f(torch.zeros(17, 32), w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (200, 160)])
def test_gated_input_is_silu_mul_then_linear(device, m, n, k):
    """`silu_mul_input=True` on a gate|up output `[M, 2K]` equals the GEMV of
    `silu_mul(gate_up)`: the same operands (bitwise), so the same result, for the FMA and the
    DOT path, split or not, a row-strided x, a K tail, with and without bias."""
    from pagedkv.kernels import elementwise as ew

    gen = torch.Generator().manual_seed(31 * m + n + k)
    cfgs = [None, {"SPLIT_K": 2, "BLOCK_K": 16}]
    if m == 1:
        cfgs.append({"DOT": True})
    for dtype in dtypes_for(device):
        for bias in (False, True):
            gu, w, b = make(m, n, 2 * k, dtype, device, gen, bias=False, row_pad=6)
            w = w[:, :k].contiguous()
            b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
            act = ew.silu_mul(gu) if device != "cpu" or INTERP else ew.silu_mul_ref(gu)
            for cfg in cfgs:
                got = G.linear_small_m(gu, w, b, config=cfg, silu_mul_input=True)
                want = G.linear_small_m(act, w, b, config=cfg)
                assert torch.equal(got, want), (dtype, bias, cfg)
            check(G.linear_small_m(gu, w, b, silu_mul_input=True),
                  ew.silu_mul_ref(gu.float()).to(dtype), w, b)


@host_tensors_only
def test_gated_input_validation():
    w = torch.zeros(48, 32)
    with pytest.raises(K.KernelShapeError, match="expected 64 .*silu_mul_input"):
        G.linear_small_m(torch.zeros(2, 32), w, silu_mul_input=True)
    with pytest.raises(K.KernelDTypeError, match="silu_mul_input: expected a bool"):
        G.linear_small_m(torch.zeros(2, 64), w, silu_mul_input=1)


# ------------------------------------------------------------------------------ compiled only

LLAMA_SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}

@pytest.mark.parametrize("shape", list(LLAMA_SHAPES), ids=str)
@pytest.mark.parametrize("m", [1, 2, 7, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA, compiled")
def test_llama_shapes_gpu(shape, m, dtype):
    n, k = LLAMA_SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(n + m)
    # Weights scaled like a trained layer's (std ~ 1/sqrt(K)), so outputs are O(1).
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(dtype)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    b = torch.randn(n, device="cuda", generator=gen).to(dtype) if m == 7 else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    ours = G.linear_small_m(x, w, b)
    theirs = F.linear(x, w, b)
    err_ours = (ours.float() - ref).abs().max().item()
    err_theirs = (theirs.float() - ref).abs().max().item()
    # Both round an fp32 sum once: within an ulp of the output's scale of each other.
    assert err_ours <= max(2 * err_theirs, 1e-2 * ref.abs().max().item()), (err_ours, err_theirs)
    del w, ref


@pytest.mark.parametrize("cfg", [
    {"SPLIT_K": 4}, {"DOT": True}, {"DOT": True, "SPLIT_K": 7},
    {"DOT": False, "BLOCK_N": 16, "BLOCK_K": 512, "num_stages": 3},
], ids=str)
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA, compiled")
def test_llama_forced_and_graph_gpu(cfg):
    # The down projection (the longest K) through forced configs, eager and as a graph replay:
    # the replay must give the same bits (no host decision, deterministic split-K).
    n, k = LLAMA_SHAPES["down"]
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(torch.bfloat16)
    x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    eager = G.linear_small_m(x, w, b, config=cfg)
    check(eager, x, w, b)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        G.linear_small_m(x, w, b, config=cfg)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = G.linear_small_m(x, w, b, config=cfg)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
