"""``pagedkv.tiers.host``: the host KV pool and the swap copies, on the CPU and (gpu-marked) on CUDA.

Every test fills the device pool with distinct random bytes, swaps blocks out to the host and back
into other device blocks, and compares contents exactly (every layer's K and V) with what the
blocks held before: fragmented ids (many runs), consecutive ids (one run), several chunks through a
small staging buffer, and bf16 / float8 pools (copies move raw bytes). Bad lists raise typed errors
and change nothing. On CUDA the copies run on side streams: the test overwrites the device blocks
on the compute stream right after :meth:`SwapEngine.wait` (no host sync) and the host copy must
still hold the old contents; a swap-in queued right after a swap-out of the same host blocks must
read what the swap-out wrote.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv.config import CacheSpec  # noqa: E402
from pagedkv.errors import InvalidArgumentError, InvalidBlockError, InvalidConfigError  # noqa: E402
from pagedkv.kv_pool import KVPool  # noqa: E402
from pagedkv.tiers.host import HostKVPool, SwapEngine, consecutive_runs as _runs  # noqa: E402


def _spec(dtype="float32", block_size=4, layers=3):
    return CacheSpec(num_layers=layers, num_kv_heads=2, head_dim=8, dtype=dtype, block_size=block_size)


def _filled_pool(spec, num_blocks, device="cpu", seed=0):
    pool = KVPool(spec, num_blocks, device)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, pool.kv.view(torch.uint8).shape, generator=g, dtype=torch.uint8)
    if spec.dtype in ("float32", "bfloat16", "float16"):
        # Keep values finite so a compare by value is also a compare by bytes.
        vals = torch.randn(pool.kv.shape, generator=g).to(pool.dtype)
        pool.kv.copy_(vals.to(pool.device))
    else:
        pool.kv.view(torch.uint8).copy_(raw.to(pool.device))
    return pool


def _block_bytes(pool, block):
    """All layers' K and V of one device block, as bytes on the CPU."""
    return pool.kv.view(torch.uint8)[:, :, block].cpu().clone()


def _host_bytes(host, block):
    return host.kv.view(torch.uint8)[block].clone()


def _round_trip(device, dtype, dev_ids, host_ids, back_ids, staging_blocks=None):
    spec = _spec(dtype)
    pool = _filled_pool(spec, 40, device)
    eng = SwapEngine(pool, 32, staging_blocks=staging_blocks)
    before = {d: _block_bytes(pool, d) for d in dev_ids}
    assert eng.swap_out(list(zip(dev_ids, host_ids))) == len(dev_ids)
    eng.wait()
    # The device blocks are free once swapped out: scribble over them on the compute stream.
    for d in dev_ids:
        pool.kv[:, :, d].fill_(0.5 if pool.dtype.is_floating_point else 0)
    if device != "cpu":
        eng.synchronize()
    for d, h in zip(dev_ids, host_ids):
        assert torch.equal(_host_bytes(eng.host, h), before[d]), (d, h)
    assert eng.swap_in(list(zip(host_ids, back_ids))) == len(back_ids)
    eng.wait()
    for d, b in zip(dev_ids, back_ids):
        assert torch.equal(_block_bytes(pool, b), before[d]), (d, b)
    # The per-layer view of a host block is the device block's per-layer layout.
    k, v = eng.host.block_view(1, host_ids[0])
    dk, dv = pool.block_view(1, back_ids[0])
    u8 = torch.uint8  # by bytes: random float8 bytes include NaNs
    assert torch.equal(k.view(u8), dk.cpu().view(u8)) and torch.equal(v.view(u8), dv.cpu().view(u8))
    assert eng.num_swapped_out == eng.num_swapped_in == len(dev_ids)


