"""Shared set-up of the kernel test modules: where kernels can run, and how close is close enough.

Imported first thing by each `test_kernels_*` module. Without CUDA the kernels run under Triton's
interpreter, which must be switched on (TRITON_INTERPRET=1) before triton is first imported; when
neither is available the importing module is skipped as a whole, with the reason.
"""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not CUDA and not INTERP:
    pytest.skip(
        "kernel tests need a CUDA device, or TRITON_INTERPRET=1 exported before the run to "
        "interpret them on the CPU",
        allow_module_level=True,
    )

# The CPU variant runs interpreted; the `gpu` variant runs compiled, and is skipped under the
# interpreter even where CUDA exists (the interpreter would run it on host copies).
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERP, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA, compiled")],
    ),
]

# Relative-error bounds against the float64 reference, per input dtype.
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def rel_err(out, ref):
    """‖out − ref‖ / ‖ref‖ in float64."""
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_paged(lens, block_size, kv_heads, head_dim, dtype, device, gen, spare=3):
    """A NaN-poisoned pool with each sequence's tokens in randomly permuted blocks.

    Returns (k_cache, v_cache, block_tables); table columns past a sequence's blocks hold ids far
    out of range, which a kernel must never follow.
    """
    nblk = [-(-n // block_size) for n in lens]
    num_blocks = sum(nblk) + spare
    width = max(nblk + [1]) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    k = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    vv = torch.full_like(k, float("nan"))
    bt = torch.randint(1 << 24, 1 << 30, (len(lens), width), generator=gen, dtype=torch.int32)
    pos = 0
    for i, n in enumerate(lens):
        ids = perm[pos : pos + nblk[i]]
        pos += nblk[i]
        bt[i, : nblk[i]] = ids.int()
        for j, b in enumerate(ids.tolist()):
            cnt = min(block_size, n - j * block_size)
            k[b, :cnt] = torch.randn(cnt, kv_heads, head_dim, generator=gen).to(dtype)
            vv[b, :cnt] = torch.randn(cnt, kv_heads, head_dim, generator=gen).to(dtype)
    return k.to(device), vv.to(device), bt.to(device)


# Argument-check tests build CPU tensors: only the interpreter launches on those, and compiled
# runs reject them for their device before reaching the check under test.
host_tensors_only = pytest.mark.skipif(
    not INTERP, reason="builds CPU tensors, which only the interpreter (TRITON_INTERPRET=1) accepts"
)


def run_isolated(module: str, case: str, *args, timeout: float = 300.0) -> None:
    """Runs `module.case("cpu", *args)` interpreted in a fresh Python process.

    For cases that, on kernels without bounds, read or write outside their tensors: under the
    interpreter that is a segfault or heap corruption, which must fail this one test (with the
    child's exit status and output) rather than end the whole run. `args` must be literals.
    """
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    call = f"import {module} as m; m.{case}('cpu', *{args!r})"
    r = subprocess.run(
        [sys.executable, "-c", call], env=env, capture_output=True, text=True, timeout=timeout
    )
    if r.returncode != 0:
        how = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
        tail = (r.stdout + r.stderr)[-3000:]
        raise AssertionError(f"{case}{args!r} failed in the child process ({how}):\n{tail}")
