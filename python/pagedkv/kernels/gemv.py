"""Weight-streaming linear layer for a few rows of activations: `y = x @ W.T (+ bias)`.

Owns `linear_small_m`, its launch heuristic `gemv_config` and `MAX_M`. It is meant for the decode
step at small batch, where every projection reads its whole weight matrix to produce 1..16 output
rows: the work is `N * K` weight bytes read once against `2 * M * N * K` flops, so the time is the
weight bytes over HBM bandwidth and the kernel is built to keep as many of those bytes in flight
as it can, nothing else. `x` is `[M, K]` (rows may be a strided view, the inner stride 1),
`weight` an `nn.Linear` weight `[N, K]` (row-major, contiguous), `bias` `[N]`, `out` `[M, N]`
(any row stride); one dtype for all of them: bf16, fp16 or fp32.

Kernel shape. A program owns `BLOCK_N` consecutive weight rows (output features) and one range of
K; it walks that range in `[BLOCK_N, BLOCK_K]` tiles, loaded with 16-byte vectors along K (the
contiguous dimension), and multiplies each tile by the matching `[M, BLOCK_K]` slice of `x`, which
every program reads, so it stays in L1/L2 and costs no HBM traffic after the first touch. Two
multiply paths, picked per launch (`DOT`):

* FMA (`M == 1`): an fp32 `[BLOCK_N, BLOCK_K]` accumulator of elementwise products, reduced along
  K once after the loop. No tensor cores, no shared memory unless `num_stages > 1` asks the loop
  to be pipelined through it; the bytes in flight come from many small programs per SM. The
  default `BLOCK_K` is one 16-byte vector per lane of every warp, so all warps lie along K and
  the slice of `x` each thread needs is the slice it loads: with warps along N instead, the
  compiler exchanges `x` through shared memory, with two barriers, every iteration.
* DOT (any `M`): `tl.dot(W tile, x^T tile)` with the weight rows on the MMA's M side and `x`'s
  rows on its N side, padded to a power of two of at least 8 (the narrowest MMA; the padding rows
  load zeros, never memory), so one weight tile serves every row of `x`; the loop is
  software-pipelined `num_stages` deep through shared memory. At `M = 16` the FMA form would need
  16 fp32 FMAs per weight element, as much CUDA-core throughput as an H200 has for its
  bandwidth; padded MMAs use a few percent of the tensor cores instead. Warps are never more
  than the weight tile has 16-row MMA blocks (`BLOCK_N / 16`; a 64-row tile is one Hopper
  warpgroup MMA): a warp beyond that would read the same weight tile from shared memory again.

Gated input (`silu_mul_input=True`). `x` is then `[M, 2K]`, a fused gate|up projection's
output, and the kernel multiplies `silu(x[:, :K]) * x[:, K:]` (the MLP's activation) by the
weight, computing it as it loads each slice of `x`, rounded where `kernels.elementwise.silu_mul`
rounds (the SiLU output, then the product, to the dtype): the same operands as
`linear_small_m(silu_mul(x), W)`, one launch fewer a layer and no `[M, K]` intermediate.

Split-K. When `N / BLOCK_N` programs cannot cover the SMs, K is cut into `SPLIT_K` equal ranges
(multiples of `BLOCK_K`); each program stores its fp32 partial `[M, BLOCK_N]` into a workspace
`[splits, M, N]` and a second small kernel sums the splits in index order, adds the bias and
casts. A fixed summation order (no atomics) makes the result bit-identical from run to run and
between eager calls and graph replays.

Invariants. Products accumulate in fp32 and round once to the output dtype (after the bias is
added in fp32); fp32 inputs multiply in IEEE fp32 (never TF32).
Weight rows past `N` in the last tile are clamped to row `N - 1` rather than masked, so the hot
loop carries no row mask (their results are never stored); the K tail is masked only when `K` is
not a multiple of `BLOCK_K`. The launch configuration depends only on shapes, dtype and the SM
count, never on data: the call performs no host synchronization, no benchmarking, and no
allocation other than `out` (when not given) and the split workspace, both through PyTorch's
caching allocator, so it can be captured in a CUDA graph. Checks and launch configuration are
cached per call signature (`_launch.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch as L
from . import _validate as v
from .decode import num_sms

__all__ = ["MAX_M", "gemv_config", "linear_small_m"]

#: Most rows of `x` one call serves (beyond it a GEMM's tiles are the better fit).
MAX_M = 16

DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: Heuristic knobs (see `gemv_config`).
#: Bytes of weight per tile, per program and loop iteration. FMA: 16 KiB is 8 16-byte loads
#: per thread of 4 warps, in registers (~125 of them: 4 programs per SM). DOT: 8 KiB per
#: pipeline stage, so the stages of weight and x fit 4 to 6 programs in an SM's shared memory.
FMA_TILE_BYTES = 16384
DOT_TILE_BYTES = 8192
DOT_STAGES = 4
#: Programs per SM the tile choice aims for, before resorting to split-K.
PROGRAMS_PER_SM = 2
#: A split covers at least this much of K, so each program's start-up latency stays a small
#: share of its stream.
MIN_K_PER_SPLIT = 1024
MAX_SPLIT_K = 64


@triton.jit
def _silu_times(g, u):
    """`silu(g) * u` in `g`'s dtype, rounded as `elementwise.silu_mul` rounds (masked lanes load
    zeros: silu(0) * 0 = 0)."""
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    return (a * u.to(tl.float32)).to(g.dtype)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    ws_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # Rows past N read row N - 1 (valid memory, result discarded): no row mask in the loop.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = w_ptr + rows[:, None] * K + (k_lo + offs_k)[None, :]
    if DOT:
        offs_m = tl.arange(0, M_PAD)
        m_ok = offs_m < M
        # x^T tile [BLOCK_K, M_PAD]: the padding rows of x are masked, so they load zeros.
        x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + (k_lo + offs_k)[:, None]
        acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
        for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            if EVEN_K:
                w = tl.load(w_ptrs)
                xmask = m_ok[None, :]
            else:
                k_ok = (k + offs_k) < K
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                xmask = m_ok[None, :] & k_ok[:, None]
            xt = tl.load(x_ptrs, mask=xmask, other=0.0)
            if GATED:
                xt = _silu_times(xt, tl.load(x_ptrs + K, mask=xmask, other=0.0))
            acc = tl.dot(w, xt, acc, input_precision=PRECISION)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        ok = n_ok[:, None] & m_ok[None, :]
        if SPLIT:
            dst = ws_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
            tl.store(dst, acc, mask=ok)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            dst = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
            tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        # One row of x: elementwise products into a 2-D accumulator, reduced once at the end.
        x_ptrs = x_ptr + k_lo + offs_k
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            if EVEN_K:
                w = tl.load(w_ptrs)
                xv = tl.load(x_ptrs)
                if GATED:
                    xv = _silu_times(xv, tl.load(x_ptrs + K))
            else:
                k_ok = (k + offs_k) < K
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                xv = tl.load(x_ptrs, mask=k_ok, other=0.0)
                if GATED:
                    xv = _silu_times(xv, tl.load(x_ptrs + K, mask=k_ok, other=0.0))
            acc2 += w.to(tl.float32) * xv.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        acc = tl.sum(acc2, axis=1)
        if SPLIT:
            tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + offs_n, acc, mask=n_ok)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=["M", "num_splits"])
def _splitk_reduce_kernel(
    ws_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    split_stride,
    num_splits,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    src = ws_ptr + m * N + offs
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    # Splits in index order: the same sum every time.
    for _ in range(num_splits):
        acc += tl.load(src, mask=ok, other=0.0)
        src += split_stride
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _block_k(tile_bytes: int, block_n: int, elem: int, k: int) -> int:
    # Never wider than K rounds up to (a small K is not padded to a big tile); tl.dot needs 16.
    widest = _pow2_floor(tile_bytes // (block_n * elem))
    return max(16, min(widest, triton.next_power_of_2(max(k, 1))))


def _block_n(n: int, choices: tuple, target: int) -> int:
    # The widest tile that still gives `target` programs; the narrowest when none does.
    for bn in choices:
        if triton.cdiv(n, bn) >= target:
            return bn
    return choices[-1]


def gemv_config(
    M: int,
    N: int,
    K: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    num_sms: int = 132,
    dot: bool | None = None,
) -> dict:
    """Launch parameters `linear_small_m` uses for `x [M, K] @ W[N, K].T` (`num_sms`: the
    device's SM count; 132 is the H100/H200's). Deterministic in its arguments.

    Keys: `DOT` (tensor-core path; False is the FMA path, `M == 1` only), `BLOCK_N` (weight rows
    per program), `BLOCK_K` (K per loop iteration), `SPLIT_K` (K ranges; 1 = none),
    `num_warps`, `num_stages` (loop pipelining depth; 1 = none).

    Rule: `M == 1` takes the FMA path (4 warps, no pipelining, `BLOCK_K` = 4 warps x 32 lanes
    x one 16-byte vector: 1024 at 2 bytes), `M > 1` the DOT path (`DOT_STAGES` deep,
    `BLOCK_N / 16` warps: 1, 2 or one warpgroup); `dot` forces a path and its defaults.
    `BLOCK_N` is the widest of the path's choices (FMA: what fills `FMA_TILE_BYTES`, 8 at 2
    bytes, then halves; DOT 64/32/16, with `BLOCK_K` filling `DOT_TILE_BYTES`) that leaves
    `PROGRAMS_PER_SM` programs per SM. A `K` narrower than that `BLOCK_K` gets a tile of its
    own width (rounded up to a power of two, at least 16). Only when even the narrowest tile
    leaves fewer programs than SMs is K split: by the smallest power of two that reaches
    `PROGRAMS_PER_SM` programs per SM, keeping `MIN_K_PER_SPLIT` of K per split. Between one
    and two programs per SM a split is not worth its second launch: the programs are all
    resident at once and together still saturate HBM.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    target = PROGRAMS_PER_SM * num_sms
    if dot is None:
        dot = M > 1
    k_cap = max(16, triton.next_power_of_2(max(K, 1)))
    if not dot:
        warps, stages = 4, 1
        bk = min(k_cap, 16 // elem * 32 * warps)
        widest = min(64, max(1, FMA_TILE_BYTES // (bk * elem)))
        bn = _block_n(N, tuple(widest >> i for i in range(widest.bit_length())), target)
    else:
        stages = DOT_STAGES
        bn = _block_n(N, (64, 32, 16), target)
        warps = max(1, min(4, bn // 16))
        bk = _block_k(DOT_TILE_BYTES, bn, elem, K)
    tiles_n = triton.cdiv(max(N, 1), bn)
    k_tiles = triton.cdiv(max(K, 1), bk)
    split = 1
    if tiles_n < num_sms:
        while (tiles_n * split < target and split * 2 <= MAX_SPLIT_K
               and K // (split * 2) >= MIN_K_PER_SPLIT and k_tiles >= split * 2):
            split *= 2
    return {"DOT": dot, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps,
            "num_stages": stages}


def _check_config(cfg: dict, m: int) -> None:
    if not isinstance(cfg["DOT"], bool):
        raise v.KernelDTypeError(f"config: DOT is {cfg['DOT']!r}, expected a bool")
    if not cfg["DOT"] and m != 1:
        raise v.KernelArgumentError(
            f"config: DOT=False (the FMA path) serves one row of x, got M = {m}"
        )
    for key in ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"):
        v.check_int(f"config[{key!r}]", cfg[key], 1)
    v.check_pow2("config['BLOCK_N']", cfg["BLOCK_N"], 16 if cfg["DOT"] else 1, 256)
    v.check_pow2("config['BLOCK_K']", cfg["BLOCK_K"], 16, 8192)
    v.check_int("config['SPLIT_K']", cfg["SPLIT_K"], 1, 4096)
    v.check_pow2("config['num_warps']", cfg["num_warps"], 1, 16)
    v.check_int("config['num_stages']", cfg["num_stages"], 1, 8)


class _GemvCall:
    """A validated `linear_small_m` signature: its launches, grids and scratch shape."""

    __slots__ = (
        "device",
        "dtype",
        "grid",
        "main",
        "out_shape",
        "reduce",
        "reduce_grid",
        "ws_shape",
    )

    def __call__(self, x, weight, bias, out):
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        if self.main is None:  # N == 0
            return out
        b = bias if bias is not None else weight  # never read without a bias
        if self.reduce is None:
            self.main(self.grid, x, weight, b, out, out)
            return out
        # Per-call scratch: concurrent calls (other streams, a graph and eager) never share it.
        ws = torch.empty(self.ws_shape, dtype=torch.float32, device=self.device)
        self.main(self.grid, x, weight, b, out, ws)
        self.reduce(self.reduce_grid, ws, b, out)
        return out


_CACHE = L.LaunchCache()


def linear_small_m(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    config: dict | None = None,
    silu_mul_input: bool = False,
) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for `x` `[M, K]` with `1 <= M <= MAX_M`; returns `out` `[M, N]`.

    `silu_mul_input=True`: `x` is `[M, 2K]` and the product is `silu(x[:, :K]) * x[:, K:]`
    times the weight, computed while loading `x` (module docs, "Gated input").

    `weight` is `[N, K]` contiguous (an `nn.Linear` weight), `bias` `[N]` or None; `x` may be a
    row-strided view (unit inner stride); `out`, when given, is `[M, N]` with a unit inner
    stride. All share one dtype (bf16, fp16 or fp32) and device. Accumulates in fp32 and rounds
    once to the dtype. `config` overrides keys of `gemv_config(M, N, K)` (for tuning). Raises
    `KernelDTypeError`, `KernelShapeError`, `KernelDeviceError`, `KernelLayoutError` or
    `KernelArgumentError` before launching anything. No host synchronization; graph-capturable.
    """
    try:
        key = (L.tensor_key(x), L.tensor_key(weight),
               None if bias is None else L.tensor_key(bias),
               None if out is None else L.tensor_key(out),
               None if config is None else tuple(sorted(config.items())),
               silu_mul_input is True)
        call = _CACHE.get(key)
    except (AttributeError, TypeError):
        key = call = None
    if call is not None:
        return call(x, weight, bias, out)
    call = _prepare(x, weight, bias, out, config, silu_mul_input)
    if key is not None:
        _CACHE.put(key, call)
    return call(x, weight, bias, out)


def _prepare(x, weight, bias, out, config, gated=False) -> _GemvCall:
    if gated is not True and gated is not False:
        raise v.KernelDTypeError(f"silu_mul_input: expected a bool, got {type(gated).__name__}")
    v.check_tensor("x", x, ndim=2, dtypes=DTYPES)
    v.check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,))
    dev = x.device
    v.check_same_device(dev, weight=weight)
    v.ensure_launchable(dev)
    m, k = x.shape
    n = weight.shape[0]
    if gated:
        if weight.shape[1] * 2 != k:
            raise v.KernelShapeError(
                f"x: has {k} columns (dim 1), expected {2 * weight.shape[1]} (gate and up halves "
                f"of weight's K = {weight.shape[1]}) with silu_mul_input"
            )
        k = weight.shape[1]
    if m < 1 or m > MAX_M:
        raise v.KernelShapeError(
            f"x: has {m} rows (dim 0), expected 1 to {MAX_M} (larger M belongs to a GEMM)"
        )
    v.check_dim("weight", weight, 1, k, "K, as x's dim 1")
    v.check_inner_contiguous("x", x, 1)
    v.check_contiguous("weight", weight)
    if bias is not None:
        v.check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,))
        v.check_same_device(dev, bias=bias)
        v.check_dim("bias", bias, 0, n, "N, as weight's dim 0")
        v.check_contiguous("bias", bias)
    if out is not None:
        v.check_tensor("out", out, ndim=2, dtypes=(x.dtype,))
        v.check_same_device(dev, out=out)
        if tuple(out.shape) != (m, n):
            raise v.KernelShapeError(
                f"out: shape is {tuple(out.shape)}, expected {(m, n)} (x rows, weight rows)"
            )
        v.check_inner_contiguous("out", out, 1)
    if config is not None and not isinstance(config, dict):
        raise v.KernelDTypeError(f"config: expected a dict, got {type(config).__name__}")
    # A forced path starts from that path's defaults (its tiles differ).
    dot = config.get("DOT") if config is not None else None
    cfg = gemv_config(m, n, k, dtype=x.dtype, num_sms=num_sms(dev),
                      dot=dot if isinstance(dot, bool) else None)
    cfg = v.merge_config(cfg, config)
    _check_config(cfg, m)
    call = _GemvCall()
    call.out_shape, call.dtype, call.device = (m, n), x.dtype, dev
    call.main = call.reduce = None
    if n == 0:
        return call
    bk = cfg["BLOCK_K"]
    k_tiles = triton.cdiv(max(k, 1), bk)
    # Equal ranges of whole tiles; a requested split count past the tile count shrinks to it.
    k_per_split = triton.cdiv(k_tiles, min(cfg["SPLIT_K"], k_tiles)) * bk
    splits = triton.cdiv(max(k, 1), k_per_split)
    stride_om = out.stride(0) if out is not None else n
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    # x's rows on the MMA's N side: 8 is its narrowest; the FMA path does not read it.
    m_pad = max(8, triton.next_power_of_2(m))
    call.grid = (triton.cdiv(n, cfg["BLOCK_N"]), splits)
    call.main = L.Launch(
        _gemv_kernel,
        (m, n, k, x.stride(0), stride_om, k_per_split),
        {"HAS_BIAS": bias is not None, "GATED": gated, "SPLIT": splits > 1, "DOT": cfg["DOT"],
         "M_PAD": m_pad,
         "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": bk, "EVEN_K": k % bk == 0,
         "STAGES": cfg["num_stages"], "PRECISION": precision, "num_warps": cfg["num_warps"],
         "num_stages": cfg["num_stages"]},
    )
    if splits > 1:
        call.ws_shape = (splits, m, n)
        block = min(1024, triton.next_power_of_2(n))
        call.reduce_grid = (m, triton.cdiv(n, block))
        call.reduce = L.Launch(
            _splitk_reduce_kernel, (m, n, stride_om, m * n, splits),
            {"HAS_BIAS": bias is not None, "BLOCK": block, "num_warps": 4},
        )
    return call
