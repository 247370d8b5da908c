"""The block manager's host tier of the prefix cache (``docs/tiers.md``).

Owns :class:`_TierMixin`: the host-tier flag, the lookup across tiers, host-block reservations
filled from a lower tier and their commit, and the demotions the host tier made. Invariant: a
reserved host block is never findable nor evicted until it is committed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Union

from .._checks import check_flag, check_salt
from ._base import _count, _ids, _ManagerBase

if TYPE_CHECKING:
    from ._base import TokenIds


class _TierMixin(_ManagerBase):
    """Host-tier calls of :class:`~pagedkv.BlockManager`."""

    __slots__ = ()

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
