"""Admission of new sequences into the block manager.

Owns :class:`_AdmitMixin`: :meth:`can_admit` (the read-only fit check), :meth:`admit` and
:meth:`admit_batch`. Invariants: admissions never take blocks from the watermark reserve, an
admission that fails leaves the manager unchanged, and a batch is validated whole before anything is
admitted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Union

import numpy as np

from .._checks import check_salt
from ._base import _ids, _ManagerBase, _ndarray, _new_tuple
from ._types import AdmitResult

if TYPE_CHECKING:
    from ._base import SeqIds, TokenIds


class _AdmitMixin(_ManagerBase):
    """Admission calls of :class:`~pagedkv.BlockManager`."""

    __slots__ = ()

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
