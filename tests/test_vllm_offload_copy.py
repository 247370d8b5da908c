"""pagedkv's offloading copier (:mod:`pagedkv.vllm.offload_copy`) on CPU tensors, without vLLM.

Round trips of vLLM-layout KV tensors (block-major ``[num_blocks, page_bytes]``, two KV cache
groups over three tensors of different page sizes) through the host chunk pool: blocks stored into
chunks and loaded into other blocks come back byte for byte, sub-blocks land where the layout
says (one chunk contiguous across tensors), a group entered part way through its first chunk
(``block_indices``) maps to the right sub-blocks, and bad transfers raise typed errors with
nothing copied. The round trips run on CUDA too (``gpu``-marked: the staged copies, with a
staging buffer smaller than a transfer so it goes through in pieces).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv.errors import InvalidArgumentError, InvalidConfigError
from pagedkv.vllm.offload_copy import ChunkCopier

NUM_BLOCKS = 24
PAGES = (64, 32, 96)  # bytes per block of each tensor
GROUPS = [[0, 1], [2]]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def make(bpc: int = 2, chunks: int = 10, device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-128, 127, (NUM_BLOCKS, p), dtype=torch.int8, generator=g).to(device)
               for p in PAGES]
    return tensors, ChunkCopier(tensors, GROUPS, blocks_per_chunk=bpc, num_chunks=chunks,
                                staging_chunks=2)


def test_layout_one_contiguous_chunk_across_tensors() -> None:
    tensors, cp = make(bpc=2)
    assert cp.chunk_bytes == 2 * sum(PAGES)
    assert tuple(cp.host.shape) == (10, cp.chunk_bytes)
    # Group 0's blocks 5, 9 (logical 0, 1) into chunk 3; group 1's block 7 into chunk 6 sub 0.
    cp.store(1, [5, 9, 7], [2, 1], [0, 0], [3, 6])
    assert [f.job_id for f in cp.finished()] == [1]
    row = cp.host[3]
    u8 = [t.view(torch.uint8) for t in tensors]
    assert torch.equal(row[0:64], u8[0][5]) and torch.equal(row[64:128], u8[0][9])
    assert torch.equal(row[128:160], u8[1][5]) and torch.equal(row[160:192], u8[1][9])
    assert torch.equal(cp.host[6][192:288], u8[2][7])


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_into_other_blocks(device: str) -> None:
    tensors, cp = make(bpc=2, device=device)
    before = [t.clone() for t in tensors]
    src = [0, 1, 2, 3, 10, 11]
    cp.store(7, src, [4, 2], [0, 0], [4, 2, 8])
    dst = [12, 13, 14, 15, 20, 21]
    for t in tensors:
        t[dst] = 0
    cp.load(8, [4, 2, 8], dst, [4, 2], [0, 0])
    cp.wait({8})
    done = cp.finished()
    assert [(f.job_id, f.nbytes) for f in done] == [
        (7, 4 * (64 + 32) + 2 * 96), (8, 4 * (64 + 32) + 2 * 96)]
    for g, (ts, s, d) in enumerate(((GROUPS[0], src[:4], dst[:4]),
                                   (GROUPS[1], src[4:], dst[4:]))):
        for t in ts:
            assert torch.equal(tensors[t][d], before[t][s]), (g, t)
    # Blocks outside the transfer are untouched (group 1's tensor for group 0's blocks).
    assert torch.equal(tensors[2][dst[:4]].cpu(), torch.zeros(4, 96, dtype=torch.int8))


@pytest.mark.parametrize("device", DEVICES)
def test_partial_first_chunk_maps_sub_blocks(device: str) -> None:
    tensors, cp = make(bpc=4, device=device)
    # Group 0 stores logical blocks 0..7 (blocks 0..7) into chunks 1, 2.
    cp.store(1, list(range(8)), [8, 0], [0, 0], [1, 2])
    # A load of logical blocks 5..7 (a GPU prefix hit covered 0..4): chunk 2, sub-blocks 1..3.
    for t in tensors:
        t[[20, 21, 22]] = 0
    cp.load(2, [2], [20, 21, 22], [3, 0], [5, 0])
    cp.synchronize()
    for t in GROUPS[0]:
        assert torch.equal(tensors[t][[20, 21, 22]], tensors[t][[5, 6, 7]])


@pytest.mark.parametrize("args, what", [
    (([0, 1], [1, 1], [0, 0], [0, 1, 2]), "chunk_ids"),       # more chunks than the blocks fill
    (([0, 1], [2, 0], [0, 0], []), "chunk_ids"),              # too few chunks
    (([0, NUM_BLOCKS], [2, 0], [0, 0], [0]), "block_ids"),     # block out of range
    (([0, 1], [2, 0], [0, 0], [10]), "chunk_ids"),            # chunk out of range
    (([0, 1], [1, 0], [0, 0], [0]), "group_sizes"),           # sizes do not add up
    (([0, 1], [2], [0], [0]), "group_sizes"),                 # one size per group
])
def test_bad_transfer_is_refused_whole(args, what) -> None:
    tensors, cp = make(bpc=2)
    host = cp.host.clone()
    before = [t.clone() for t in tensors]
    with pytest.raises(InvalidArgumentError) as e:
        cp.store(1, *args)
    assert e.value.what == what
    blocks, sizes, idx, chunks = args
    with pytest.raises(InvalidArgumentError):
        cp.load(2, chunks, blocks, sizes, idx)
    assert torch.equal(cp.host, host)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    assert cp.finished() == []


def test_bad_config() -> None:
    t = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(InvalidConfigError):
        ChunkCopier([], [[0]], blocks_per_chunk=1, num_chunks=1)
    with pytest.raises(InvalidConfigError):
        ChunkCopier([t, torch.zeros(5, 8, dtype=torch.int8)], [[0, 1]], blocks_per_chunk=1,
                    num_chunks=1)
    with pytest.raises(InvalidConfigError):
        ChunkCopier([t], [[1]], blocks_per_chunk=1, num_chunks=1)
    with pytest.raises(InvalidConfigError):
        ChunkCopier([t], [[0]], blocks_per_chunk=0, num_chunks=1)


def test_random_round_trips_match_a_model() -> None:
    """Random stores and loads against a dict model of each chunk's sub-blocks."""
    rng = np.random.default_rng(1)
    tensors, cp = make(bpc=2, chunks=16)
    u8 = [t.view(torch.uint8) for t in tensors]
    model: dict = {}  # (tensor, chunk, sub) -> bytes
    for step in range(60):
        g = int(rng.integers(0, 2))
        n = int(rng.integers(1, 6))
        first = int(rng.integers(0, 4))
        skip = first % 2
        nc = -(-(skip + n) // 2)
        chunks = rng.choice(16, size=nc, replace=False)
        blocks = rng.choice(NUM_BLOCKS, size=n, replace=False)
        sizes, idx = [0, 0], [0, 0]
        sizes[g], idx[g] = n, first
        if rng.random() < 0.5:
            cp.store(step, blocks, sizes, idx, chunks)
            for i, b in enumerate(blocks):
                c, s = chunks[(skip + i) // 2], (skip + i) % 2
                for t in GROUPS[g]:
                    model[(t, int(c), s)] = u8[t][int(b)].clone()
        else:
            cp.load(step, chunks, blocks, sizes, idx)
            for i, b in enumerate(blocks):
                c, s = chunks[(skip + i) // 2], (skip + i) % 2
                for t in GROUPS[g]:
                    want = model.get((t, int(c), s))
                    if want is None:  # never stored: whatever the host held
                        want = cp.host_sections[t][int(c), s]
                    assert torch.equal(u8[t][int(b)], want), (step, t, int(b))
    assert len(cp.finished()) == 60


@pytest.mark.parametrize("device", DEVICES)
def test_empty_transfer_is_reported(device: str) -> None:
    tensors, cp = make(device=device)
    host = cp.host.clone()
    cp.store(3, [], [0, 0], [0, 0], [])
    cp.load(4, [], [], [0, 0], [0, 0])
    cp.synchronize()
    assert sorted((f.job_id, f.nbytes) for f in cp.finished()) == [(3, 0), (4, 0)]
    assert torch.equal(cp.host, host)
