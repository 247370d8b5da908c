"""The block manager's Python face.

Owns :class:`BlockManager`, a typed, documented wrapper over the extension's ``_core.BlockManager``,
and the small result types it returns (:class:`AdmitResult`, :class:`Stats`; :class:`StepInfo`
lives beside the buffers it describes, in :mod:`pagedkv.buffers`, and is re-exported here).
All bookkeeping lives in the Rust core; this package only normalises arguments, so its invariants are
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

The class is split by concern, one mixin per module (the package's ``__init__`` keeps the class, its
construction and its public names): ``_config`` (sizes, flags, free counts, KV events),
``_admit`` (admission), ``_append`` (append, fork, free, prefix-cache reset), ``_provisional``
(speculative tokens: append, commit, rewind), ``_step`` (step
buffers and :meth:`BlockManager.step`), ``_reclaim`` (swap, recompute, :meth:`BlockManager.decide`),
``_tiers`` (the host tier), ``_queries`` (read-only queries, stats, invariant checks); ``_base``
holds the attributes and argument helpers they share, ``_types`` the result types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from .. import _core
from .._checks import DEFAULT_BLOCK_SIZE, check_block_size, check_flag
from ..buffers import StepInfo
from ..groups import GroupLike, KVCacheGroup, groups_arg
from ._admit import _AdmitMixin
from ._append import _AppendMixin
# The old module's private helpers and logger, still importable from here.
from ._base import _count, _ids, _ndarray, _new_tuple, logger  # noqa: F401
from ._config import _ConfigMixin
from ._provisional import _ProvisionalMixin
from ._queries import _QueryMixin
from ._reclaim import _ReclaimMixin
from ._step import _StepMixin
from ._tiers import _TierMixin
from ._types import AdmitResult, CostModel, Decision, Stats

if TYPE_CHECKING:
    from ..buffers import StepBuffers
    from ._base import SeqIds, TokenIds  # noqa: F401

__all__ = [
    "BlockManager", "AdmitResult", "StepInfo", "Stats", "CostModel", "Decision", "KVCacheGroup",
]


class BlockManager(
    _ConfigMixin, _AdmitMixin, _AppendMixin, _ProvisionalMixin, _TierMixin, _QueryMixin,
    _StepMixin, _ReclaimMixin,
):
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
            must be full when any group is (a model whose every layer slides or is chunked runs
            with every group windowed, group 0 included; no ``host_cache`` then). Each sequence gets one block table per group, all drawing on the one
            pool; a sliding or chunked group releases the blocks no later query reads when a step
            is built (``-1`` in :meth:`block_table`). ``None`` (the default): one full group,
            the manager without groups. Swap moves every group's held blocks (released entries
            stay ``-1``); the host tier (``host_cache``) keeps each group's blocks under (chain
            hash, group). More than one group needs step buffers built with ``num_groups``; KV
            events then name each block's group.
        max_provisional: Provisional tokens a sequence may hold past its committed length
            (speculative drafts; :meth:`append_provisional`, :meth:`commit`, :meth:`rewind`).
            0 (the default): none.

    Raises:
        InvalidConfigError: A value is out of range (no blocks, block size 0, watermark ≥ pool, a
            windowed group 0 beside a full group, more than 64 groups, ...).
        InvalidArgumentError: A size is negative or not an int (a bool is not one), or a flag is
            not a bool.
    """

    # The instance attributes are slots of `_ManagerBase`, where the mixins see them declared.
    __slots__ = ()

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
        max_provisional: int = 0,
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
            max_provisional,
        )
        #: Default :class:`CostModel` of :meth:`decide` (settable).
        self.cost_model: Optional[CostModel] = cost_model
        self._buffers: Optional[StepBuffers] = None
        # Bound once: the hot path then skips two attribute lookups per call.
        self._append_batch = self._core.append_batch
        self._step = self._core.step

    def __repr__(self) -> str:
        return (
            f"BlockManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"watermark_blocks={self.watermark_blocks}, "
            f"max_blocks_per_seq={self.max_blocks_per_seq}, seqs={len(self)}, "
            f"free_blocks={self.num_free_blocks})"
        )
