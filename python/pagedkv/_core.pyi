"""Type stubs for the extension module ``pagedkv._core`` (built from ``rust/python``).

The documented API is :class:`pagedkv.BlockManager`; this module is its thin Rust layer. Ids are
Python ints (never bools) or 1-D integer numpy arrays (any byte order) / lists; out-of-range or
ill-typed values raise :class:`pagedkv.errors.InvalidArgumentError`, and every core error raises its
own :mod:`pagedkv.errors` class. Flags take bools only.

A ``BlockManager`` may be called from many threads: calls are serialized by a lock the extension
waits for with the GIL released, never refused.
"""

from typing import Any, Callable, Iterable, Optional, Sequence, Tuple, Union, final

import numpy as np
import numpy.typing as npt

_Ids = Union[Sequence[int], npt.NDArray[np.integer[Any]]]
_Keys = Union[bytes, bytearray]
#: ``(cached_tokens, new_blocks, num_blocks, num_tokens, cached_tokens_gpu, cached_tokens_host)``.
_AdmitTuple = Tuple[int, int, int, int, int, int]
#: A KV cache group: ``("full",)``, ``("sliding", window)``, ``("chunked", chunk)`` (or
#: ``("full", 0)``, or ``"full"``).
_Group = Union[str, Tuple[str], Tuple[str, int], Sequence[Union[str, int]]]

__all__ = [
    "__version__",
    "BlockManager",
    "KeyedBlockPool",
    "OffloadIndex",
    "StepArena",
    "hash_blocks",
    "plan_decode",
    "split_transfer",
    "bytes_per_token",
    "page_bytes",
    "live_blocks",
    "peak_decode_blocks",
    "_raise_core_error",
]
__version__: str

