"""The KV pool: the device tensors that hold every block's keys and values.

:class:`KVPool` owns one tensor, allocated once and never resized::

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

Index 0 of the second axis is K, index 1 is V. ``k_caches[l]`` and ``v_caches[l]`` are views
``kv[l, 0]`` and ``kv[l, 1]`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``: each is
contiguous (head_dim innermost), which is the per-layer layout the kernels take, and each stays at
a fixed address for the pool's lifetime (CUDA-graph safe). One backing tensor rather than
``2 × layers`` separate ones lets a block copy (copy-on-write, swap) touch every layer's K and V in a
single gather/scatter instead of a Python loop over layers.

An fp8 pool (``float8_e4m3fn``) also holds ``k_scales[l]`` / ``v_scales[l]``: float32
``[num_kv_heads]`` dequantization scales per layer (views of one ``scales`` tensor, 1.0 at first),
which ``scatter_kv`` / ``paged_decode`` / ``paged_prefill`` take as ``k_scale`` / ``v_scale``.

KV cache groups (``layer_slot=``, :mod:`pagedkv.layer_groups`): a model whose layers form several
groups (sliding-window or chunked layers beside full ones) stores, in page ``b``, the K/V of one
group's layers, ``spec.num_layers`` of them (the grouping's ``slots``); the manager hands page
``b`` to one group at a time. ``kv``'s first axis is then the page slot, and model layer ``l``'s
``k_caches[l]`` / ``v_caches[l]`` are the views of its slot ``layer_slot[l]`` (layers of different
groups share a view; they never touch the same block). ``slot_k_caches`` / ``slot_v_caches`` are
the per-slot views themselves (one per slot, what a block copy walks); without ``layer_slot`` they
are ``k_caches`` / ``v_caches``.

Physical slot ``s`` of the manager's slot mapping is ``(block, offset) = divmod(s, block_size)``.

Invariants: the pool's shape, dtype and device never change after construction; the manager, not
the pool, decides which blocks are in use; :meth:`KVPool.copy_blocks` validates its whole argument
before writing anything, so a rejected copy list leaves the pool untouched.

This module imports torch at import time; ``import pagedkv`` does not import this module.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

import torch

from ._checks import allocate, check_flag, parse_device
from .config import CacheSpec
from .errors import InvalidArgumentError, InvalidBlockError, InvalidConfigError

__all__ = ["KVPool", "copy_blocks_reference"]

PairsLike = Union["torch.Tensor", Sequence[Sequence[int]], Iterable[Sequence[int]]]


class KVPool:
    """Per-layer K and V block tensors for ``num_blocks`` blocks of ``spec``.

    Args:
        spec: The cache spec (layers, KV heads, head size, dtype, block size).
        num_blocks: Number of blocks, ≥ 1 (what :func:`pagedkv.config.num_blocks_for` returns).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a :class:`torch.device`.
        zero: Zero-fill the pool (default), so a freshly allocated pool holds no garbage that a
            debugging read could mistake for data. The kernels never read unwritten slots (they
            mask by sequence length), so ``zero=False`` is safe and saves one memset.
        layer_slot: With KV cache groups: each model layer's page slot (an int in
            ``[0, spec.num_layers)`` per layer, every slot used); ``k_caches`` then has one view
            per model layer. None (the default): one slot per layer, ``spec.num_layers`` layers.

    Raises:
        InvalidConfigError: ``spec`` is not a CacheSpec or ``num_blocks`` is not an int >= 1.
        InvalidArgumentError: ``device`` is not ``cpu`` or an available CUDA device, or ``zero``
            is not a bool.
        AllocationFailedError: The pool does not fit the device's memory.
    """

    def __init__(self, spec: CacheSpec, num_blocks: int, device: Union[str, torch.device] = "cpu",
                 *, zero: bool = True, layer_slot: Optional[Sequence[int]] = None) -> None:
        if not isinstance(spec, CacheSpec):
            raise InvalidConfigError(f"spec must be a CacheSpec, got {type(spec).__name__}")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise InvalidConfigError(f"num_blocks must be an integer >= 1, got {num_blocks!r}",
                                     field="num_blocks", value=num_blocks, reason="must be >= 1")
        dev = parse_device(device)
        zero = check_flag("zero", zero)
        slots = list(range(spec.num_layers)) if layer_slot is None else list(layer_slot)
        if layer_slot is not None and (
                not slots or any(isinstance(x, bool) or not isinstance(x, int) for x in slots)
                or set(slots) != set(range(spec.num_layers))):
            raise InvalidConfigError(
                f"layer_slot must give each model layer a page slot in [0, {spec.num_layers}) "
                f"and use every slot, got {slots!r}"[:300], field="layer_slot", value=len(slots),
                reason=f"slots in [0, {spec.num_layers}), all used")
        self.spec = spec
        self.num_blocks = num_blocks
        self.dtype: torch.dtype = getattr(torch, spec.dtype)
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        alloc = torch.zeros if zero else torch.empty
        self.kv: torch.Tensor = allocate(
            f"KV pool ({num_blocks} blocks on {dev})",
            num_blocks * spec.bytes_per_block,
            lambda: alloc(shape, dtype=self.dtype, device=dev),
        )
        self.device: torch.device = self.kv.device
        #: One K / V view per page slot (per layer without groups).
        self.slot_k_caches: list[torch.Tensor] = [self.kv[s, 0] for s in range(spec.num_layers)]
        self.slot_v_caches: list[torch.Tensor] = [self.kv[s, 1] for s in range(spec.num_layers)]
        #: Each model layer's K / V view (its slot's).
        self.k_caches: list[torch.Tensor] = [self.slot_k_caches[s] for s in slots]
        self.v_caches: list[torch.Tensor] = [self.slot_v_caches[s] for s in slots]
        # Copies move raw bytes: float8 has no CPU index kernels, and a byte copy is exact for
        # every dtype (no NaN canonicalisation, no rounding).
        self._raw = self.kv.view(torch.uint8)
        self._copier = None  # the Triton block copier, built on the first CUDA copy
        # fp8 caches store x / scale: one float32 scale per layer and kv head for K and for V
        # (1.0 until a caller calibrates them; the kernels take them as k_scale / v_scale).
        self.k_scales: list[torch.Tensor] = []
        self.v_scales: list[torch.Tensor] = []
        if self.dtype.itemsize == 1 and self.dtype.is_floating_point:
            ones = torch.ones(2, len(slots), spec.num_kv_heads, dtype=torch.float32,
                              device=self.device)
            self.scales = ones
            self.k_scales = [ones[0, layer] for layer in range(len(slots))]
            self.v_scales = [ones[1, layer] for layer in range(len(slots))]

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def num_layers(self) -> int:
        """Layers a page holds (``spec.num_layers``): the model's layers, or with
        ``layer_slot`` the page slots."""
        return self.spec.num_layers

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool: ``num_blocks × spec.bytes_per_block``."""
        return self.kv.numel() * self.kv.element_size()

    @property
    def num_slots(self) -> int:
        """Token slots in the pool: ``num_blocks × block_size``."""
        return self.num_blocks * self.spec.block_size

    def _check_block(self, block: int) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise InvalidBlockError(
                f"block id {block!r} out of range: the pool holds {self.num_blocks} blocks",
                block=block, num_blocks=self.num_blocks,
            )

    def block_view(self, layer: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(K, V)`` of one block in one layer, each ``[block_size, num_kv_heads, head_dim]``.

        Writes through the views land in the pool.
        """
        n = len(self.k_caches)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
            raise InvalidArgumentError(
                f"invalid argument: layer = {layer!r}: the pool has {n} layers",
                what="layer", value=layer, reason=f"must be in [0, {n})",
            )
        self._check_block(block)
        return self.k_caches[layer][block], self.v_caches[layer][block]

    def copy_blocks(self, pairs: PairsLike) -> int:
        """Copy block ``src`` onto block ``dst`` in every layer's K and V, for each ``(src, dst)``.

        ``pairs`` is an ``[n, 2]`` integer tensor or array, a flat ``[2n]`` one (the manager's
        ``copies`` buffer layout: src, dst, src, dst, …), or a sequence of pairs. All copies read
        the pool as it was before the call. Destinations must be distinct and must not also be a
        source in the same call: with either, the result would depend on copy order. Returns the
        number of pairs applied. Invalid input raises before anything is written.
        """
        src, dst = self._validate_pairs(pairs)
        if src.numel() == 0:
            return 0
        if self.device.type == "cuda":
            # One Triton launch over every layer's K and V; measured ~15x faster on an H200 than
            # the advanced-indexing path below (docs/performance.md, block copy).
            if self._copier is None:
                from .kernels.copy import BlockCopier

                self._copier = BlockCopier(self.slot_k_caches + self.slot_v_caches)
            mapping = torch.stack((src, dst), dim=1).to(self.device, non_blocking=True)
            self._copier(mapping)
            return int(src.numel())
        # Advanced indexing gathers every source before the scatter writes, for all layers at once.
        self._raw[:, :, dst] = self._raw[:, :, src]
        return int(src.numel())

    def _validate_pairs(self, pairs: PairsLike) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(pairs, torch.Tensor):
            t = pairs.detach().to("cpu")
        else:
            try:
                t = torch.as_tensor(pairs)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise InvalidArgumentError(
                    f"invalid argument: pairs: not an integer array of (src, dst) pairs: {exc}",
                    what="pairs", value=-1, reason="not an integer array",
                ) from None
        if t.numel() == 0:
            empty = torch.empty(0, dtype=torch.int64)
            return empty, empty
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise InvalidArgumentError(
                f"invalid argument: pairs has dtype {t.dtype}; block ids must be integers",
                what="pairs", value=-1, reason="dtype must be an integer type",
            )
        if t.dim() == 1 and t.numel() % 2 == 0:
            t = t.reshape(-1, 2)
        if t.dim() != 2 or t.shape[1] != 2:
            raise InvalidArgumentError(
                f"invalid argument: pairs has shape {tuple(t.shape)}; expected [n, 2] or a flat [2n]",
                what="pairs", value=t.numel(), reason="shape must be [n, 2] or [2n]",
            )
        t = t.to(torch.int64)
        bad = (t < 0) | (t >= self.num_blocks)
        if bool(bad.any()):
            block = int(t[bad][0])
            raise InvalidBlockError(
                f"block id {block} out of range: the pool holds {self.num_blocks} blocks",
                block=block, num_blocks=self.num_blocks,
            )
        src, dst = t[:, 0].contiguous(), t[:, 1].contiguous()
        if torch.unique(dst).numel() != dst.numel():
            raise InvalidArgumentError(
                "invalid argument: pairs: a destination block appears twice",
                what="pairs", value=dst.numel(), reason="destinations must be distinct",
            )
        overlap = torch.isin(dst, src)
        if bool(overlap.any()):
            block = int(dst[overlap][0])
            raise InvalidArgumentError(
                f"invalid argument: pairs: block {block} is both a source and a destination",
                what="pairs", value=block, reason="a destination must not also be a source",
            )
        return src, dst

    def __repr__(self) -> str:
        s = self.spec
        return (f"KVPool(layers={s.num_layers}, blocks={self.num_blocks}, block_size={s.block_size}, "
                f"kv_heads={s.num_kv_heads}, head_dim={s.head_dim}, dtype={s.dtype}, "
                f"device={self.device}, nbytes={self.nbytes})")


def copy_blocks_reference(pool: KVPool, pairs: Sequence[tuple[int, int]]) -> None:
    """One-pair-at-a-time block copy over each layer: the plain definition ``copy_blocks`` must match.

    Kept for tests and for checking the Triton block-copy kernel. Sources are snapshotted first so
    the semantics equal :meth:`KVPool.copy_blocks` (all reads before all writes).
    """
    ks, vs = pool.slot_k_caches, pool.slot_v_caches
    snap = [(int(src), int(dst), [(ks[slot][int(src)].clone(), vs[slot][int(src)].clone())
                                  for slot in range(pool.num_layers)])
            for src, dst in pairs]
    for _src, dst, per_slot in snap:
        for slot, (k, v) in enumerate(per_slot):
            ks[slot][dst].copy_(k)
            vs[slot][dst].copy_(v)
