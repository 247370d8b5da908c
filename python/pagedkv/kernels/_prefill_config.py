"""Host-side launch heuristics of paged prefill: tile configs and the split count.

Owns the limits the kernels index within (`MAX_SEQ_CAP`, `MAX_ROWS`, `_MAX_GRID_Z`), the
automatic split count (`_num_splits`, `_split_chunk` and their knobs `MIN_CHUNK`,
`SPLIT_WAVES`) and the launch parameters (`prefill_config`, `_tile_config`). Invariants: pure
functions of shapes and host integers (no device access, no synchronization); a split's chunk
is a whole number of key tiles and no automatic split is left empty.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _validate as v

#: Longest context the kernels serve (as in decode: token indices stay in int32).
MAX_SEQ_CAP = 1 << 30

#: Rows of q (new tokens in one call) the kernel indexes in int32.
MAX_ROWS = 1 << 30

#: Fewest keys the automatic split count gives a split: a shorter one pays its q load and its
#: partial rows' traffic for too few key tiles.
MIN_CHUNK = 512

#: Programs per SM the automatic split count aims for.
SPLIT_WAVES = 2

#: CUDA's limit on grid axis 2, which holds num_seqs * splits.
_MAX_GRID_Z = 65535


def _split_chunk(max_seq_len: int, splits: int, block_n: int) -> int:
    """Keys per split: `splits` equal shares of `max_seq_len`, rounded up to whole key tiles."""
    per = -(-max_seq_len // splits)
    return max(block_n, -(-per // block_n) * block_n)


def _num_splits(programs: int, max_seq_len: int, block_n: int, sms: int) -> int:
    """Automatic split count for an unsplit grid of `programs` over contexts of at most
    `max_seq_len` keys: 1 when the grid already fills the `sms` SMs; otherwise enough splits for
    about SPLIT_WAVES programs per SM, each at least MIN_CHUNK keys, then as few as cover
    `max_seq_len` with the tile-rounded chunk (no split left empty by the rounding)."""
    if programs >= sms:
        return 1
    s = min(max_seq_len // MIN_CHUNK, -(-SPLIT_WAVES * sms // max(1, programs)))
    if s <= 1:
        return 1
    return -(-max_seq_len // _split_chunk(max_seq_len, s, block_n))


def prefill_config(head_dim: int, dtype: torch.dtype, interpret: bool,
                   cache_dtype: Optional[torch.dtype] = None) -> dict:
    """Launch parameters for `q`'s `dtype` (and the cache's, default the same). `PACK_GQA`
    packs a kv group's query heads into one row tile (used when the group has 2 to BLOCK_M/16
    heads); `FP8_COMPUTE` is read for fp8 caches only. `SPLITS` None chooses the split count
    from `max_seq_len` (`_num_splits`); an int forces it (1: never split)."""
    cfg = _tile_config(head_dim, dtype, interpret)
    cfg["SPLITS"] = None
    # fp8 caches: "fp16" widens the e4m3 tiles (and q, p) to fp16 for the tensor-core products,
    # the native conversion; "q" widens them to q's dtype (bf16 has no direct e4m3 conversion).
    cfg["FP8_COMPUTE"] = "fp16"
    if cache_dtype == v.FP8 and not interpret and dtype != torch.float32 and head_dim == 128:
        # The widening sits between the loads and the products: 64-key tiles with 3 stages
        # hide it best (H200, 8 x 2048 over 2048: 2572 us against 3597 for 128-key tiles with
        # 2 stages; 4 stages tie, 32-key tiles and 128-row tiles lose; docs/performance.md).
        cfg.update(BLOCK_N=64, num_stages=3)
    return cfg


def _tile_config(head_dim: int, dtype: torch.dtype, interpret: bool) -> dict:
    if interpret:
        return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "PACK_GQA": True}
    if dtype == torch.float32:
        # fp32 tiles are twice the bytes: smaller tiles keep the pipeline within shared memory.
        if head_dim <= 128:
            return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "PACK_GQA": True}
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "PACK_GQA": True}
    if head_dim <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PACK_GQA": True}
    if head_dim <= 128:
        # Best of the H200 sweeps (docs/kernels.md): 256 rows = 64 tokens x 4 heads at GQA 4.
        return {"BLOCK_M": 256, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "PACK_GQA": True}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "PACK_GQA": True}