CASES = {
    "fragmented": ([3, 17, 5, 30, 11, 0], [9, 2, 20, 21, 22, 31], [39, 1, 2, 4, 6, 8]),
    "one-run": ([10, 11, 12, 13, 14], [0, 1, 2, 3, 4], [20, 21, 22, 23, 24]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_round_trip_cpu(case, dtype):
    _round_trip("cpu", dtype, *CASES[case])


def test_host_pool_layout_and_size():
    spec = _spec("bfloat16")
    host = HostKVPool(spec, 5, pin_memory=False)
    assert host.kv.shape == (5, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    assert host.nbytes == 5 * spec.bytes_per_block
    assert host.raw.shape == (5, spec.bytes_per_block)
    assert host.raw[1].data_ptr() - host.raw[0].data_ptr() == spec.bytes_per_block
    with pytest.raises(InvalidConfigError):
        HostKVPool(spec, 0)
    with pytest.raises(InvalidBlockError):
        host.block_view(0, 5)


def test_runs_coalesce_consecutive_ids():
    assert _runs(np.array([0, 1, 2, 5, 6, 9])) == [(0, 3), (3, 5), (5, 6)]
    assert _runs(np.array([4])) == [(0, 1)]
    assert _runs(np.array([], dtype=np.int64)) == []


def test_bad_pairs_change_nothing():
    pool = _filled_pool(_spec(), 8)
    eng = SwapEngine(pool, 4)
    host_before = eng.host.kv.view(torch.uint8).clone()  # bytes: the host pool starts uninitialised
    dev_before = pool.kv.view(torch.uint8).clone()
    for bad, err in (([(0, 4)], InvalidBlockError),        # host id out of range
                     ([(8, 0)], InvalidBlockError),        # device id out of range
                     ([(-1, 0)], InvalidBlockError),
                     ([(0, 1), (2, 1)], InvalidArgumentError),  # a destination twice
                     ([[0, 1, 2]], InvalidArgumentError),       # not pairs
                     (np.array([[0.0, 1.0]]), InvalidArgumentError)):
        with pytest.raises(err):
            eng.swap_out(bad)
    with pytest.raises(InvalidBlockError):
        eng.swap_in([(4, 0)])
    with pytest.raises(InvalidArgumentError):
        eng.swap_in([(0, 3), (1, 3)])
    assert torch.equal(eng.host.kv.view(torch.uint8), host_before)
    assert torch.equal(pool.kv.view(torch.uint8), dev_before)
    assert eng.swap_out([]) == 0 and eng.swap_in(np.zeros(0, dtype=np.int64)) == 0
    # The step buffers' flat layout: src, dst, src, dst, ...
    assert eng.swap_out(torch.tensor([1, 0, 2, 1], dtype=torch.int32)) == 2
    with pytest.raises(InvalidConfigError):
        SwapEngine(pool, 4, staging_blocks=0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("staging", [None, 2])
def test_round_trip_cuda(case, staging):
    _round_trip("cuda", "bfloat16", *CASES[case], staging_blocks=staging)


@pytest.mark.gpu
def test_cuda_ordering_without_host_sync():
    """Swap-out, overwrite on the compute stream, swap-in from the same host blocks, read — all
    queued without a host synchronisation; the streams' events alone must order them."""
    spec = _spec("bfloat16", block_size=16, layers=4)
    pool = _filled_pool(spec, 256, "cuda", seed=3)
    eng = SwapEngine(pool, 128, staging_blocks=8)
    assert eng.host.pinned
    dev = list(range(0, 120, 3))
    host = list(range(80, 80 + len(dev)))
    before = pool.kv[:, :, dev].clone()
    torch.cuda.synchronize()
    # A long kernel on the compute stream first, so the swap-out really must wait for it.
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        big = big @ big
        big /= big.norm()
    pool.kv[:, :, dev[0]].add_(1.0)  # queued after the matmuls: the swap must see it
    expect0 = pool.kv[:, :, dev[0]].clone()
    eng.swap_out(list(zip(dev, host)))
    eng.wait()
    pool.kv[:, :, dev].zero_()  # the blocks are reused at once
    back = list(range(130, 130 + len(dev)))
    eng.swap_in(list(zip(host, back)))
    eng.wait()
    got = pool.kv[:, :, back].clone()
    torch.cuda.synchronize()
    assert torch.equal(got[:, :, 1:], before[:, :, 1:])
    assert torch.equal(got[:, :, 0], expect0)


@pytest.mark.gpu
def test_cuda_per_block_order_lets_loads_run_beside_write_backs():
    """The orders a step relies on when write-backs and loads run side by side, all queued
    without a host synchronisation (and without :meth:`SwapEngine.wait` between swaps), through
    a staging buffer of several chunks:

    - loads into the very device blocks a swap-out is still gathering (a step's evicted blocks
      are reused for its loads), in an order that crosses chunks;
    - a swap-out of blocks a swap-in is still scattering into;
    - a swap-out into host blocks a swap-in is still reading.
    """
    spec = _spec("bfloat16", block_size=16, layers=4)
    pool = _filled_pool(spec, 256, "cuda", seed=5)
    eng = SwapEngine(pool, 160, staging_blocks=8)
    g = torch.Generator().manual_seed(6)
    n = 40
    dev = torch.randperm(256, generator=g)[:n].tolist()
    h_out = list(range(0, n))
    h_in = list(range(60, 60 + n))
    eng.host.kv[h_in] = torch.randn(eng.host.kv[h_in].shape, generator=g).to(eng.host.kv.dtype)
    host_in = eng.host.kv.view(torch.uint8)[h_in].clone()
    before = pool.kv.view(torch.uint8)[:, :, dev].cpu()
    torch.cuda.synchronize()
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # the swaps must wait for queued work, not for the host
        big = big @ big
        big /= big.norm()
    eng.swap_out(list(zip(dev, h_out)))
    back = [dev[i] for i in torch.randperm(n, generator=g).tolist()]
    eng.swap_in(list(zip(h_in, back)))
    # Out again at once: the gathers must follow the scatters just queued into `back`.
    h_again = list(range(100, 100 + n))
    eng.swap_out(list(zip(back, h_again)))
    # And into the host blocks the first swap-in may still be reading.
    spare = [b for b in range(256) if b not in set(dev)][:n]
    spare_before = pool.kv.view(torch.uint8)[:, :, spare].clone()
    eng.swap_out(list(zip(spare, h_in)))
    eng.wait()
    got = pool.kv.view(torch.uint8)[:, :, back].clone()
    eng.synchronize()
    torch.cuda.synchronize()
    u8 = eng.host.kv.view(torch.uint8)
    for i in range(n):
        assert torch.equal(u8[h_out[i]], before[:, :, i]), i
        assert torch.equal(got[:, :, i], host_in[i].to("cuda")), i
        assert torch.equal(u8[h_again[i]], host_in[i]), i
        assert torch.equal(u8[h_in[i]], spare_before[:, :, i].cpu()), i
