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

    def lookup_tiers_groups(
        self, token_ids: TokenIds, *, cache_salt: Union[bytes, str, None] = None,
    ) -> Tuple[List[int], int, List[List[bool]]]:
        """Per KV cache group, which of a prompt's full blocks are cached: ``(hashes,
        salt_digest, present)``. ``hashes`` are the chain hashes of the full blocks an admission
        may share; ``present[g][i]`` tells whether group ``g``'s block ``i`` (key
        :func:`pagedkv.groups.group_hash` of ``hashes[i]`` and ``g``) is cached with the prompt's
        token ids on the device or in the host tier. Changes nothing.

        Raises:
            InvalidArgumentError: A token id is out of range or ``cache_salt`` is empty.
        """
        if cache_salt is not None:
            check_salt("cache_salt", cache_salt)
        hashes, salt, present = self._core.lookup_tiers_groups(_ids(token_ids), cache_salt)
        return list(hashes), int(salt), [list(p) for p in present]

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
                           token_ids: Sequence[int], ok: bool,
                           groups: Optional[Sequence[int]] = None) -> int:
        """Ends reservations: with ``ok`` each block is indexed in the host tier under its hash
        (``token_ids`` flat, ``block_size`` per block), else freed. Returns how many were indexed.
        With ``groups``, block ``i`` is KV cache group ``groups[i]``'s block of chain hash
        ``hashes[i]`` (``parents`` chain hashes too), indexed under that group's key.

        Raises:
            InvalidArgumentError: The lists' lengths disagree, a block is not reserved, a hash
                is out of range, or a group is unknown (nothing changes).
        """
        return int(self._core.commit_host_blocks(
            list(blocks), list(hashes), list(parents), salt_digest, list(token_ids),
            check_flag("ok", ok), None if groups is None else list(groups)))

    def take_demotions(self) -> List[Tuple[int, int, Optional[int], int, List[int]]]:
        """The host-tier blocks dropped to make room since the last call: ``(host_block, hash,
        parent_hash, salt_digest, token_ids)``. Each host block still holds its KV until the next
        step's swap lists run (or a reserved block is written): copy it out before."""
        return list(self._core.take_demotions())

    def take_demotions_by_group(
            self) -> List[Tuple[int, int, Optional[int], int, List[int], int]]:
        """:meth:`take_demotions` with each demotion's KV cache group appended: ``(host_block,
        hash, parent_hash, salt_digest, token_ids, group)``; ``hash`` and ``parent_hash`` are
        that group's keys (:func:`pagedkv.groups.group_hash`; a group-0 block's are its chain
        hashes)."""
        return list(self._core.take_demotions_by_group())

    def host_blocks_available(self) -> int:
        """Host blocks a swap-out or a reservation could take now."""
        return int(self._core.host_blocks_available())
