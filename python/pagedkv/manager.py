"""The block manager's Python face.

Owns :class:`BlockManager`, a typed, documented wrapper over the extension's ``_core.BlockManager``,
and the small result types it returns (:class:`AdmitResult`, :class:`Stats`; :class:`StepInfo`
lives beside the buffers it describes, in :mod:`pagedkv.buffers`, and is re-exported here).
All bookkeeping lives in the Rust core; this module only normalises arguments, so its invariants are
the core's:

* every method either succeeds or raises a :mod:`pagedkv.errors` class and leaves the manager
  exactly as it was;
* a block is allocated when a token first needs it, never ahead of time; admissions never take
  blocks from the watermark reserve, appends may;
* the core writes only into step buffers whose memory the extension owns (a
  :class:`~pagedkv.StepBuffers` arena, which Python cannot free or resize); the manager keeps it
  alive until detached or replaced, and one buffer set belongs to one manager at a time;
* a manager may be called from many threads: calls are serialized by a lock inside the extension
  (waited for with the GIL released), never refused, and read-only queries such as :meth:`stats`
  simply wait for a running :meth:`step` to finish.

Token ids may be a list or tuple of ints, a 1-D integer numpy array (int32/int64/uint32/...), a
CPU torch tensor, or a single int. Arrays and tensors are read in place (``np.asarray`` makes no copy
of a numpy array or a CPU tensor); the core converts to ``u32`` while checking the range.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from . import _core
from ._checks import DEFAULT_BLOCK_SIZE, check_block_size, check_flag, check_salt
from .buffers import StepInfo
from .errors import InvalidArgumentError
from .groups import GroupLike, KVCacheGroup, groups_arg

if TYPE_CHECKING:
    import numpy.typing as npt

    from .buffers import StepBuffers

    TokenIds = Union[Sequence[int], npt.NDArray[np.integer], int, Any]
    SeqIds = Union[Sequence[int], npt.NDArray[np.integer]]

__all__ = [
    "BlockManager", "AdmitResult", "StepInfo", "Stats", "CostModel", "Decision", "KVCacheGroup",
]

logger = logging.getLogger("pagedkv")


class AdmitResult(NamedTuple):
    """Outcome of one admission."""

    #: Prompt tokens whose KV was found in the prefix cache (a multiple of the block size).
    cached_tokens: int
    #: Blocks freshly allocated for the prompt.
    new_blocks: int
    #: Blocks in the sequence's table after admission (cached ones included).
    num_blocks: int
    #: Tokens the sequence holds after admission: ``cached_tokens + min(max_new_tokens,
    #: len(prompt) - cached_tokens)``, the whole prompt without ``max_new_tokens``. The first step
    #: computes ``[cached_tokens, num_tokens)``; the rest of the prompt is fed with :meth:`append`.
    num_tokens: int
    #: Of ``cached_tokens``, those found on the device (shared blocks).
    cached_tokens_gpu: int
    #: Of ``cached_tokens``, those found in the host tier: loaded into freshly allocated device
    #: blocks by the next step's swap-in list, not computed (0 without a host tier).
    cached_tokens_host: int


class CostModel(NamedTuple):
    """Rates the swap-or-recompute choice is made from (measured on the device, or given).

    Swap cost = 2 × the victim's KV bytes / ``host_link_bytes_per_s``. A step is modelled as
    costing ``max(step_floor_s, tokens / prefill_tokens_per_s)``: below that knee it is bound by
    what it pays whatever it carries (launch overhead, weight reads), so a recompute folded into
    steps that run anyway (beside the running decodes) costs only what it adds to them, chunk by
    chunk of at most ``max_step_tokens``. With the defaults (no floor, no chunking) recompute
    cost = tokens / ``prefill_tokens_per_s``. See :meth:`BlockManager.decide`.
    """

    #: Host <-> device copy bandwidth, bytes per second, one direction.
    host_link_bytes_per_s: float
    #: Prefill throughput once a step is compute-bound, tokens per second.
    prefill_tokens_per_s: float
    #: KV bytes per token over all layers (``2 * kv_heads * head_dim * dtype_bytes * layers``).
    kv_bytes_per_token: float
    #: Seconds a step costs however few tokens it carries (0: every token costs 1 / rate).
    step_floor_s: float = 0.0
    #: Most tokens one step carries (the scheduler's ``max_num_batched_tokens``); 0 = no limit.
    max_step_tokens: int = 0


class Decision(NamedTuple):
    """What :meth:`BlockManager.decide` chose, and why."""

    #: ``"swap"`` or ``"recompute"``.
    mode: str
    #: Estimated seconds to swap the victim out and back in.
    swap_cost_s: float
    #: Estimated seconds to recompute it.
    recompute_cost_s: float
    #: Whether the host pool has room for the swap now (when not, the mode is recompute).
    swap_possible: bool
    #: Distinct device blocks a swap would copy.
    swap_blocks: int
    #: Tokens a recompute would re-run.
    recompute_tokens: int
    #: Tokens of other work each step was assumed to carry beside the recompute.
    batch_tokens: int = 0


_new_tuple = tuple.__new__
_ndarray = np.ndarray


def _count(what: str, value: Any) -> int:
    """``value`` as an int >= 0, else a typed error naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        reason = "must be an int >= 0"
        raise InvalidArgumentError(f"invalid argument: {what} = {value!r}: {reason}",
                                   what=what, value=value, reason=reason)
    return int(value)