@final
class BlockManager:
    def __new__(
        cls,
        num_blocks: int,
        block_size: Optional[int] = ...,
        watermark_blocks: Optional[int] = ...,
        max_blocks_per_seq: Optional[int] = ...,
        enable_prefix_caching: Optional[bool] = ...,
        verify_prefix: Optional[bool] = ...,
        hash_seed: Optional[int] = ...,
        num_host_blocks: Optional[int] = ...,
        kv_event_capacity: Optional[int] = ...,
        host_cache: Optional[bool] = ...,
        host_write_through: Optional[bool] = ...,
        host_load_min_blocks: Optional[int] = ...,
        groups: Optional[Sequence[_Group]] = ...,
        max_provisional: Optional[int] = ...,
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
    def num_host_blocks(self) -> int: ...
    @property
    def num_groups(self) -> int: ...
    @property
    def groups(self) -> list[Tuple[str, int]]:
        """``(kind, size)`` per KV cache group, size 0 for a full group."""
    @property
    def max_provisional(self) -> int: ...
    @property
    def kv_event_capacity(self) -> int: ...
    @property
    def host_cache(self) -> bool: ...
    @property
    def host_write_through(self) -> bool: ...
    @property
    def host_load_min_blocks(self) -> int: ...
    def lookup_tiers(
        self,
        token_ids: _Ids,
        cache_salt: Union[bytes, bytearray, str, None] = ...,
        adapter_id: Optional[int] = ...,
        mm_inputs: Optional[Sequence[Tuple[int, int, _Keys]]] = ...,
        extra_keys: Optional[_Keys] = ...,
    ) -> Tuple[int, int, list[int], int, Optional[int]]:
        """``(gpu_blocks, host_blocks, remaining_hashes, salt_digest, parent_hash)``."""
    def lookup_tiers_groups(
        self,
        token_ids: _Ids,
        cache_salt: Union[bytes, bytearray, str, None] = ...,
        adapter_id: Optional[int] = ...,
        mm_inputs: Optional[Sequence[Tuple[int, int, _Keys]]] = ...,
        extra_keys: Optional[_Keys] = ...,
    ) -> Tuple[list[int], int, list[list[bool]]]:
        """``(hashes, salt_digest, present)``: ``present[g][i]`` for group ``g``'s block ``i``."""
    def reserve_host_blocks(self, n: int) -> list[int]: ...
    def commit_host_blocks(
        self,
        blocks: _Ids,
        hashes: Sequence[int],
        parents: Sequence[Optional[int]],
        salt_digest: int,
        token_ids: _Ids,
        ok: bool,
        groups: Optional[_Ids] = ...,
    ) -> int: ...
    def take_demotions(self) -> list[Tuple[int, int, Optional[int], int, list[int]]]:
        """``(host_block, hash, parent_hash, salt_digest, token_ids)`` per demotion, oldest first."""
    def take_demotions_by_group(
        self,
    ) -> list[Tuple[int, int, Optional[int], int, list[int], int]]:
        """``take_demotions`` with each demotion's KV cache group appended."""
    def host_blocks_available(self) -> int: ...
    def set_host_cost_model(
        self,
        host_link_bytes_per_s: Optional[float] = ...,
        prefill_tokens_per_s: Optional[float] = ...,
        kv_bytes_per_token: Optional[float] = ...,
    ) -> None: ...
    @property
    def kv_events_dropped(self) -> int: ...
    def drain_kv_events(
        self,
    ) -> list[Tuple[str, str, list[int], Optional[int], list[int], int, int]]:
        """``(kind, medium, block_hashes, parent_hash, token_ids, block_size, group)``, oldest
        first."""
    def cached_block_keys(self) -> list[Tuple[int, int]]:
        """``(group, hash)`` of every block of the device prefix cache, sorted."""
    @property
    def has_buffers(self) -> bool: ...
    def can_admit(
        self,
        prompt: Union[_Ids, int],
        cache_salt: Union[bytes, bytearray, str, None] = ...,
        adapter_id: Optional[int] = ...,
        mm_inputs: Optional[Sequence[Tuple[int, int, _Keys]]] = ...,
        extra_keys: Optional[_Keys] = ...,
        max_new_tokens: Optional[int] = ...,
    ) -> bool:
        """Token ids: prefix-cache hits counted; an int: a length, no hit assumed.

        An empty ``cache_salt`` hashes as no salt here; :class:`pagedkv.BlockManager` refuses it."""
    def admit(
        self,
        seq_id: int,
        token_ids: _Ids,
        cache_salt: Union[bytes, bytearray, str, None] = ...,
        adapter_id: Optional[int] = ...,
        mm_inputs: Optional[Sequence[Tuple[int, int, _Keys]]] = ...,
        extra_keys: Optional[_Keys] = ...,
        max_new_tokens: Optional[int] = ...,
    ) -> _AdmitTuple:
        """Returns ``(cached_tokens, new_blocks, num_blocks, num_tokens, cached_tokens_gpu,
        cached_tokens_host)``: host tokens are loaded by the next step's swap-in list.

        An empty ``cache_salt`` hashes as no salt here; :class:`pagedkv.BlockManager` refuses it."""
    def admit_batch(
        self,
        seq_ids: _Ids,
        prompts: Sequence[_Ids],
        cache_salts: Optional[Sequence[Union[bytes, bytearray, str, None]]] = ...,
        max_new_tokens: Union[int, Sequence[Optional[int]], None] = ...,
    ) -> list[_AdmitTuple]:
        """The admitted prefix's tuples, as :meth:`admit`'s.

        An empty salt hashes as no salt here; :class:`pagedkv.BlockManager` refuses it."""
    def free_batch(self, seq_ids: _Ids) -> None: ...
    def reset_prefix_cache(self) -> int: ...
    def append(self, seq_id: int, token_ids: _Ids) -> None: ...
    def append_batch(self, seq_ids: _Ids, token_ids: _Ids) -> None: ...
    def fork(self, parent: int, child: int) -> None: ...
    def free(self, seq_id: int) -> None: ...
    def append_provisional(self, seq_id: int, num_tokens: int) -> None: ...
    def append_provisional_batch(self, seq_ids: _Ids, counts: _Ids) -> None: ...
    def commit(self, seq_id: int, accepted_tokens: _Ids) -> None: ...
    def commit_batch(self, seq_ids: _Ids, num_accepted: _Ids, token_ids: _Ids) -> None: ...
    def rewind(self, seq_id: int) -> None: ...
    def num_provisional(self, seq_id: int) -> int: ...
    def committed_len(self, seq_id: int) -> int: ...
    def contains(self, seq_id: object) -> bool: ...
    def __contains__(self, seq_id: object, /) -> bool: ...
    def __len__(self) -> int: ...
    def seq_len(self, seq_id: int) -> int: ...
    def block_table(self, seq_id: int, group: Optional[int] = ...) -> list[int]:
        """Group ``group``'s table (default 0); -1 for a released position."""
    def block_hashes(self, seq_id: int) -> list[Optional[bytes]]:
        """Per block of the table: its prefix-cache hash (16 little-endian bytes) or None."""
    def block_refcount(self, block: int) -> int: ...
    def pending_copies(self) -> list[Tuple[int, int]]: ...
    def num_seqs(self) -> int: ...
    def num_free_blocks(self) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def check_invariants(self) -> None: ...
    def attach_buffers(self, arena: StepArena) -> None:
        """Attaches the step buffers whose memory ``arena`` owns; an arena belongs to one manager at
        a time (BufferInvalidError otherwise). Nothing takes an address."""
    def detach_buffers(self) -> None: ...
    def invalidate_step_cache(self) -> None: ...
    def step(
        self, seq_ids: _Ids, num_new_tokens: Union[_Ids, int]
    ) -> Tuple[int, int, int, int, int, int, int, int]:
        """Returns ``(num_seqs, num_tokens, num_kv_indices, num_copies, max_seq_len,
        num_swap_out, num_swap_in, max_query_len)``."""
    def swap_out(self, seq_ids: _Ids) -> list[Tuple[int, int]]:
        """``(device_block, host_block)`` copies; also queued for the next step."""
    def swap_in(self, seq_ids: _Ids) -> list[Tuple[int, int]]:
        """``(host_block, device_block)`` copies; also queued for the next step."""
    def recompute(self, seq_id: int) -> None: ...
    def resume(
        self, seq_id: int, max_new_tokens: Optional[int] = ...
    ) -> _AdmitTuple:
        """As :meth:`admit`'s tuple, for a sequence preempted by recompute."""
    def choose_victim(self) -> Optional[list[int]]: ...
    def decide(
        self,
        seq_ids: _Ids,
        host_link_bytes_per_s: float,
        prefill_tokens_per_s: float,
        kv_bytes_per_token: float,
        step_floor_s: float = ...,
        max_step_tokens: int = ...,
        batch_tokens: Optional[int] = ...,
    ) -> Tuple[str, float, float, bool, int, int, int]:
        """``(mode, swap_cost_s, recompute_cost_s, swap_possible, swap_blocks, recompute_tokens,
        batch_tokens)``."""
    def seq_state(self, seq_id: int) -> str:
        """``"running"``, ``"swapped"`` or ``"recompute"``."""
    def pending_swap_out(self) -> list[Tuple[int, int]]: ...
    def pending_swap_in(self) -> list[Tuple[int, int]]: ...
    def num_free_host_blocks(self) -> int: ...
    def host_block_refcount(self, block: int) -> int: ...

@final
class StepArena:
    """Host memory of one set of step buffers, allocated, zeroed and owned by the extension."""

    def __new__(
        cls,
        max_seqs: int,
        max_tokens: int,
        max_blocks_per_seq: int,
        max_copies: int,
        csr: bool,
        max_swaps: Optional[int] = ...,
        groups: Optional[int] = ...,
    ) -> StepArena: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def csr(self) -> bool: ...
    @property
    def pinned(self) -> bool: ...
    @property
    def attached(self) -> bool: ...
    @property
    def num_groups(self) -> int: ...
    def group_fields(self) -> list[list[Tuple[int, int]]]:
        """Per KV cache group after group 0: ``[(slot_mapping_offset, numel),
        (block_tables_offset, numel)]``, byte offsets."""
    def fields(self) -> dict[str, Tuple[int, int]]:
        """``{field: (byte_offset, numel)}``."""
    def array(self) -> npt.NDArray[np.uint8]:
        """The arena as a writable uint8 array whose base is the arena (not resizable)."""
    def pin(self, cudart: Any, synchronize: Optional[Callable[[], Any]] = ...) -> None:
        """Pins with ``cudart.cudaHostRegister`` (``torch.cuda.cudart()``); when freed, calls
        ``synchronize()`` then ``cudart.cudaHostUnregister``."""

@final
class KeyedBlockPool:
    """Blocks keyed by caller-supplied hashes: counts, eviction order, key -> blocks map."""

    def __new__(
        cls, num_blocks: int, reserve_null: Optional[bool] = ..., null_keys: Optional[bool] = ...
    ) -> KeyedBlockPool: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def null_block(self) -> Optional[int]: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_keys(self) -> int: ...
    @property
    def free_front(self) -> Optional[int]: ...
    @property
    def free_back(self) -> Optional[int]: ...
    def allocate(self, n: int) -> Tuple[list[int], list[int]]: ...
    def touch(self, blocks: Sequence[int]) -> None: ...
    def release(self, blocks: Sequence[int], placement: Optional[str] = ...) -> None: ...
    def set_ref(self, block: int, count: int) -> None: ...
    def ref_count(self, block: int) -> int: ...
    def is_cached(self, block: int) -> bool: ...
    def is_free(self, block: int) -> bool: ...
    def keys_of(self, block: int) -> list[bytes]: ...
    def free_order(self) -> list[int]: ...
    def free_neighbours(self, block: int) -> Optional[Tuple[Optional[int], Optional[int]]]: ...
    def lookup(self, key: bytes) -> Optional[int]: ...
    def lookup_many(self, keys: Iterable[bytes]) -> list[Optional[int]]: ...
    def insert_many(self, keys: Iterable[bytes], blocks: Sequence[int]) -> int: ...
    def lookup_groups(self, hash: bytes, groups: Sequence[int]) -> Optional[list[int]]: ...
    def contains(self, key: bytes, block: int) -> bool: ...
    def insert(self, key: bytes, block: int) -> bool: ...
    def remove(self, key: bytes, block: int) -> bool: ...
    def evict(self, block: int) -> int: ...
    def reset(self) -> bool: ...
    def clear_keys(self) -> None: ...
    def entries(self) -> dict[bytes, Union[int, list[int]]]: ...
    def stats(self) -> dict[str, int]: ...
    def check_invariants(self) -> None: ...
    def __len__(self) -> int: ...

@final
class OffloadIndex:
    """The offloading tier's scheduler-side index: chunks, keys, stores in flight, one method per
    call of vLLM's ``OffloadingManager`` (``pagedkv.vllm.offload``). ``lookup`` answers with the
    three objects given as ``lookup_results`` (miss, hit, pending; else 0, 1, 2); positions are
    read from a request context's ``_offload_key_positions`` dict when its class's
    ``get_offload_key_position`` is ``context_getter``, else through that method."""

    def __new__(
        cls, num_chunks: int, lookup_results: Optional[Tuple[Any, Any, Any]] = ...,
        context_getter: Optional[Any] = ...,
    ) -> OffloadIndex: ...
    @property
    def num_chunks(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_pending(self) -> int: ...
    @property
    def num_keys(self) -> int: ...
    def lookup(self, key: bytes, req_context: Any = ...) -> Any: ...
    def lookup_function(self) -> Callable[..., Any]: ...
    def prepare_load(
        self, keys: Iterable[bytes], req_context: Any = ...
    ) -> npt.NDArray[np.int32]: ...
    def complete_load(self, keys: Iterable[bytes]) -> None: ...
    def touch(self, keys: Iterable[bytes]) -> None: ...
    def missing(self, keys: Iterable[bytes]) -> list[bytes]: ...
    def prepare_store(
        self, keys: Iterable[bytes], req_context: Any = ..., admit: Optional[Sequence[bool]] = ...
    ) -> Tuple[list[bytes], Optional[npt.NDArray[np.int32]], list[bytes]]: ...
    def complete_store(self, keys: Iterable[bytes], success: bool = ...) -> list[bytes]: ...
    def reset(self) -> None: ...
    def ref_count(self, chunk: int) -> int: ...
    def is_free(self, chunk: int) -> bool: ...
    def is_pending(self, chunk: int) -> bool: ...
    def key(self, chunk: int) -> Optional[bytes]: ...
    def stamp(self, chunk: int) -> int: ...
    def free_order(self) -> list[int]: ...
    def entries(self) -> dict[bytes, int]: ...
    def stats(self) -> dict[str, int]: ...
    def check_invariants(self) -> None: ...
    def __len__(self) -> int: ...

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
    each. An empty ``cache_salt`` is no salt (``docs/prefix-hash.md``)."""

def plan_decode(
    seq_lens: npt.NDArray[np.integer[Any]],
    out: npt.NDArray[np.int32],
    kv_heads: int,
    programs: int,
    min_chunk: int,
    granule: int,
    items_off: int,
    capacity: int,
) -> Tuple[int, int]:
    """Plans one split-K decode step into ``out`` (``DecodePlan``'s int32 host buffer) from the
    host lengths ``seq_lens`` (1-D, any integer dtype; clipped to ``[0, 2^30]``) and returns
    ``(num_items, chunk)``: ``out[0]`` the item count, ``out[1 : 2 + n]`` the indptr,
    ``out[items_off : items_off + 4 * num_items]`` the items ``(seq, start, end, row or -1)``,
    heaviest first, exactly as ``DecodePlan.plan_host`` computes them. ``out`` must be a
    writable, C-contiguous, native int32 array (``BufferInvalidError`` otherwise) long enough
    for the items and ``capacity`` (``BufferTooSmallError``); nothing is written on an error."""

def split_transfer(
    block_ids: _Ids,
    group_sizes: _Ids,
    block_indices: _Ids,
    chunk_ids: _Ids,
    tabled: Sequence[bool],
    blocks_per_chunk: int,
    num_blocks: int,
    num_chunks: int,
    piece: int,
    out: npt.NDArray[np.int64],
) -> Tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], list[int],
           list[list[Tuple[int, int, int]]], int]:
    """Checks one transfer of the vLLM offloading copier whole and splits it into staging
    pieces of at most ``piece`` chunks (``pagedkv.vllm.offload_copy``): returns the distinct
    chunk ids ascending, the DMA runs ``[runs, 3]`` (first chunk id, first row in its piece's
    slot, chunk count; consecutive ids inside one piece), per piece the start of its runs
    (``pieces + 1`` values), per piece its ``(group, start, end)`` spans of the kernel entries,
    and the entry count ``n``. The entries (one per block of a group with ``tabled`` true:
    GPU block, row in its piece's slot, sub-block; sorted by piece, then group) go into
    ``out[:n]``, ``out[n:2n]``, ``out[2n:3n]``. ``InvalidArgumentError`` (``what``:
    ``group_sizes``, ``block_ids``, ``chunk_ids``, ``piece``, ``blocks_per_chunk``, ``tabled`` or
    ``out``) for a transfer that does not add up, an id out of range or a zero size,
    ``BufferInvalidError`` for an ``out`` that is not a
    writable, C-contiguous int64 array; nothing is written on an error."""

def bytes_per_token(kv_heads: int, head_dim: int, dtype_bytes: int, layers: int) -> int:
    """``2 * kv_heads * head_dim * dtype_bytes * layers`` (InvalidArgumentError past 64 bits)."""

def page_bytes(group_bytes_per_token: Sequence[int], block_size: int) -> int:
    """``max(group_bytes_per_token) * block_size``."""

def live_blocks(kind: _Group, seq_len: int, num_new: int, block_size: int) -> int:
    """Non-null entries of a group's table after a step of ``num_new`` of ``seq_len`` tokens."""

def peak_decode_blocks(kind: _Group, max_len: int, block_size: int) -> int:
    """Most non-null entries of a group's table over a decode run up to ``max_len`` tokens."""

def _raise_core_error(name: str) -> None:
    """Raises the mapped exception for a sample of the named core error variant (tests only)."""
