"""Triton kernels for the paged KV cache, with plain PyTorch references.

Owns the GPU side of the data path: `scatter_kv` (write new K/V through the slot mapping),
`paged_decode` (+ `DecodeWorkspace`, split-K, `DecodePlanBuffers`: the device side of a ragged
batch's plan), `paged_prefill` (varlen prefill/extend, causal over cached prefix + new tokens),
`copy_blocks`/`BlockCopier` (copy-on-write across all layers in one launch) and `swap_blocks`
(device <-> pinned host). Every entry point validates its arguments and
raises a `KernelArgumentError` (ValueError) or `KernelDTypeError` (TypeError) before launching;
the checks and launch configuration are cached per call signature (`_launch.py`). Pools may be
bf16, fp16, fp32 or float8_e4m3fn (with `k_scale`/`v_scale`).

This package imports torch and triton; `pagedkv` itself does not import it, so the rest of the
package stays usable without them. It never imports the Rust extension: the kernels take device
tensors only, and the planner that fills a plan on the host is `pagedkv.decode_plan.DecodePlan`.
`num_sms` is the device's SM count the launch heuristics size grids by. See docs/kernels.md.
"""

from ._interpreter_compat import apply as _apply_interpreter_compat

_apply_interpreter_compat()

from ._validate import (  # noqa: E402
    KernelArgumentError,
    KernelDeviceError,
    KernelDTypeError,
    KernelIndexError,
    KernelLayoutError,
    KernelShapeError,
)
from .copy import BlockCopier, copy_blocks, swap_blocks  # noqa: E402
from .decode import (  # noqa: E402
    DecodePlanBuffers,
    DecodeWorkspace,
    choose_num_splits,
    num_sms,
    paged_decode,
)
from .gemv import linear_small_m  # noqa: E402
from .prefill import paged_prefill  # noqa: E402
from .scatter import scatter_kv  # noqa: E402

__all__ = [
    "KernelArgumentError",
    "KernelDeviceError",
    "KernelDTypeError",
    "KernelIndexError",
    "KernelLayoutError",
    "KernelShapeError",
    "BlockCopier",
    "copy_blocks",
    "swap_blocks",
    "DecodePlanBuffers",
    "DecodeWorkspace",
    "choose_num_splits",
    "num_sms",
    "paged_decode",
    "linear_small_m",
    "paged_prefill",
    "scatter_kv",
]