def _ids(x: Any) -> Any:
    """Normalises token or sequence ids to something the extension reads directly.

    Lists, tuples and numpy arrays pass through untouched (the extension reads them without a
    Python-level copy); ints and numpy integer scalars become a one-element list; anything else
    array-like (a CPU torch tensor, ``array.array``, ``range``) goes through ``np.asarray``, which
    shares memory where it can.
    """
    t = type(x)
    if t is _ndarray or t is list or t is tuple:
        return x
    if t is int:
        return [x]
    if t is bool:
        # An int to Python, but never an id: `append(seq, True)` is a bug, not token 1.
        reason = "must be an int, got bool"
        raise InvalidArgumentError(
            f"invalid argument: ids = {x!r}: {reason}", what="ids", value=x, reason=reason
        )
    if isinstance(x, np.integer):
        return [int(x)]
    try:
        return np.asarray(x)
    except (TypeError, RuntimeError) as exc:
        # A CUDA tensor lands here: it has no host memory to read.
        reason = f"cannot be read as a host integer array ({exc})"
        raise InvalidArgumentError(
            f"invalid argument: ids = {type(x).__name__}: {reason}",
            what="ids",
            value=type(x).__name__,
            reason=reason,
        ) from None


class BlockManager:
    """Paged KV cache block manager: block tables, prefix cache and step output.

    Args:
        num_blocks: Blocks in the pool (``1 <= num_blocks <= 2**31 - 1``: block ids are written
            as int32).
        block_size: Tokens per block: any integer in ``[1, 2**32 - 1]`` (the manager only counts
            tokens; a pool the kernels read needs a power of two, see
            :func:`pagedkv._checks.check_block_size`). A bad one raises
            :class:`~pagedkv.errors.ConfigArgumentError`, as at every layer.
        watermark_blocks: Blocks kept back from admissions so running sequences can always append;
            must be below ``num_blocks``. ``None``: 1% of the pool, at least 1 (0 for a one-block
            pool).
        max_blocks_per_seq: Width of a block-table row (longest sequence, in blocks). ``None``: as
            wide as the pool, capped so that ``max_blocks_per_seq * block_size`` fits an int32.
        enable_prefix_caching: Share full blocks between sequences with the same token prefix
            (and the same extra keys), and keep freed full blocks cached until their space is needed.
        verify_prefix: Keep each cached block's token ids and compare them on every prefix-cache
            hit (the default); a mismatch (a hash collision) is served as a miss and counted in
            :attr:`Stats.prefix_collisions`. Costs a copy and a compare per cached block and
            ``4 * block_size`` bytes per block; ``False`` turns it off.
        hash_seed: Key of the prefix hash (an int in ``[0, 2**64)``). ``None`` (the default): a
            fresh secret from the OS per manager, so callers cannot predict or forge hashes.
            An explicit value makes hashes reproducible across processes, and computable by
            anyone who knows it (see ``docs/prefix-hash.md``). Without a ``cache_salt`` all callers
            share one cache, and ``cached_tokens`` tells a caller which prompts others sent: a
            multi-tenant deployment gives each tenant its own secret salt.
        num_host_blocks: Blocks of the host pool swapped-out sequences live in (``0``, the
            default: swap disabled, :meth:`swap_out` raises
            :class:`~pagedkv.errors.OutOfHostBlocksError`). The host memory itself is the
            engine's; the manager hands out host block ids.
        cost_model: Default :class:`CostModel` for :meth:`decide`.
        kv_event_capacity: Records of the KV-event ring (``docs/kv-events.md``): every prefix-cache
            transition (stored, removed, cleared) is recorded for :meth:`drain_kv_events`, the
            oldest dropped and counted when it is full. 0 (the default): nothing is recorded.
        groups: The KV cache groups (:class:`~pagedkv.KVCacheGroup`, or tuples ``("full",)``,
            ``("sliding", window)``, ``("chunked", chunk)``), group ``g`` at index ``g``; group 0
            must be full. Each sequence gets one block table per group, all drawing on the one
            pool; a sliding or chunked group releases the blocks no later query reads when a step
            is built (``-1`` in :meth:`block_table`). ``None`` (the default): one full group,
            the manager without groups. More than one group needs ``num_host_blocks=0`` and
            ``kv_event_capacity=0``, and step buffers built with ``num_groups``.

    Raises:
        InvalidConfigError: A value is out of range (no blocks, block size 0, watermark ≥ pool, a
            group 0 that is not full, more than 16 groups, swap or KV events with groups, ...).
        InvalidArgumentError: A size is negative or not an int (a bool is not one), or a flag is
            not a bool.
    """

    __slots__ = ("_core", "_buffers", "_append_batch", "_step", "cost_model")

    def __init__(
        self,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        watermark_blocks: Optional[int] = None,
        max_blocks_per_seq: Optional[int] = None,
        enable_prefix_caching: bool = True,
        verify_prefix: bool = True,
        hash_seed: Optional[int] = None,
        num_host_blocks: int = 0,
        cost_model: Optional[CostModel] = None,
        kv_event_capacity: int = 0,
        host_cache: bool = False,
        host_write_through: bool = False,
        host_load_min_blocks: int = 1,
        groups: Optional[Sequence[GroupLike]] = None,
    ) -> None:
        # Flags are bools only: `bool("false")` is True.
        self._core = _core.BlockManager(
            num_blocks,
            check_block_size(block_size, pool=False),
            watermark_blocks,
            max_blocks_per_seq,
            check_flag("enable_prefix_caching", enable_prefix_caching),
            check_flag("verify_prefix", verify_prefix),
            hash_seed,
            num_host_blocks,
            kv_event_capacity,
            check_flag("host_cache", host_cache),
            check_flag("host_write_through", host_write_through),
            host_load_min_blocks,
            groups_arg(groups),
        )
        #: Default :class:`CostModel` of :meth:`decide` (settable).
        self.cost_model: Optional[CostModel] = cost_model
        self._buffers: Optional[StepBuffers] = None
        # Bound once: the hot path then skips two attribute lookups per call.
        self._append_batch = self._core.append_batch
        self._step = self._core.step

    # ----------------------------------------------------------------------------------- config

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self._core.num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._core.block_size

    @property
    def watermark_blocks(self) -> int:
        """Blocks kept back from admissions."""
        return self._core.watermark_blocks

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a block-table row: the most blocks one sequence may hold."""
        return self._core.max_blocks_per_seq

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether full blocks are shared and cached by prefix hash."""
        return self._core.enable_prefix_caching

    @property
    def verify_prefix(self) -> bool:
        """Whether prefix-cache hits also compare token ids."""
        return self._core.verify_prefix

    @property
    def num_groups(self) -> int:
        """Number of KV cache groups (1 without ``groups``)."""
        return self._core.num_groups

    @property
    def groups(self) -> Tuple[KVCacheGroup, ...]:
        """The KV cache groups, group ``g`` at index ``g``."""
        return tuple(KVCacheGroup(kind, size) for kind, size in self._core.groups)  # type: ignore[arg-type]

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host pool (0: swap disabled)."""
        return self._core.num_host_blocks

    @property
    def kv_event_capacity(self) -> int:
        """Records of the KV-event ring (0: events off)."""
        return self._core.kv_event_capacity

    @property
    def kv_events_dropped(self) -> int:
        """KV-event records the full ring overwrote before they were drained."""
        return self._core.kv_events_dropped

    def drain_kv_events(self) -> List[Tuple[str, str, List[int], Optional[int], List[int], int]]:
        """The recorded KV events, oldest first, as ``(kind, medium, block_hashes, parent_hash,
        token_ids, block_size)``; the ring is then empty (``docs/kv-events.md``)."""
        return self._core.drain_kv_events()

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now: free ones plus cached-free (evictable) ones."""
        return self._core.num_free_blocks()

    @property
    def num_free_host_blocks(self) -> int:
        """Free blocks of the host pool."""
        return self._core.num_free_host_blocks()

    @property
    def num_seqs(self) -> int:
        """Live sequences (same as ``len(manager)``)."""
        return self._core.num_seqs()

    # ------------------------------------------------------------------------------- sequences

    def can_admit(
        self,
        prompt: Union[TokenIds, int],
        *,
        cache_salt: Union[bytes, str, None] = None,
        adapter_id: Optional[int] = None,
        mm_inputs: Optional[List[Tuple[int, int, bytes]]] = None,
        extra_keys: Optional[bytes] = None,
        max_new_tokens: Optional[int] = None,
    ) -> bool:
        """Whether :meth:`admit` of this prompt would fit above the watermark reserve right now.

        With token ids (a list, tuple or integer array) the answer is exact for a new sequence
        id: it runs the same prefix-cache lookup as :meth:`admit` (read-only), so a prompt with
        4080 of its 4096 tokens cached needs one block, and a hit on a cached-free block counts as
        taking a free block (it leaves the evictable pool). The keys must be those the admission
        will use. With an int (a prompt length) no hit is assumed: for a whole prompt ``True`` is
        a promise (hits only make an admission cheaper), for a chunk (``max_new_tokens``) it is
        an estimate, since a chunked admission holds its cached prefix plus the chunk.

        Args:
            prompt: The prompt's token ids, or its length.
            cache_salt: As in :meth:`admit` (ignored with a length).
            adapter_id: As in :meth:`admit` (ignored with a length).
            mm_inputs: As in :meth:`admit` (ignored with a length).
            extra_keys: As in :meth:`admit` (ignored with a length).
            max_new_tokens: Hold at most this many tokens past the cached prefix (chunked
                prefill), as in :meth:`admit`.

        Returns:
            False also for an empty prompt and one longer than a block-table row.

        Raises:
            InvalidArgumentError: An id or count is negative or not an int, ``max_new_tokens`` is
                0, a key is malformed, or ``cache_salt`` is empty (with a length too).
        """
        if cache_salt is not None:
            check_salt("cache_salt", cache_salt)
        if type(prompt) is int or isinstance(prompt, np.integer):
            return self._core.can_admit(int(prompt), max_new_tokens=max_new_tokens)
        return self._core.can_admit(
            _ids(prompt), cache_salt, adapter_id, mm_inputs, extra_keys, max_new_tokens
        )

    def admit(
        self,
        seq_id: int,
        token_ids: TokenIds,
        *,
        cache_salt: Union[bytes, str, None] = None,
        adapter_id: Optional[int] = None,
        mm_inputs: Optional[List[Tuple[int, int, bytes]]] = None,
        extra_keys: Optional[bytes] = None,
        max_new_tokens: Optional[int] = None,
    ) -> AdmitResult:
        """Admits a new sequence with its prompt, reusing cached prefix blocks where possible.

        The prefix-cache lookup covers all of ``token_ids``: the longest run of leading full
        blocks already cached is shared, at most ``(len(token_ids) - 1) // block_size`` of them, so
        at least one prompt token is always computed. The sequence then holds
        ``cached_tokens + min(max_new_tokens, len(token_ids) - cached_tokens)`` tokens (all of them
        when ``max_new_tokens`` is None) and blocks are allocated for those only; feed the rest
        of the prompt later with :meth:`append`, chunk by chunk (chunked prefill). Blocks enter
        the cache when a :meth:`step` schedules their last token, so only prefixes some step has
        written can hit — across chunks too. The keyword arguments besides ``max_new_tokens`` are
        the extra keys mixed into the prefix hash (``docs/prefix-hash.md``): two prompts share
        blocks only when their token ids *and* these keys agree. Cached-free blocks a hit revives
        count against the watermark like new ones.

        Args:
            seq_id: A new sequence id (``0 <= seq_id < 2**64``).
            token_ids: The whole prompt (at least one token).
            cache_salt: Per-tenant salt (non-empty bytes or str); prompts with different salts
                never share blocks. ``None``: no salt. Without one, every caller shares one cache
                and ``cached_tokens`` (and the time an admission takes) reveals whether someone
                else sent the same prefix; give each tenant (or user) its own unguessable salt to
                close that probe. An empty salt is refused: the hash would treat it as no salt,
                so a tenant whose salt came out empty would share the unsalted cache.
            adapter_id: LoRA adapter id; blocks are shared only within one adapter.
            mm_inputs: Multimodal inputs as ``(start, end, content_hash)``: token positions
                ``[start, end)`` hold placeholder tokens for an input whose content hash is given;
                blocks overlapping the range are keyed by the hash too.
            extra_keys: Any further bytes that change the KV values, applied to every block.
            max_new_tokens: Hold at most this many prompt tokens past the cached prefix (the first
                chunk of a chunked prefill); at least 1. None: the whole prompt.

        Returns:
            The :class:`AdmitResult`.

        Raises:
            DuplicateSequenceError: ``seq_id`` is already admitted.
            InvalidArgumentError: An id is negative or too large, the prompt is empty,
                ``max_new_tokens`` is 0, a key is malformed, or ``cache_salt`` is empty.
            WatermarkReachedError: The new blocks would dip into the watermark reserve.
            SequenceTooLongError: The whole prompt needs more than ``max_blocks_per_seq`` blocks.
            OutOfBlocksError: The pool cannot supply the blocks even with the reserve.
        """
        if cache_salt is not None:
            check_salt("cache_salt", cache_salt)
        return _new_tuple(
            AdmitResult,
            self._core.admit(
                seq_id,
                _ids(token_ids),
                cache_salt,
                adapter_id,
                mm_inputs,
                extra_keys,
                max_new_tokens,
            ),
        )

    def admit_batch(
        self,
        seq_ids: SeqIds,
        prompts: Sequence[TokenIds],
        *,
        cache_salts: Optional[Sequence[Union[bytes, str, None]]] = None,
        max_new_tokens: Union[int, Sequence[Optional[int]], None] = None,
    ) -> List[AdmitResult]:
        """Admits many sequences with one call, in order, until one does not fit.

        Every argument is validated first — ids new and distinct, prompts non-empty and within a
        block-table row, salts and ``max_new_tokens`` well formed, lengths equal — and on any
        failure the error is raised with nothing admitted. Then each prompt is admitted as
        :meth:`admit` would; at the first that does not fit (out of blocks, or it would dip into
        the watermark) admission stops. A prompt cannot hit blocks of an earlier one in the same
        batch: blocks enter the prefix cache at step time.

        Args:
            seq_ids: New sequence ids.
            prompts: One prompt per id (lists, tuples or integer arrays).
            cache_salts: One salt (or None) per id, as in :meth:`admit` (an empty one is
                refused); None: no salts.
            max_new_tokens: One int for all, one int-or-None per id, or None (whole prompts).

        Returns:
            The :class:`AdmitResult` of each admitted sequence: a prefix of the input, possibly
            empty.

        Raises:
            DuplicateSequenceError: An id is live or repeats.
            InvalidArgumentError: A length differs, a prompt is empty, an id or count is out of
                range, ``max_new_tokens`` is 0, a salt is empty.
            SequenceTooLongError: A prompt needs more than ``max_blocks_per_seq`` blocks.
        """
        if type(seq_ids) is not _ndarray:
            seq_ids = _ids(seq_ids)
        if type(prompts) is not list and type(prompts) is not tuple:
            prompts = list(prompts)
        prompts = [p if type(p) is list or type(p) is _ndarray else _ids(p) for p in prompts]
        if max_new_tokens is not None and type(max_new_tokens) is not int:
            if isinstance(max_new_tokens, np.integer):
                max_new_tokens = int(max_new_tokens)
            else:
                max_new_tokens = list(max_new_tokens)
        if cache_salts is not None:
            cache_salts = list(cache_salts)
            for salt in cache_salts:
                check_salt("cache_salts", salt)
        return [
            _new_tuple(AdmitResult, r)
            for r in self._core.admit_batch(seq_ids, prompts, cache_salts, max_new_tokens)
        ]

    def append(self, seq_id: int, token_ids: TokenIds) -> None:
        """Appends tokens to a sequence, allocating a block only when a boundary is crossed.

        May use the watermark reserve. Appending into a block shared with another sequence (after
        :meth:`fork`) copies it first and queues a ``(src, dst)`` copy for the next :meth:`step`.

        Args:
            seq_id: A live sequence.
            token_ids: The new tokens (an int appends one).

        Raises:
            UnknownSequenceError: ``seq_id`` is not live.
            InvalidArgumentError: A token id is negative or above ``2**32 - 1``.
            OutOfBlocksError: The pool is empty, reserve included.
            SequenceTooLongError: The sequence would outgrow its block-table row.
        """
        self._core.append(seq_id, _ids(token_ids))

    def append_batch(self, seq_ids: SeqIds, token_ids: TokenIds) -> None:
        """Appends one token to each of many sequences: the decode step's hot path.

        All or nothing: if any sequence fails, none is changed.

        Args:
            seq_ids: Live sequence ids, no repeats (int64 or uint64 array, or a list).
            token_ids: One token id per sequence, same length as ``seq_ids``.

        Raises:
            UnknownSequenceError: A sequence is not live.
            InvalidArgumentError: Lengths differ, a sequence repeats, or an id is out of range.
            OutOfBlocksError: The pool cannot supply the blocks the batch needs.
            SequenceTooLongError: A sequence would outgrow its block-table row.
        """
        # Inline type tests: this is called once per decode step, and the call to `_ids` would cost
        # as much as the test.
        if type(seq_ids) is not _ndarray:
            seq_ids = _ids(seq_ids)
        if type(token_ids) is not _ndarray:
            token_ids = _ids(token_ids)
        self._append_batch(seq_ids, token_ids)

    def fork(self, parent: int, child: int) -> None:
        """Creates ``child`` sharing all of ``parent``'s blocks (parallel sampling, beam search).

        No block is copied now; the first write into a shared block copies it (copy-on-write).

        Args:
            parent: A live sequence.
            child: A new sequence id.

        Raises:
            UnknownSequenceError: ``parent`` is not live.
            DuplicateSequenceError: ``child`` is already live.
            InvalidArgumentError: An id is negative or too large.
        """
        self._core.fork(parent, child)

    def free(self, seq_id: int) -> None:
        """Releases a sequence; its full blocks stay in the prefix cache until their space is needed.

        Args:
            seq_id: A live sequence.

        Raises:
            UnknownSequenceError: ``seq_id`` is not live.
        """
        self._core.free(seq_id)

    def free_batch(self, seq_ids: SeqIds) -> None:
        """Releases many sequences with one call; all or nothing.

        Validates first (every id live, none twice), then frees each as :meth:`free` does.

        Raises:
            UnknownSequenceError: A sequence is not live.
            InvalidArgumentError: A sequence repeats, or an id is out of range.
        """
        if type(seq_ids) is not _ndarray:
            seq_ids = _ids(seq_ids)
        self._core.free_batch(seq_ids)

    def reset_prefix_cache(self) -> int:
        """Forgets every prefix-cache entry, e.g. after the model's weights change.

        Cached-free blocks return to the free list; blocks still held by sequences lose their hash
        (they stay in their tables and are not offered to the cache again). Later admissions hit
        nothing until new steps register blocks.

        Returns:
            The number of blocks dropped from the cache (cached-free and held ones).
        """
        dropped = self._core.reset_prefix_cache()
        logger.info("prefix cache reset: %d blocks dropped", dropped)
        return dropped

    # ----------------------------------------------------------------------------- host tier

    @property
    def host_cache(self) -> bool:
        """Whether the host pool is also a tier of the prefix cache (``docs/tiers.md``)."""
        return bool(self._core.host_cache)

    def lookup_tiers(
        self, token_ids: TokenIds, *, cache_salt: Union[bytes, str, None] = None,
    ) -> Tuple[int, int, List[int], int, Optional[int]]:
        """How far a prompt's chain is cached: ``(gpu_blocks, host_blocks, remaining_hashes,
        salt_digest, parent_hash)``. ``remaining_hashes`` are the full blocks after both (as many
        as an admission may share) for probing lower tiers; ``parent_hash`` is the hash before the
        first of them (None at the chain's start); ``salt_digest`` identifies the chain's salt
        without revealing it. Changes nothing.

        Raises:
            InvalidArgumentError: A token id is out of range or ``cache_salt`` is empty.
        """
        if cache_salt is not None:
            check_salt("cache_salt", cache_salt)
        g, h, rest, salt, parent = self._core.lookup_tiers(_ids(token_ids), cache_salt)
        return int(g), int(h), list(rest), int(salt), parent

    def reserve_host_blocks(self, n: int) -> List[int]:
        """Reserves ``n`` host blocks to fill from a lower tier; never findable and never evicted
        until :meth:`commit_host_blocks`. May demote host-cached blocks: call
        :meth:`take_demotions` (and copy their bytes out) before writing the reserved blocks.

        Raises:
            InvalidArgumentError: ``n`` is not an int >= 1.
            OutOfBlocksError: Fewer than ``n`` host blocks can be taken (nothing is reserved).
        """
        return list(self._core.reserve_host_blocks(_count("n", n)))

    def commit_host_blocks(self, blocks: Sequence[int], hashes: Sequence[int],
                           parents: Sequence[Optional[int]], salt_digest: int,
                           token_ids: Sequence[int], ok: bool) -> int:
        """Ends reservations: with ``ok`` each block is indexed in the host tier under its hash
        (``token_ids`` flat, ``block_size`` per block), else freed. Returns how many were indexed.

        Raises:
            InvalidArgumentError: The lists' lengths disagree, a block is not reserved, or a hash
                is out of range (nothing changes).
        """
        return int(self._core.commit_host_blocks(list(blocks), list(hashes), list(parents),
                                                 salt_digest, list(token_ids),
                                                 check_flag("ok", ok)))

    def take_demotions(self) -> List[Tuple[int, int, Optional[int], int, List[int]]]:
        """The host-tier blocks dropped to make room since the last call: ``(host_block, hash,
        parent_hash, salt_digest, token_ids)``. Each host block still holds its KV until the next
        step's swap lists run (or a reserved block is written): copy it out before."""
        return list(self._core.take_demotions())

    def host_blocks_available(self) -> int:
        """Host blocks a swap-out or a reservation could take now."""
        return int(self._core.host_blocks_available())

    def __contains__(self, seq_id: object) -> bool:
        """Whether ``seq_id`` is a live sequence (False for anything that is not a valid id, a bool
        included: ``True in m`` does not ask about sequence 1)."""
        return self._core.contains(seq_id)

    def __len__(self) -> int:
        """Live sequences."""
        return self._core.num_seqs()

    def seq_len(self, seq_id: int) -> int:
        """Tokens in a sequence.

        Raises:
            UnknownSequenceError: ``seq_id`` is not live.
        """
        return self._core.seq_len(seq_id)

    def block_table(self, seq_id: int, group: int = 0) -> List[int]:
        """A sequence's block table in KV cache group ``group``: physical block ids, one per
        ``block_size`` tokens; ``-1`` where the group released a block no later query reads.

        Raises:
            UnknownSequenceError: ``seq_id`` is not live.
            InvalidArgumentError: ``group`` is not a group of this manager.
        """
        if group == 0 and type(group) is int:
            return self._core.block_table(seq_id)
        return self._core.block_table(seq_id, group)

    def block_hashes(self, seq_id: int) -> List[Optional[bytes]]:
        """The prefix-cache hash of each block in a sequence's table.

        Each hash is the chained XXH3-128 value of ``docs/prefix-hash.md`` as 16 little-endian
        bytes; ``None`` for a block not in the prefix cache: a partly filled tail, a block whose
        last token no :meth:`step` has scheduled yet (blocks are registered at step time), or any
        block with prefix caching off.

        Raises:
            UnknownSequenceError: ``seq_id`` is not live.
        """
        return self._core.block_hashes(seq_id)

    def block_refcount(self, block_id: int) -> int:
        """Reference count of a block: the number of block tables holding it.

        Raises:
            InvalidBlockError: ``block_id`` is outside the pool.
            InvalidArgumentError: ``block_id`` is negative or not an int.
        """
        return self._core.block_refcount(block_id)

    def pending_copies(self) -> List[Tuple[int, int]]:
        """Copy-on-write ``(src, dst)`` block pairs queued for the next :meth:`step`."""
        return self._core.pending_copies()

    # ------------------------------------------------------------------------------------ steps

    def attach_buffers(self, buffers: StepBuffers) -> None:
        """Attaches the step buffers that :meth:`step` fills; replaces any earlier ones.

        The core writes into the buffers' host arena, memory the extension allocated and owns (see
        :class:`~pagedkv.StepBuffers`); nothing here reads an address from Python, so rebinding or
        resizing ``buffers.host`` cannot redirect the core. The manager keeps the arena alive until
        :meth:`detach_buffers`, a later attach, or its own end.

        One buffer set belongs to one manager at a time: two managers writing block-table rows
        into one buffer would each trust incremental rows the other overwrote. Attaching the set a
        manager already holds is allowed and makes the next step write its rows in full. On error
        the earlier attachment (if any) stays in place.

        Raises:
            InvalidArgumentError: ``buffers`` is not a :class:`~pagedkv.StepBuffers`.
            BufferInvalidError: Another manager holds ``buffers`` (detach it there first).
        """
        arena = getattr(buffers, "_arena", None)
        if type(arena) is not _core.StepArena:
            reason = "must be a pagedkv.StepBuffers"
            raise InvalidArgumentError(
                f"invalid argument: buffers = {type(buffers).__name__}: {reason}",
                what="buffers",
                value=type(buffers).__name__,
                reason=reason,
            )
        self._core.attach_buffers(arena)
        self._buffers = buffers

    def detach_buffers(self) -> None:
        """Detaches the step buffers, so another manager may attach them; :meth:`step` then
        raises :class:`~pagedkv.errors.BuffersNotRegisteredError` until buffers are attached."""
        self._core.detach_buffers()
        self._buffers = None

    @property
    def buffers(self) -> Optional[StepBuffers]:
        """The attached step buffers, if any."""
        return self._buffers

    def invalidate_step_cache(self) -> None:
        """Makes the next :meth:`step` write every block-table row of its batch in full.

        :meth:`step` writes block-table rows incrementally: a row that already holds the same
        sequence's unchanged blocks gets only the new ones. The host ``block_tables`` tensor therefore
        belongs to the manager between steps; call this after writing into it yourself.
        """
        self._core.invalidate_step_cache()

    def step(self, seq_ids: SeqIds, num_new_tokens: Union[SeqIds, int]) -> StepInfo:
        """Fills the attached host buffers for one step of the given batch.

        Each ``(seq_ids[i], num_new_tokens[i])`` means "the last ``n`` tokens of the sequence are new
        this step" (they must already have been added with :meth:`admit` / :meth:`append`). Writes
        slot mapping, block-table rows in batch order, sequence lengths, query start offsets, the
        FlashInfer CSR page table, the pending copy-on-write list, and the queued swap-out and
        swap-in lists (draining each as far as its buffer holds; pairs that do not fit stay queued
        for a later step, except those this step needs: a swap-out whose device block was handed out
        again, a swap-in whose block a scheduled sequence holds — if those alone do not fit,
        :class:`~pagedkv.errors.BufferTooSmallError`). Run the lists in the order swap-out, swap-in,
        copy-on-write, before the forward pass. Follow with
        :meth:`StepBuffers.to_device`. Block-table rows are written incrementally (see
        :meth:`invalidate_step_cache`).

        Args:
            seq_ids: The batch, in order.
            num_new_tokens: New tokens per sequence, or one int for all (1 for a decode step).

        Returns:
            The :class:`StepInfo` extent of what was written.

        Raises:
            BuffersNotRegisteredError: No buffers attached.
            UnknownSequenceError: A sequence is not live.
            InvalidSequenceStateError: A sequence is swapped out or preempted by recompute.
            InvalidArgumentError: Lengths differ, a count exceeds its sequence, or a sequence repeats.
            BufferTooSmallError: The batch does not fit the buffers; nothing was written.
        """
        if type(seq_ids) is not _ndarray:
            seq_ids = _ids(seq_ids)
        t = type(num_new_tokens)
        if t is not int and t is not _ndarray:
            if isinstance(num_new_tokens, np.integer):
                num_new_tokens = int(num_new_tokens)
            else:
                num_new_tokens = _ids(num_new_tokens)
        return _new_tuple(StepInfo, self._step(seq_ids, num_new_tokens))

    # ------------------------------------------------------------------------------ reclamation

    def swap_out(self, seq_ids: SeqIds) -> List[Tuple[int, int]]:
        """Moves running sequences to the host pool and frees their device blocks.

        Pass a forked group together (as :meth:`choose_victim` returns it): a block several of
        them share is copied once, to one host block they all hold. A block shared with a sequence
        left running is copied too and stays on the device for it. Device blocks that lose their
        last holder are freed at once and may be handed out again before the next step; hashed
        ones leave the prefix cache first, so a swapped-out block is not findable by prefix
        lookups until it is swapped back in (when it is registered again). The sequences become
        ``"swapped"``: not schedulable (:meth:`step`, :meth:`append`, :meth:`fork` raise
        :class:`~pagedkv.errors.InvalidSequenceStateError`), still known (``seq_id in manager``,
        :meth:`free` works, :meth:`block_table` lists their host blocks).

        The copies are also queued and written by the next :meth:`step` into the ``swap_out``
        step buffer; the engine must run them before anything else of that step (a freed device
        block may be reused in the same step). Each copy carries the KV that steps already run
        wrote. Counts one swap preemption per sequence.

        Args:
            seq_ids: Running sequences, distinct, at least one.

        Returns:
            The ``(device_block, host_block)`` copies to make.

        Raises:
            UnknownSequenceError, InvalidSequenceStateError (one is not running),
            InvalidArgumentError (empty, repeated id), OutOfHostBlocksError (the host pool lacks
            the blocks). Nothing changed on error.
        """
        return self._core.swap_out(_ids(seq_ids))

    def swap_in(self, seq_ids: SeqIds) -> List[Tuple[int, int]]:
        """Brings swapped-out sequences back to the device.

        Allocates a device block per distinct host block (a block the group shares on the host is
        shared again on the device); like an admission, it must leave the watermark reserve free.
        The copies are queued and written by the next :meth:`step` into ``swap_in``; each host block
        is released once the step emitting its copy has been built. The sequences run again with
        their admission order and fork group unchanged.

        Returns:
            The ``(host_block, device_block)`` copies to make.

        Raises:
            UnknownSequenceError, InvalidSequenceStateError (one is not swapped out),
            InvalidArgumentError, OutOfBlocksError, WatermarkReachedError. Nothing changed on
            error.
        """
        return self._core.swap_in(_ids(seq_ids))

    def recompute(self, seq_id: int) -> None:
        """Preempts a sequence by recompute: frees its blocks (hashed full blocks stay cached, so
        :meth:`resume` can hit them), keeps its length and token ids. A swapped-out sequence may
        be dropped to this state too (its host blocks are freed). Counts one recompute preemption
        for a running sequence.

        Raises:
            UnknownSequenceError, InvalidSequenceStateError (already preempted by recompute).
        """
        self._core.recompute(seq_id)

    def resume(self, seq_id: int, max_new_tokens: Optional[int] = None) -> AdmitResult:
        """Re-admits a sequence preempted by :meth:`recompute` from its kept tokens, exactly as
        :meth:`admit` of those tokens would (prefix-cache lookup over all of them; with
        ``max_new_tokens`` it holds ``cached + min(max_new_tokens, len - cached)`` and the rest is
        appended later). Keeps its id, admission order and fork group.

        Raises:
            UnknownSequenceError, InvalidSequenceStateError (not preempted by recompute),
            InvalidArgumentError (``max_new_tokens`` 0 or not an int), OutOfBlocksError,
            WatermarkReachedError. Nothing changed on error.
        """
        return _new_tuple(AdmitResult, self._core.resume(seq_id, max_new_tokens))

    def choose_victim(self) -> Optional[List[int]]:
        """The next preemption victim: the running members of the most recently admitted fork
        group (a forked child counts as admitted with its parent; swap and recompute keep the
        order), in creation order. ``None`` when nothing runs."""
        return self._core.choose_victim()

    def decide(self, seq_ids: SeqIds, cost_model: Optional[CostModel] = None, *,
               batch_tokens: Optional[int] = None) -> Decision:
        """The cost model's choice for preempting the running ``seq_ids`` together.

        Swap: 2 × the KV bytes of their distinct device blocks over the host link. Recompute: per
        sequence, the tokens past the leading full blocks that stay cached after the preemption
        (blocks other sequences also hold), at least one, summed over the sequences (× branches for
        a forked group), costed as what they add to the steps that carry them
        (:class:`CostModel`). Swap is chosen when the host pool has room and it is strictly
        cheaper. Read-only.

        Args:
            seq_ids: Running sequences, distinct.
            cost_model: The rates; defaults to :attr:`cost_model`.
            batch_tokens: Tokens of other work each step carries beside the recompute; ``None``
                counts one decode token per running sequence outside ``seq_ids``.

        Raises:
            InvalidArgumentError: No cost model, a rate that is not finite and > 0 (a floor < 0),
                a token count that is not an int >= 0; as :meth:`swap_out` for the ids.
        """
        cm = self.cost_model if cost_model is None else cost_model
        if cm is None:
            reason = "no cost model given and none set on the manager"
            raise InvalidArgumentError(
                f"invalid argument: cost_model = None: {reason}",
                what="cost_model",
                value=None,
                reason=reason,
            )
        if not isinstance(cm, CostModel):
            cm = CostModel(*cm)  # a plain tuple of the first three rates, or all five
        max_step = _count("max_step_tokens", cm.max_step_tokens)
        batch = None if batch_tokens is None else _count("batch_tokens", batch_tokens)
        return _new_tuple(Decision, self._core.decide(
            _ids(seq_ids), float(cm.host_link_bytes_per_s), float(cm.prefill_tokens_per_s),
            float(cm.kv_bytes_per_token), float(cm.step_floor_s), max_step, batch))

    def seq_state(self, seq_id: int) -> str:
        """``"running"``, ``"swapped"`` or ``"recompute"``."""
        return self._core.seq_state(seq_id)

    def pending_swap_out(self) -> List[Tuple[int, int]]:
        """Swap-out ``(device, host)`` copies queued for the next steps."""
        return self._core.pending_swap_out()

    def pending_swap_in(self) -> List[Tuple[int, int]]:
        """Swap-in ``(host, device)`` copies queued for the next steps."""
        return self._core.pending_swap_in()

    def host_block_refcount(self, block_id: int) -> int:
        """Reference count of a host block (swapped tables holding it plus queued swap-ins).

        Raises:
            InvalidBlockError: ``block_id`` is outside the host pool.
        """
        return self._core.host_block_refcount(block_id)

    # ---------------------------------------------------------------------------------- signals

    def stats(self) -> Stats:
        """A snapshot of the manager's counters."""
        d = self._core.stats()
        d["blocks_per_seq"] = tuple(d["blocks_per_seq"])
        return Stats(**d)

    def check_invariants(self) -> None:
        """Cross-checks refcounts, free list, tables and prefix cache; for tests and debugging.

        Raises:
            InvariantViolationError: The state is inconsistent (a bug in the core).
        """
        self._core.check_invariants()

    def __repr__(self) -> str:
        return (
            f"BlockManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"watermark_blocks={self.watermark_blocks}, "
            f"max_blocks_per_seq={self.max_blocks_per_seq}, seqs={len(self)}, "
            f"free_blocks={self.num_free_blocks})"
        )


