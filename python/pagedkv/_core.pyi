"""Type stubs for the extension module ``pagedkv._core`` (built from ``rust/python``).

The documented API is :class:`pagedkv.BlockManager`; this module is its thin Rust layer. Ids are
Python ints or 1-D integer numpy arrays / lists; out-of-range values raise
:class:`pagedkv.errors.InvalidArgumentError`, and every core error raises its own
:mod:`pagedkv.errors` class.
"""

from typing import Any, Optional, Sequence, Tuple, Union, final

import numpy as np
import numpy.typing as npt

_Ids = Union[Sequence[int], npt.NDArray[np.integer[Any]]]
_Raw = Tuple[int, int, str]
_Keys = Union[bytes, bytearray]

__all__ = ["__version__", "BlockManager", "hash_blocks", "_raise_core_error"]
__version__: str

@final
class BlockManager:
    def __new__(
        cls,
        num_blocks: int,
        block_size: Optional[int] = ...,
        watermark_blocks: Optional[int] = ...,
        max_blocks_per_seq: Optional[int] = ...,
        enable_prefix_caching: bool = ...,
        verify_prefix: bool = ...,
        hash_seed: Optional[int] = ...,
    ) -> BlockManager: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def watermark_blocks(self) -> int: ...
    @property
    def max_blocks_per_seq(self) -> int: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def verify_prefix(self) -> bool: ...
    @property
    def has_buffers(self) -> bool: ...
    def can_admit(self, num_tokens: int) -> bool: ...
    def admit(
        self,
        seq_id: int,
        token_ids: _Ids,
        cache_salt: Union[bytes, bytearray, str, None] = ...,
        adapter_id: Optional[int] = ...,
        mm_inputs: Optional[Sequence[Tuple[int, int, _Keys]]] = ...,
        extra_keys: Optional[_Keys] = ...,
    ) -> Tuple[int, int, int]:
        """Returns ``(cached_tokens, new_blocks, num_blocks)``."""
    def append(self, seq_id: int, token_ids: _Ids) -> None: ...
    def append_batch(self, seq_ids: _Ids, token_ids: _Ids) -> None: ...
    def fork(self, parent: int, child: int) -> None: ...
    def free(self, seq_id: int) -> None: ...
    def contains(self, seq_id: object) -> bool: ...
    def __contains__(self, seq_id: object, /) -> bool: ...
    def __len__(self) -> int: ...
    def seq_len(self, seq_id: int) -> int: ...
    def block_table(self, seq_id: int) -> list[int]: ...
    def block_hashes(self, seq_id: int) -> list[Optional[bytes]]:
        """Per block of the table: its prefix-cache hash (16 little-endian bytes) or None."""
    def block_refcount(self, block: int) -> int: ...
    def pending_copies(self) -> list[Tuple[int, int]]: ...
    def num_seqs(self) -> int: ...
    def num_free_blocks(self) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def check_invariants(self) -> None: ...
    def register_buffers(
        self,
        max_seqs: int,
        max_tokens: int,
        max_blocks_per_seq: int,
        max_copies: int,
        slot_mapping: _Raw,
        block_tables: _Raw,
        seq_lens: _Raw,
        query_start_loc: _Raw,
        kv_indptr: _Raw,
        kv_indices: _Raw,
        kv_last_page_len: _Raw,
        copies: _Raw,
        *,
        keepalive: object,
    ) -> None:
        """Each buffer is ``(data_ptr, numel, dtype_name)`` of contiguous host memory that
        ``keepalive`` owns."""
    def unregister_buffers(self) -> None: ...
    def invalidate_step_cache(self) -> None: ...
    def step(
        self, seq_ids: _Ids, num_new_tokens: Union[_Ids, int]
    ) -> Tuple[int, int, int, int, int]:
        """Returns ``(num_seqs, num_tokens, num_kv_indices, num_copies, max_seq_len)``."""

def hash_blocks(
    token_ids: _Ids,
    block_size: int,
    cache_salt: Union[bytes, bytearray, str, None] = ...,
    adapter_id: Optional[int] = ...,
    mm_inputs: Optional[Sequence[Tuple[int, int, _Keys]]] = ...,
    extra_keys: Optional[_Keys] = ...,
    *,
    hash_seed: int,
) -> list[bytes]:
    """Chained prefix hashes of every full block under key ``hash_seed``, 16 little-endian bytes
    each."""

def _raise_core_error(name: str) -> None:
    """Raises the mapped exception for a sample of the named core error variant (tests only)."""
