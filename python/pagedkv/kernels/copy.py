"""Block copy: copy-on-write across every layer in one launch, and swap to/from a host pool.

Owns `BlockCopier`, `copy_blocks` and `swap_blocks`.

`BlockCopier` takes the list of pool tensors to touch (typically every layer's K and V; all of
shape `[num_blocks, ...]`, contiguous, one dtype, one device) and records each one's element
offset from the first, once. A copy launch then gets the `(src, dst)` list (int64 `[n, 2]`) and
moves, for every pair and every tensor, the whole block: one kernel for all layers, no pointer
table rebuilt per step, no allocation, so it can be captured in a CUDA graph. Blocks are moved as
same-width integers, so the copy is bit-exact for any dtype.

Invariants: pairs with a negative or out-of-range id are skipped (padding); all reads see the pool
as it was before the launch only if no destination is also a source and destinations are
distinct (the manager guarantees this for copy-on-write; overlapping lists are undefined).

`swap_blocks` moves blocks between a device pool and a pinned host pool. By default one Triton
launch copies every (block, tensor) pair with the GPU reading or writing the pinned host memory
directly (zero-copy over the link); the PyTorch fallback gathers into a contiguous staging
tensor, makes one host<->device transfer per pool tensor and scatters on the other side.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from . import _validate as v

__all__ = ["BlockCopier", "copy_blocks", "swap_blocks"]

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_kernel(
    base_ptr,
    offsets_ptr,
    map_ptr,
    num_blocks,
    BLOCK_ELEMS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    t = tl.program_id(1)
    c = tl.program_id(2)
    src = tl.load(map_ptr + 2 * pair)
    dst = tl.load(map_ptr + 2 * pair + 1)
    ok = (src >= 0) & (dst >= 0) & (src < num_blocks) & (dst < num_blocks)
    base = base_ptr + tl.load(offsets_ptr + t)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    m = ok & (offs < BLOCK_ELEMS)
    x = tl.load(base + src * BLOCK_ELEMS + offs, mask=m)
    tl.store(base + dst * BLOCK_ELEMS + offs, x, mask=m)


@triton.jit
def _xcopy_kernel(
    src_base,
    dst_base,
    src_offsets_ptr,
    dst_offsets_ptr,
    map_ptr,
    num_src_blocks,
    num_dst_blocks,
    BLOCK_ELEMS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # Same as _copy_kernel but between two sets of tensors: one side may be pinned host memory,
    # which the GPU reads or writes directly over the link (no staging copies).
    pair = tl.program_id(0)
    t = tl.program_id(1)
    c = tl.program_id(2)
    src = tl.load(map_ptr + 2 * pair)
    dst = tl.load(map_ptr + 2 * pair + 1)
    ok = (src >= 0) & (dst >= 0) & (src < num_src_blocks) & (dst < num_dst_blocks)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    m = ok & (offs < BLOCK_ELEMS)
    x = tl.load(src_base + tl.load(src_offsets_ptr + t) + src * BLOCK_ELEMS + offs, mask=m)
    tl.store(dst_base + tl.load(dst_offsets_ptr + t) + dst * BLOCK_ELEMS + offs, x, mask=m)


def _element_offsets(caches, int_dtype, name):
    first = caches[0]
    esize = first.element_size()
    offs = []
    for i, c in enumerate(caches):
        delta = c.data_ptr() - first.data_ptr()
        if delta % esize:
            raise v.KernelLayoutError(
                f"{name}[{i}]: address is {delta} bytes from {name}[0], expected a multiple of "
                f"the element size {esize}"
            )
        offs.append(delta // esize)
    return first.view(int_dtype), torch.tensor(offs, dtype=torch.int64)


def _check_caches(caches: Sequence[torch.Tensor]):
    if isinstance(caches, torch.Tensor) or not hasattr(caches, "__len__"):
        raise v.KernelDTypeError(
            f"caches: expected a sequence of tensors, got {type(caches).__name__}"
        )
    if len(caches) == 0:
        raise v.KernelShapeError("caches: is empty, expected at least one tensor")
    first = caches[0]
    if not isinstance(first, torch.Tensor):
        raise v.KernelDTypeError(f"caches[0]: expected a torch.Tensor, got {type(first).__name__}")
    if first.dim() < 2:
        raise v.KernelShapeError(
            f"caches[0]: has {first.dim()} dimensions, expected at least 2 ([num_blocks, ...])"
        )
    for i, c in enumerate(caches):
        name = f"caches[{i}]"
        if not isinstance(c, torch.Tensor):
            raise v.KernelDTypeError(f"{name}: expected a torch.Tensor, got {type(c).__name__}")
        if c.dtype != first.dtype:
            raise v.KernelDTypeError(f"{name}: dtype is {c.dtype}, expected {first.dtype}")
        if tuple(c.shape) != tuple(first.shape):
            raise v.KernelShapeError(
                f"{name}: shape is {tuple(c.shape)}, expected {tuple(first.shape)}"
            )
        v.check_same_device(first.device, **{name: c})
        v.check_contiguous(name, c)
    return first


def _check_mapping(block_mapping, device) -> None:
    v.check_tensor("block_mapping", block_mapping, ndim=2, dtypes=(torch.int64,))
    v.check_dim("block_mapping", block_mapping, 1, 2, "(src, dst) pairs")
    v.check_same_device(device, block_mapping=block_mapping)
    v.check_contiguous("block_mapping", block_mapping)


class BlockCopier:
    """Copies blocks within each of a fixed set of pool tensors, all in one launch per call."""

    def __init__(self, caches: Sequence[torch.Tensor]):
        first = _check_caches(caches)
        v.ensure_launchable(first.device)
        esize = first.element_size()
        self.device = first.device
        self.num_blocks = first.shape[0]
        self.block_elems = first[0].numel()
        self.num_tensors = len(caches)
        self._caches = list(caches)  # keeps the storage alive while offsets point into it
        int_dtype = _INT_OF_SIZE[esize]
        self._base = first.view(int_dtype)
        base_addr = first.data_ptr()
        offs = []
        for i, c in enumerate(caches):
            delta = c.data_ptr() - base_addr
            if delta % esize:
                raise v.KernelLayoutError(
                    f"caches[{i}]: address is {delta} bytes from caches[0], expected a multiple "
                    f"of the element size {esize}"
                )
            offs.append(delta // esize)
        self._offsets = torch.tensor(offs, dtype=torch.int64).to(self.device)
        self._chunk = min(triton.next_power_of_2(self.block_elems), 4096)

    def __call__(self, block_mapping: torch.Tensor, *, check_indices: bool = False) -> None:
        """Applies `dst <- src` for every `(src, dst)` row of `block_mapping` to every tensor."""
        _check_mapping(block_mapping, self.device)
        n = block_mapping.shape[0]
        if check_indices and n:
            _check_pairs(block_mapping, self.num_blocks)
        if n == 0:
            return
        grid = (n, self.num_tensors, triton.cdiv(self.block_elems, self._chunk))
        _copy_kernel[grid](
            self._base, self._offsets, block_mapping, self.num_blocks,
            BLOCK_ELEMS=self.block_elems, CHUNK=self._chunk, num_warps=4,
        )


def _check_pairs(block_mapping: torch.Tensor, num_blocks: int) -> None:
    pairs = block_mapping.to("cpu")
    bad = ((pairs >= num_blocks) | (pairs < 0)).any(dim=1).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise v.KernelIndexError(
            f"block_mapping[{i}]: is {pairs[i].tolist()}, expected ids in [0, {num_blocks})"
        )
    dst = pairs[:, 1]
    if torch.unique(dst).numel() != dst.numel():
        raise v.KernelIndexError("block_mapping: destinations repeat, expected distinct ones")
    if torch.isin(dst, pairs[:, 0]).any():
        raise v.KernelIndexError("block_mapping: a destination is also a source, expected none")


def copy_blocks(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
    *,
    check_indices: bool = False,
) -> None:
    """One-shot form of `BlockCopier(list(k_caches) + list(v_caches))(block_mapping)`.

    Builds the offset table each call (a small allocation and host-to-device copy); hold a
    `BlockCopier` instead on the hot path or under CUDA graphs.
    """
    if len(k_caches) != len(v_caches):
        raise v.KernelShapeError(
            f"v_caches: has {len(v_caches)} tensors, expected {len(k_caches)} (as k_caches)"
        )
    BlockCopier(list(k_caches) + list(v_caches))(block_mapping, check_indices=check_indices)


def swap_blocks(
    src_caches: Sequence[torch.Tensor],
    dst_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
    *,
    staging: Optional[torch.Tensor] = None,
    method: str = "auto",
) -> None:
    """Copies block `src` of each `src_caches[i]` to block `dst` of `dst_caches[i]`.

    One side is the device pool and the other a host pool (pinned for full link bandwidth; either
    direction), or both on one device. `block_mapping` is int64 `[n, 2]` on the CPU, ids in range
    (checked here: the mapping is on the host already, so this costs no sync).

    `method`: `"kernel"` runs one Triton launch that reads/writes the pinned host tensors directly
    from the GPU (zero-copy; needs every host tensor pinned); `"torch"` gathers into one contiguous
    staging tensor per pool tensor, moves it with one transfer and scatters on the other side
    (`staging`, if given, is a pinned host buffer of at least `n * block_bytes` bytes reused
    across calls); `"auto"` takes the kernel when its conditions hold. Returns after the copies
    are complete, so host-side data may be read at once.
    """
    if method not in ("auto", "kernel", "torch"):
        raise v.KernelArgumentError(f"method: is {method!r}, expected 'auto', 'kernel' or 'torch'")
    src0 = _check_caches(src_caches)
    dst0 = _check_caches(dst_caches)
    if len(src_caches) != len(dst_caches):
        raise v.KernelShapeError(
            f"dst_caches: has {len(dst_caches)} tensors, expected {len(src_caches)} (as src_caches)"
        )
    if src0.dtype != dst0.dtype:
        raise v.KernelDTypeError(f"dst_caches: dtype is {dst0.dtype}, expected {src0.dtype}")
    if tuple(src0.shape[1:]) != tuple(dst0.shape[1:]):
        raise v.KernelShapeError(
            f"dst_caches: block shape is {tuple(dst0.shape[1:])}, expected "
            f"{tuple(src0.shape[1:])} (as src_caches)"
        )
    _check_mapping(block_mapping, torch.device("cpu"))
    n = block_mapping.shape[0]
    if n == 0:
        return
    src_ids = block_mapping[:, 0]
    dst_ids = block_mapping[:, 1]
    for name, ids, lim in (("src", src_ids, src0.shape[0]), ("dst", dst_ids, dst0.shape[0])):
        bad = ((ids < 0) | (ids >= lim)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise v.KernelIndexError(
                f"block_mapping[{i}]: {name} id is {int(ids[i])}, expected in [0, {lim})"
            )
    block_shape = tuple(src0.shape[1:])
    nbytes = n * src0[0].numel() * src0.element_size()
    cross = src0.device != dst0.device
    host_side = src0 if src0.device.type == "cpu" else dst0
    if cross and host_side.device.type != "cpu":
        raise v.KernelDeviceError(
            f"src/dst caches are on {src0.device} and {dst0.device}, expected one on cpu"
        )
    stage = None
    if staging is not None:
        if not isinstance(staging, torch.Tensor) or staging.device.type != "cpu":
            raise v.KernelDeviceError("staging: expected a host (pinned) tensor")
        if staging.numel() * staging.element_size() < nbytes:
            raise v.KernelShapeError(
                f"staging: holds {staging.numel() * staging.element_size()} bytes, expected "
                f"at least {nbytes}"
            )
        v.check_contiguous("staging", staging)
    gpu = src0.device if src0.device.type != "cpu" else dst0.device
    interp = gpu.type == "cpu"  # both on the host: only possible under the interpreter
    pinned_ok = all(t.is_pinned() for t in (src_caches if src0.device.type == "cpu" else dst_caches)) \
        if cross else True
    use_kernel = method == "kernel" or (method == "auto" and cross and pinned_ok)
    if use_kernel:
        if cross and not pinned_ok:
            raise v.KernelDeviceError(
                "host caches: are not pinned, expected pinned memory for method='kernel'"
            )
        v.ensure_launchable(gpu)
        int_dtype = _INT_OF_SIZE[src0.element_size()]
        sbase, soffs = _element_offsets(src_caches, int_dtype, "src_caches")
        dbase, doffs = _element_offsets(dst_caches, int_dtype, "dst_caches")
        mapping = block_mapping.to(gpu, non_blocking=True)
        block_elems = src0[0].numel()
        chunk = min(triton.next_power_of_2(block_elems), 4096)
        grid = (n, len(src_caches), triton.cdiv(block_elems, chunk))
        _xcopy_kernel[grid](
            sbase, dbase, soffs.to(gpu, non_blocking=True), doffs.to(gpu, non_blocking=True),
            mapping, src0.shape[0], dst0.shape[0],
            BLOCK_ELEMS=block_elems, CHUNK=chunk, num_warps=4,
        )
        if not interp:
            torch.cuda.current_stream(gpu).synchronize()
        return
    if cross:
        if staging is not None:
            stage = staging.view(torch.uint8)[:nbytes].view(src0.dtype).view(n, *block_shape)
        else:
            stage = torch.empty((n, *block_shape), dtype=src0.dtype, pin_memory=torch.cuda.is_available())
    src_idx = src_ids.to(src0.device, non_blocking=True)
    dst_idx = dst_ids.to(dst0.device, non_blocking=True)
    for s, d in zip(src_caches, dst_caches):
        if not cross:
            d.index_copy_(0, dst_idx, s.index_select(0, src_idx))
            continue
        if s.device.type == "cuda":
            # Swap out: gather on the device, one D2H transfer, scatter on the host.
            stage.copy_(s.index_select(0, src_idx), non_blocking=True)
            torch.cuda.current_stream(s.device).synchronize()
            d.index_copy_(0, dst_idx, stage)
        else:
            # Swap in: gather on the host into pinned memory, one H2D transfer, scatter there.
            torch.index_select(s, 0, src_idx, out=stage)
            d.index_copy_(0, dst_idx, stage.to(d.device, non_blocking=True))
            # The next iteration overwrites `stage`; the transfer must have read it first.
            torch.cuda.current_stream(d.device).synchronize()
