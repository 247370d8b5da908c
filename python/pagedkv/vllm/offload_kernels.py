"""The Triton kernel that moves KV blocks between vLLM's per-layer tensors and chunk-laid-out
memory, for :mod:`pagedkv.vllm.offload_copy`. No vLLM import.

Owns :class:`ChunkTable` (one KV cache group's tensors as the kernel addresses them) and
:func:`copy_chunks` (one launch moves every block of a group, every tensor of the group, either
way). The chunk side is any ``[rows, chunk_bytes]`` buffer laid out as the host pool's chunks
(module docs of :mod:`pagedkv.vllm.offload_copy`): the copier's device staging buffer (a gather
before a DMA to the host pool, a scatter after one from it).

Addressing: every tensor is viewed as ``word``-byte integers (the largest of 8, 4, 2, 1 bytes
dividing every page size and every tensor's address), the tensors of all groups are reached
from the first one by a per-tensor word offset (they are separate allocations of one device),
and block ``b`` of tensor ``t`` is words ``[off_t + b * page_t, off_t + (b + 1) * page_t)``.
Entry ``i`` of a launch moves block ``blocks[i]`` of every tensor ``t`` of the group to (or from)
words ``[rows[i] * chunk + section_t + subs[i] * page_t, ... + page_t)`` of the chunk buffer.
The copy is of raw words, bit-exact for every dtype.

Invariants: a :class:`ChunkTable` never changes after construction (its tables live on the
device); :func:`copy_chunks` checks nothing per call (the copier validated the ids whole before
calling) and queues one launch on the current stream; with ``TRITON_INTERPRET=1`` it runs on CPU
tensors (the tests use that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence

import torch
import triton
import triton.language as tl

from pagedkv.kernels._interpreter_compat import apply as _apply_interpreter_compat

_apply_interpreter_compat()

__all__ = ["ChunkTable", "copy_chunks", "word_bytes", "WORD_DTYPES"]

#: The integer dtype of each word size.
WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

#: Words a program moves (at most): 8 KiB of 8-byte words.
MAX_TILE_WORDS = 1024


@triton.jit
def _chunk_copy_kernel(kv_base, chunk_base, tensor_off_ptr, page_ptr, section_ptr, blocks_ptr,
                       rows_ptr, subs_ptr, chunk_words,
                       TO_CHUNKS: tl.constexpr, ALIGN: tl.constexpr, TILE: tl.constexpr):
    i = tl.program_id(0)  # entry: one block
    j = tl.program_id(1)  # tensor of the group
    k = tl.program_id(2)  # tile of the page
    page = tl.multiple_of(tl.load(page_ptr + j), ALIGN)
    offs = k * TILE + tl.arange(0, TILE)
    m = offs < page
    b = tl.load(blocks_ptr + i)
    r = tl.load(rows_ptr + i)
    s = tl.load(subs_ptr + i)
    kv_off = tl.multiple_of(tl.load(tensor_off_ptr + j) + b * page, ALIGN)
    ch_off = tl.multiple_of(r * chunk_words + tl.load(section_ptr + j) + s * page, ALIGN)
    if TO_CHUNKS:
        x = tl.load(kv_base + kv_off + offs, mask=m)
        tl.store(chunk_base + ch_off + offs, x, mask=m)
    else:
        x = tl.load(chunk_base + ch_off + offs, mask=m)
        tl.store(kv_base + kv_off + offs, x, mask=m)


def word_bytes(page_bytes: Sequence[int], addresses: Sequence[int]) -> int:
    """The largest word (8, 4, 2 or 1 bytes) dividing every page size and every address."""
    g = 0
    for v in list(page_bytes) + list(addresses):
        g = math.gcd(g, int(v))
    for w in (8, 4, 2):
        if g % w == 0:
            return w
    return 1


@dataclass
class ChunkTable:
    """One KV cache group's tensors as :func:`copy_chunks` addresses them (module docs).

    Attributes:
        tensor_off: int64 ``[n]`` on the device: each tensor's word offset from the base tensor.
        page: int64 ``[n]``: each tensor's page, in words.
        section: int64 ``[n]``: each tensor's section offset inside a chunk, in words.
        count: ``n``, the group's tensor count.
        tile: Words per program (a power of two, at most :data:`MAX_TILE_WORDS`).
        tiles: Programs per (block, tensor): enough tiles for the largest page.
        align: A power of two dividing every offset the kernel computes (a vectorization hint).
    """

    tensor_off: torch.Tensor
    page: torch.Tensor
    section: torch.Tensor
    count: int
    tile: int
    tiles: int
    align: int

    @classmethod
    def build(cls, base: torch.Tensor, tensors: Sequence[torch.Tensor], page_words: Sequence[int],
              section_words: Sequence[int], chunk_words: int, word: int) -> "ChunkTable":
        """The table of ``tensors`` (word views, ``[num_blocks, page]`` each) against ``base``."""
        offs: List[int] = []
        for t in tensors:
            delta = t.data_ptr() - base.data_ptr()
            assert delta % word == 0, "word_bytes() divides every address"
            offs.append(delta // word)
        g = chunk_words
        for v in list(offs) + list(page_words) + list(section_words):
            g = math.gcd(g, int(v))
        align = 1
        while align < 16 and g % (align * 2) == 0:
            align *= 2
        biggest = max(page_words)
        tile = min(MAX_TILE_WORDS, triton.next_power_of_2(biggest))
        dev = base.device

        def table(vals: Sequence[int]) -> torch.Tensor:
            return torch.tensor(list(vals), dtype=torch.int64).to(dev)

        return cls(table(offs), table(page_words), table(section_words), len(tensors), tile,
                   triton.cdiv(biggest, tile), align)


def copy_chunks(table: ChunkTable, kv_base: torch.Tensor, chunk_base: torch.Tensor,
                blocks: torch.Tensor, rows: torch.Tensor, subs: torch.Tensor, chunk_words: int,
                *, to_chunks: bool) -> None:
    """Moves, for each entry ``i`` and each tensor of ``table``'s group, block ``blocks[i]`` to
    chunk row ``rows[i]``, sub-block ``subs[i]`` of ``chunk_base`` (``to_chunks``) or back.

    ``kv_base``: the word view the table's offsets count from; ``chunk_base``: a word view of a
    chunk buffer (the device staging buffer); ``blocks``, ``rows``, ``subs``: int64,
    one entry each, contiguous, on the device. One launch on the current stream; no checks.
    """
    n = int(blocks.shape[0])
    if n == 0:
        return
    grid = (n, table.count, table.tiles)
    _chunk_copy_kernel[grid](kv_base, chunk_base, table.tensor_off, table.page, table.section,
                             blocks, rows, subs, chunk_words, TO_CHUNKS=to_chunks,
                             ALIGN=table.align, TILE=table.tile, num_warps=4)
