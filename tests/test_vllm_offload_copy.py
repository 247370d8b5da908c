"""pagedkv's offloading copier (:mod:`pagedkv.vllm.offload_copy`) on CPU tensors, without vLLM.

Round trips of vLLM-layout KV tensors (block-major ``[num_blocks, page_bytes]``, two KV cache
groups over three tensors of different page sizes) through the host chunk pool: blocks stored into
chunks and loaded into other blocks come back byte for byte, sub-blocks land where the layout
says (one chunk contiguous across tensors), a group entered part way through its first chunk
(``block_indices``) maps to the right sub-blocks, and bad transfers raise typed errors with
nothing copied. The round trips run through both copy paths (``path``): on CPU the indexed
copies and, under Triton's interpreter (``TRITON_INTERPRET=1``; skipped without it), the
pipelined path's kernel; on CUDA (``gpu``-marked) the pipelined path, with a staging buffer
smaller than a transfer so it goes through in pieces and the slot ring turns over. The kernel
(:mod:`pagedkv.vllm.offload_kernels`) is also checked alone against indexing, both ways, at 8-,
4- and 2-byte words, and unknown paths and paths a device cannot take are refused.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv.errors import InvalidArgumentError, InvalidConfigError
from pagedkv.vllm.offload_copy import ChunkCopier

NUM_BLOCKS = 24
PAGES = (64, 32, 96)  # bytes per block of each tensor
GROUPS = [[0, 1], [2]]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_kernel_cpu = pytest.mark.skipif(
    not INTERPRET, reason="the kernel on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
_gpu = pytest.mark.gpu
#: (device, path) for every path each device takes.
PATHS = [
    pytest.param("cpu", "indexed", id="cpu-indexed"),
    pytest.param("cpu", "pipelined", marks=_kernel_cpu, id="cpu-pipelined"),
    pytest.param("cuda", "pipelined", marks=_gpu, id="cuda-pipelined"),
]


def make(bpc: int = 2, chunks: int = 10, device: str = "cpu", path=None,
         pages=PAGES, groups=GROUPS):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-128, 127, (NUM_BLOCKS, p), dtype=torch.int8, generator=g).to(device)
               for p in pages]
    return tensors, ChunkCopier(tensors, groups, blocks_per_chunk=bpc, num_chunks=chunks,
                                staging_chunks=2, path=path)


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


@pytest.mark.parametrize("device, path", PATHS)
def test_round_trip_into_other_blocks(device: str, path: str) -> None:
    tensors, cp = make(bpc=2, device=device, path=path)
    assert cp.path == path
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


@pytest.mark.parametrize("device, path", PATHS)
def test_partial_first_chunk_maps_sub_blocks(device: str, path: str) -> None:
    tensors, cp = make(bpc=4, device=device, path=path)
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


@pytest.mark.parametrize("device, path", PATHS)
def test_random_round_trips_match_a_model(device: str, path: str) -> None:
    """Random stores and loads against a dict model of each chunk's sub-blocks. The pipelined
    path writes whole host chunks, so there a store forgets every sub-block of the chunks it
    enters before recording the ones it wrote."""
    rng = np.random.default_rng(1)
    tensors, cp = make(bpc=2, chunks=16, device=device, path=path)
    whole_chunks = path == "pipelined"
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
            if whole_chunks:
                model = {k: v for k, v in model.items() if k[1] not in set(chunks.tolist())}
            for i, b in enumerate(blocks):
                c, s = chunks[(skip + i) // 2], (skip + i) % 2
                for t in GROUPS[g]:
                    model[(t, int(c), s)] = u8[t][int(b)].clone()
        else:
            cp.load(step, chunks, blocks, sizes, idx)
            cp.synchronize()
            for i, b in enumerate(blocks):
                c, s = chunks[(skip + i) // 2], (skip + i) % 2
                for t in GROUPS[g]:
                    want = model.get((t, int(c), s))
                    if want is None:  # never stored: whatever the host held
                        want = cp.host_sections[t][int(c), s]
                    assert torch.equal(u8[t][int(b)].cpu(), want.cpu()), (step, t, int(b))
    assert len(cp.finished()) == 60


@pytest.mark.parametrize("device, path", PATHS)
def test_empty_transfer_is_reported(device: str, path: str) -> None:
    tensors, cp = make(device=device, path=path)
    host = cp.host.clone()
    cp.store(3, [], [0, 0], [0, 0], [])
    cp.load(4, [], [], [0, 0], [0, 0])
    cp.synchronize()
    assert sorted((f.job_id, f.nbytes) for f in cp.finished()) == [(3, 0), (4, 0)]
    assert torch.equal(cp.host, host)


# ---------------------------------------------------------------------- the kernel and the paths

KERNEL_DEVICES = [pytest.param("cpu", marks=_kernel_cpu, id="cpu"),
                  pytest.param("cuda", marks=_gpu, id="cuda")]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("pages, word", [((64, 32, 96), 8), ((12, 20, 4), 4), ((6, 10, 2), 2)])
def test_kernel_moves_blocks_both_ways(device: str, pages, word: int) -> None:
    """copy_chunks against indexing: every named (block, tensor) lands at its chunk row and
    sub-block, both ways, at the word size the page sizes allow; nothing else changes."""
    from pagedkv.vllm.offload_kernels import WORD_DTYPES, ChunkTable, copy_chunks, word_bytes

    g = torch.Generator().manual_seed(3)
    tensors = [torch.randint(-128, 127, (NUM_BLOCKS, p), dtype=torch.int8, generator=g).to(device)
               for p in pages]
    rows = [t.view(torch.uint8) for t in tensors]
    assert word_bytes(pages, [r.data_ptr() for r in rows]) == word
    bpc, nrows = 3, 5
    offs = np.cumsum([0] + [bpc * p for p in pages])
    chunk_bytes = int(offs[-1])
    words = [r.view(WORD_DTYPES[word]) for r in rows]
    group = [2, 0]  # a group's tensors in any order
    table = ChunkTable.build(words[0], [words[t] for t in group], [pages[t] // word for t in group],
                             [int(offs[t]) // word for t in group], chunk_bytes // word, word)
    chunks = torch.randint(0, 256, (nrows, chunk_bytes), dtype=torch.uint8, generator=g).to(device)
    before = chunks.clone()
    blocks, crow, sub = [4, 17, 9, 0], [3, 0, 3, 1], [2, 0, 0, 1]
    idx = [torch.tensor(a, dtype=torch.int64, device=device) for a in (blocks, crow, sub)]
    copy_chunks(table, words[0], chunks.view(WORD_DTYPES[word]), *idx, chunk_bytes // word,
                to_chunks=True)
    want = before.clone()
    for b, r, s in zip(blocks, crow, sub):
        for t in group:
            o = int(offs[t]) + s * pages[t]
            want[r, o:o + pages[t]] = rows[t][b]
    assert torch.equal(chunks, want)
    # Back into other blocks: only those change.
    kv_before = [r.clone() for r in rows]
    dst = [20, 21, 22, 23]
    idx[0] = torch.tensor(dst, dtype=torch.int64, device=device)
    copy_chunks(table, words[0], chunks.view(WORD_DTYPES[word]), *idx, chunk_bytes // word,
                to_chunks=False)
    for t in range(len(pages)):
        expect = kv_before[t].clone()
        if t in group:
            expect[dst] = kv_before[t][blocks]
        assert torch.equal(rows[t], expect), t


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter (TRITON_INTERPRET=1)")
def test_kernel_paths_on_odd_pages_round_trip() -> None:
    """The pipelined path with 2-byte words (pages of 6 and 10 bytes) and one group of two
    tensors beside an empty group: the round trip restores every byte."""
    pages, groups = (6, 10), [[1, 0], []]
    tensors, cp = make(bpc=2, chunks=6, path="pipelined", pages=pages, groups=groups)
    assert cp.word == 2
    before = [t.clone() for t in tensors]
    cp.store(1, [3, 4, 5], [3, 0], [1, 0], [5, 0])
    cp.load(2, [5, 0], [10, 11, 12], [3, 0], [1, 0])
    for t, b in zip(tensors, before):
        assert torch.equal(t[[10, 11, 12]], b[[3, 4, 5]])


def test_paths_a_device_cannot_take_are_refused(monkeypatch) -> None:
    t = torch.zeros(4, 8, dtype=torch.int8)
    # Unknown names, the removed paths' among them, are refused naming the value.
    for bad in ("fast", "direct", "legacy"):
        with pytest.raises(InvalidConfigError) as e:
            ChunkCopier([t], [[0]], blocks_per_chunk=1, num_chunks=1, path=bad)
        assert e.value.field == "path" and e.value.value == bad and repr(bad) in str(e.value)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InvalidConfigError) as e:
        ChunkCopier([t], [[0]], blocks_per_chunk=1, num_chunks=1, path="pipelined")
    assert e.value.field == "path" and "TRITON_INTERPRET" in str(e.value)
    assert ChunkCopier([t], [[0]], blocks_per_chunk=1, num_chunks=1).path == "indexed"


@pytest.mark.gpu
def test_cuda_default_path_and_pinned_pool() -> None:
    t = torch.zeros(4, 8, dtype=torch.int8, device="cuda")
    cp = ChunkCopier([t], [[0]], blocks_per_chunk=1, num_chunks=2)
    assert cp.path == "pipelined" and cp.host.is_pinned()
    with pytest.raises(InvalidConfigError):
        ChunkCopier([t], [[0]], blocks_per_chunk=1, num_chunks=2, path="indexed")


@pytest.mark.gpu
def test_cuda_long_transfers_through_the_slot_ring() -> None:
    """Transfers of many pieces (staging of 4 chunks: 2 slots of 2), back to back without a
    wait: a load after the store of its chunks reads what the store wrote, and later stores
    overwriting those chunks wait for the loads still reading them."""
    g = torch.Generator().manual_seed(5)
    nb, page, layers = 64, 4096, 4
    tensors = [torch.randint(-128, 127, (nb, page), dtype=torch.int8, generator=g).cuda()
               for _ in range(layers)]
    cp = ChunkCopier(tensors, [list(range(layers))], blocks_per_chunk=1, num_chunks=40,
                     staging_chunks=4)
    rng = np.random.default_rng(5)
    src, dst = rng.permutation(nb)[:20], np.arange(40, 60)
    first = [t[src].clone() for t in tensors]
    chunks = rng.permutation(40)[:20]
    cp.store(1, src, [20], [0], chunks)
    cp.load(2, chunks, dst, [20], [0])
    # Overwrite the same chunks from other blocks, and load those too, all queued at once.
    src2 = rng.permutation(np.arange(20, 40))
    dst2 = np.arange(0, 20)
    second = [t[src2].clone() for t in tensors]
    cp.store(3, src2, [20], [0], chunks)
    cp.load(4, chunks, dst2, [20], [0])
    cp.wait({4})
    cp.synchronize()
    for t, a, b in zip(tensors, first, second):
        assert torch.equal(t[dst], a)
        assert torch.equal(t[dst2], b)
    assert sorted(f.job_id for f in cp.finished()) == [1, 2, 3, 4]


def test_batched_dma_off_says_why(monkeypatch) -> None:
    """Batching turned off (or no driver) leaves the copies to the caller, queuing nothing."""
    from pagedkv.vllm.offload_dma import BatchDMA

    monkeypatch.setenv("PAGEDKV_BATCH_DMA", "0")
    b = BatchDMA()
    assert not b.available and "PAGEDKV_BATCH_DMA=0" in b.reason
    z = np.zeros(1, dtype=np.uint64)
    assert b.copy(0, z, z, z) is False
    monkeypatch.delenv("PAGEDKV_BATCH_DMA")
    b = BatchDMA()
    if not torch.cuda.is_available():
        # On a machine without a CUDA driver it is unavailable, and says so.
        assert b.available or b.reason


@pytest.mark.gpu
@pytest.mark.parametrize("scattered", [False, True], ids=["run", "scattered"])
def test_cuda_batched_dmas_equal_one_copy_each(scattered: bool) -> None:
    """The same stores and loads with each slot's DMAs in one driver call and one ``copy_`` per
    run move the same bytes; on a driver with the batched copy the copier uses it."""
    from pagedkv.vllm.offload_dma import BatchDMA, batch_dma

    g = torch.Generator().manual_seed(9)
    nb, page, layers = 48, 4096, 3
    tensors = [torch.randint(-128, 127, (nb, page), dtype=torch.int8, generator=g).cuda()
               for _ in range(layers)]
    rng = np.random.default_rng(9)
    src = rng.permutation(24)[:16]  # the loads write blocks 24..47
    chunks = rng.permutation(40)[:16] if scattered else np.arange(16) + 3
    hosts = []
    for batched in (True, False):
        cp = ChunkCopier(tensors, [list(range(layers))], blocks_per_chunk=1, num_chunks=40,
                         staging_chunks=8)
        if batched:
            assert cp.dma == ("batched" if batch_dma().available else "copy_")
        else:
            off = BatchDMA.__new__(BatchDMA)
            off.available, off.reason = False, "test"
            cp._batch = off
            assert cp.dma == "copy_"
        dst = np.arange(32, 48) if batched else np.arange(24, 40)
        cp.store(1, src, [16], [0], chunks)
        cp.load(2, chunks, dst, [16], [0])
        cp.synchronize()
        for t in tensors:
            assert torch.equal(t[torch.from_numpy(dst).cuda()], t[torch.from_numpy(src).cuda()])
        hosts.append(cp.host[torch.from_numpy(chunks)].clone())
    assert torch.equal(hosts[0], hosts[1])


@pytest.mark.parametrize("seed", range(6))
def test_piece_split_covers_each_entry_once_in_piece_order(seed: int) -> None:
    """The pipelined path's split of a transfer (two groups, a partial first chunk, scattered
    and consecutive chunk ids, pieces of 1-5 chunks): the DMA runs are consecutive ids inside one
    piece and cover the chunks once; the kernel entries cover every block once, piece by piece,
    each naming its block, its chunk's row in the piece's slot and its sub-block."""
    rng = np.random.default_rng(seed)
    tensors, cp = make(bpc=2, chunks=40)
    for _ in range(20):
        sizes = [int(rng.integers(0, 9)), int(rng.integers(0, 9))]
        if sum(sizes) == 0:
            continue
        idx = [int(rng.integers(0, 4)), int(rng.integers(0, 4))]
        nc = sum(-(-((i % 2) + n) // 2) for n, i in zip(sizes, idx) if n)
        chunks = (rng.choice(40, size=nc, replace=False) if rng.random() < 0.5
                  else np.arange(nc) + int(rng.integers(0, 40 - nc + 1)))
        blocks = rng.choice(NUM_BLOCKS, size=sum(sizes), replace=True)
        size = int(rng.integers(1, 6))
        pcs = cp._split(blocks, sizes, idx, chunks, size, None)
        assert pcs.uniq.tolist() == sorted(set(chunks.tolist()))
        assert pcs.npieces == -(-pcs.uniq.size // size)
        covered = []
        for p in range(pcs.npieces):
            for c, r, k in pcs.runs[pcs.run_edges[p]:pcs.run_edges[p + 1]].tolist():
                a = p * size + r
                assert k >= 1 and 0 <= r and r + k <= size
                assert pcs.uniq[a:a + k].tolist() == list(range(c, c + k))
                covered += list(range(a, a + k))
        assert covered == list(range(pcs.uniq.size))
        # The transfer's definition (module docs), independently of the code under test.
        want, b0, c0 = [], 0, 0
        for g, (n, first) in enumerate(zip(sizes, idx)):
            if n:
                skip = first % 2
                want += [(g, int(blocks[b0 + i]), int(chunks[c0 + (skip + i) // 2]),
                          (skip + i) % 2) for i in range(n)]
                b0, c0 = b0 + n, c0 + -(-(skip + n) // 2)
        want.sort()
        got = []
        last = -1
        assert pcs.cols is not None
        for p, spans in enumerate(pcs.spans):
            for g, a, z in spans:
                assert a >= last
                last = z
                for b, r, s in pcs.cols[:, a:z].T.tolist():
                    assert 0 <= r < size
                    got.append((g, b, int(pcs.uniq[p * size + r]), s))
        assert sorted(got) == want


@pytest.mark.gpu
def test_cuda_index_buffers_reused_grown_and_never_overwritten_early() -> None:
    """Transfers of growing size (past the index buffers' first capacity) queued without a
    wait behind long work on the caller's stream: the pinned index buffers still to be copied
    from are not rewritten (each transfer takes a new one), and every block arrives."""
    g = torch.Generator().manual_seed(11)
    nb, page = 3000, 256
    tensors = [torch.randint(-128, 127, (nb, page), dtype=torch.int8, generator=g).cuda()
               for _ in range(2)]
    cp = ChunkCopier(tensors, [[0, 1]], blocks_per_chunk=1, num_chunks=3000, staging_chunks=64)
    rng = np.random.default_rng(11)
    sizes = (10, 700, 1500, 40, 1400, 5)
    srcs = [rng.choice(nb, size=n, replace=False) for n in sizes]
    wants = [[t[torch.from_numpy(src).cuda()].clone() for t in tensors] for src in srcs]
    for n, src in zip(sizes, srcs):  # compile every kernel variant first (a compile outlasts
        cp.store(99, src, [n], [0], np.arange(n))  # the wait below)
    cp.synchronize()
    cp = ChunkCopier(tensors, [[0, 1]], blocks_per_chunk=1, num_chunks=3000, staging_chunks=64)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # the caller's queued work (~0.5 s): every store waits for it
    sent = []
    for k, (n, src, want) in enumerate(zip(sizes, srcs, wants)):
        chunks = rng.choice(3000, size=n, replace=False)
        cp.store(k, src, [n], [0], chunks)
        sent.append((chunks, want))
    taken = len(cp._index["store"]._bufs)
    cp.synchronize()
    for k, (chunks, want) in enumerate(sent):
        # Only the last store of each chunk counts: check chunks no later store wrote.
        later = {c for cs, _ in sent[k + 1:] for c in cs.tolist()}
        keep = np.array([i for i, c in enumerate(chunks.tolist()) if c not in later])
        if keep.size == 0:
            continue
        blocks = np.arange(keep.size)
        cp.load(100 + k, chunks[keep], blocks, [keep.size], [0])
        cp.synchronize()
        sel = torch.from_numpy(keep).cuda()
        for t, w in zip(tensors, want):
            assert torch.equal(t[:keep.size], w[sel]), f"store {k} moved other blocks"
    # Every store was queued while the ones before it still waited: no index buffer was free,
    # so each took its own (one rewritten early would have sent other blocks, as checked above).
    assert taken == len(sizes)


def test_core_split_refuses_bad_arguments_and_writes_nothing() -> None:
    """``_core.split_transfer`` directly: a bad buffer, a negative id, a buffer too short, a
    non-bool group flag and a zero piece are typed errors, and the buffer is left as it was."""
    from pagedkv import _core
    from pagedkv.errors import BufferInvalidError

    good = dict(block_ids=[1, 2], group_sizes=[2], block_indices=[0], chunk_ids=[5, 6],
                tabled=[True], blocks_per_chunk=1, num_blocks=8, num_chunks=8, piece=4)
    out = np.full(6, -3, dtype=np.int64)
    uniq, runs, edges, spans, n = _core.split_transfer(**good, out=out)
    assert uniq.tolist() == [5, 6] and runs.tolist() == [[5, 0, 2]] and edges == [0, 1]
    assert spans == [[(0, 0, 2)]] and n == 2 and out.tolist() == [1, 2, 0, 1, 0, 0]
    bad_out = [np.zeros(6, dtype=np.int32), np.zeros((2, 3), dtype=np.int64),
               np.zeros(12, dtype=np.int64)[::2], [0] * 6]
    for o in bad_out:
        with pytest.raises(BufferInvalidError):
            _core.split_transfer(**good, out=o)
    for field, value, what in (("block_ids", [-1, 2], "block_ids"),
                               ("chunk_ids", [5, 8], "chunk_ids"),
                               ("tabled", [1], "tabled"),
                               ("piece", 0, "piece"),
                               ("blocks_per_chunk", 0, "blocks_per_chunk")):
        out = np.full(6, -3, dtype=np.int64)
        with pytest.raises(InvalidArgumentError) as e:
            _core.split_transfer(**{**good, field: value}, out=out)
        assert e.value.what == what
        assert (out == -3).all()
    short = np.full(5, -3, dtype=np.int64)
    with pytest.raises(InvalidArgumentError) as e:
        _core.split_transfer(**good, out=short)
    assert e.value.what == "out" and (short == -3).all()