@dataclass(frozen=True)
class Stats:
    """A snapshot of the manager's state and counters (the core's ``metrics::Stats``)."""

    #: Blocks in the pool.
    num_blocks: int
    #: Tokens per block.
    block_size: int
    #: Blocks on the free list (never cached, or dropped from the cache).
    free_blocks: int
    #: Refcount-0 blocks kept for their cached content; reusable (evicted) on demand.
    cached_free_blocks: int
    #: Blocks held by a sequence or by a pending copy.
    used_blocks: int
    #: Live sequences.
    num_seqs: int
    #: Sum of sequence lengths (a shared block counts for every sequence holding it).
    used_tokens: int
    #: ``used_tokens / (num_blocks * block_size)``; can exceed 1 with sharing.
    kv_utilization: float
    #: ``used_blocks * block_size``: slots set aside, partly filled tail blocks included.
    allocated_token_slots: int
    #: Prompt tokens looked up in the prefix cache.
    prefix_query_tokens: int
    #: Of those, tokens served from cached blocks.
    prefix_hit_tokens: int
    #: ``prefix_hit_tokens / prefix_query_tokens`` (0 before any lookup).
    prefix_hit_ratio: float
    #: Cached-free blocks evicted to satisfy an allocation.
    evictions: int
    #: Verify mode: hash hits whose cached token ids differed (served as misses).
    prefix_collisions: int
    #: Blocks with a reference count above one.
    shared_blocks: int
    #: Copy-on-write block copies queued so far.
    cow_copies: int
    #: Preemptions so far, both modes, counted per sequence.
    preemptions: int
    #: Sequences swapped out so far.
    preemptions_swap: int
    #: Running sequences preempted by recompute so far.
    preemptions_recompute: int
    #: Device -> host block copies queued so far (a block shared in a group once).
    swapped_out_blocks: int
    #: Host -> device block copies queued so far.
    swapped_in_blocks: int
    #: Prompt tokens served from the host tier (also counted in ``prefix_hit_tokens``).
    host_hit_tokens: int
    #: Host -> device loads queued by admissions hitting the host tier.
    host_loaded_blocks: int
    #: Device -> host copies queued to keep evicted cached blocks in the host tier.
    offloaded_blocks: int
    #: Host-cached blocks dropped from the host tier to make room (see :meth:`take_demotions`).
    demotions: int
    #: Host blocks holding cached blocks of the host tier now.
    host_cached_blocks: int
    #: Blocks of the host pool.
    num_host_blocks: int
    #: Free blocks of the host pool.
    host_free_blocks: int
    #: Sequences swapped out now.
    swapped_seqs: int
    #: ``used_blocks / num_blocks`` with cached-free blocks counted as free (vLLM's KV cache
    #: usage; unlike :attr:`kv_utilization` it never exceeds 1).
    kv_cache_usage: float
    #: Sequences per block-count bucket: bucket 0 holds 0–1 blocks, bucket ``k >= 1`` holds
    #: ``(2**(k-1), 2**k]`` blocks, the last bucket everything above.
    blocks_per_seq: Tuple[int, ...]

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take: free plus cached-free."""
        return self.free_blocks + self.cached_free_blocks

    def as_dict(self) -> dict[str, Any]:
        """The snapshot as a plain dict (``blocks_per_seq`` as a list), e.g. for JSON."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["blocks_per_seq"] = list(self.blocks_per_seq)
        return d
