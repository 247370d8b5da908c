"""Scatter (write path), block copy (copy-on-write over all layers) and swap (device <-> host)."""

import pytest

# kernel_common skips this module where kernels cannot run.
from kernel_common import DEVICES, host_tensors_only, torch

from pagedkv import kernels as K
from pagedkv.kernels import reference as R


def dtypes_for(device):
    # The interpreter mishandles bfloat16 (no numpy type); it is covered by the compiled runs.
    return (torch.float32, torch.float16) if device == "cpu" else (torch.bfloat16, torch.float16, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size,kv_heads,head_dim", [(8, 2, 32), (16, 1, 64), (256, 3, 16)])
def test_scatter_matches_reference(device, block_size, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size + kv_heads)
    big = device == "cuda"
    num_blocks = 40 if big else 6
    for dtype in dtypes_for(device):
        n = 300 if big else 13
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
        slots[::5] = -1  # padding
        slots[3] = num_blocks * block_size + 7  # past the pool: skipped
        # Keys as a strided view, like one slice of a fused QKV projection.
        qkv = torch.randn(n, 3, kv_heads, head_dim, generator=gen).to(dtype)
        key, value = qkv[:, 1], qkv[:, 2]
        kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
        vc = torch.randn_like(kc)
        rk, rv = R.ref_scatter_kv(key, value, kc, vc, slots)
        dk, dv = kc.to(device), vc.to(device)
        K.scatter_kv(key.to(device), value.to(device), dk, dv, slots.to(device))
        assert torch.equal(dk.cpu(), rk)
        assert torch.equal(dv.cpu(), rv)


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_then_decode_reads_what_was_written(device):
    # The write and read paths agree on the slot -> (block, offset) layout.
    gen = torch.Generator().manual_seed(3)
    bs, h, d, n = 8, 2, 32, 21
    kc = torch.full((6, bs, h, d), float("nan")).to(device)
    vc = torch.full_like(kc, float("nan"))
    blocks = [4, 1, 3]
    slots = torch.tensor([blocks[i // bs] * bs + i % bs for i in range(n)], dtype=torch.int64)
    key = torch.randn(n, h, d, generator=gen)
    val = torch.randn(n, h, d, generator=gen)
    K.scatter_kv(key.to(device), val.to(device), kc, vc, slots.to(device))
    q = torch.randn(1, 4, d, generator=gen)
    bt = torch.tensor([blocks + [999]], dtype=torch.int32)
    out = K.paged_decode(q.to(device), kc, vc, bt.to(device), torch.tensor([n], dtype=torch.int32, device=device))
    kk = key.repeat_interleave(2, dim=1)
    vv = val.repeat_interleave(2, dim=1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q[0], kk) / d ** 0.5, dim=-1)
    ref = torch.einsum("hn,nhd->hd", p, vv)
    assert torch.allclose(out[0].cpu(), ref, atol=1e-5)


@host_tensors_only
def test_scatter_validation():
    kc = torch.zeros(4, 8, 2, 16)
    vc = torch.zeros(4, 8, 2, 16)
    key = torch.zeros(3, 2, 16)
    slots = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(K.KernelDTypeError, match="slot_mapping: dtype is torch.int32"):
        K.scatter_kv(key, key, kc, vc, slots.int())
    with pytest.raises(K.KernelShapeError, match="slot_mapping"):
        K.scatter_kv(key, key, kc, vc, slots[:2])
    with pytest.raises(K.KernelShapeError, match="key: size of dim 1 is 1"):
        K.scatter_kv(key[:, :1], key[:, :1], kc, vc, slots)
    with pytest.raises(K.KernelDTypeError, match="key: dtype"):
        K.scatter_kv(key.half(), key, kc, vc, slots)
    with pytest.raises(K.KernelLayoutError, match="key"):
        K.scatter_kv(key.transpose(1, 2).contiguous().transpose(1, 2), key, kc, vc, slots)
    with pytest.raises(K.KernelShapeError, match="value"):
        K.scatter_kv(key, key[:2], kc, vc, slots)
    with pytest.raises(K.KernelDTypeError, match="k_cache"):
        K.scatter_kv(key, key, [kc], vc, slots)


@pytest.mark.parametrize("device", DEVICES[:1])
def test_scatter_check_indices_leaves_pool_unchanged(device):
    kc = torch.zeros(4, 8, 2, 16)
    vc = torch.zeros(4, 8, 2, 16)
    key = torch.ones(3, 2, 16)
    with pytest.raises(K.KernelIndexError, match=r"slot_mapping\[1\]: is 32"):
        K.scatter_kv(key, key, kc, vc, torch.tensor([0, 32, 1]), check_indices=True)
    assert not kc.any() and not vc.any()


def _pool(layers, num_blocks, block_size, heads, dim, dtype, device, gen):
    kv = torch.randn(layers, 2, num_blocks, block_size, heads, dim, generator=gen).to(dtype).to(device)
    return kv, [kv[i, 0] for i in range(layers)], [kv[i, 1] for i in range(layers)]


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_all_layers(device):
    gen = torch.Generator().manual_seed(8)
    big = device == "cuda"
    nb = 300 if big else 12
    for dtype in dtypes_for(device):
        kv, ks, vs = _pool(3, nb, 16, 2, 32, dtype, device, gen)
        perm = torch.randperm(nb, generator=gen)
        npairs = 100 if big else 4
        pairs = torch.stack([perm[:npairs], perm[npairs : 2 * npairs]], dim=1)
        pairs[1, 0] = -1  # padding row
        ref = R.ref_copy_blocks([t.cpu() for t in ks + vs], pairs)
        K.copy_blocks(ks, vs, pairs.to(device))
        for a, b in zip(ks + vs, ref):
            assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("device", DEVICES)
def test_block_copier_separate_tensors_and_reuse(device):
    gen = torch.Generator().manual_seed(2)
    # Separately allocated per-layer tensors, not views of one pool.
    caches = [torch.randn(10, 8, 1, 16, generator=gen).to(device) for _ in range(4)]
    copier = K.BlockCopier(caches)
    for pairs in ([[0, 9], [3, 4]], [[9, 1]]):
        m = torch.tensor(pairs, dtype=torch.int64)
        ref = R.ref_copy_blocks([c.cpu() for c in caches], m)
        copier(m.to(device))
        for a, b in zip(caches, ref):
            assert torch.equal(a.cpu(), b)
    copier(torch.empty(0, 2, dtype=torch.int64, device=device))  # nothing to do


@host_tensors_only
def test_copy_validation():
    c = [torch.zeros(4, 8, 2, 16) for _ in range(2)]
    with pytest.raises(K.KernelDTypeError, match="block_mapping: dtype"):
        K.BlockCopier(c)(torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(K.KernelShapeError, match="block_mapping: size of dim 1 is 3"):
        K.BlockCopier(c)(torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(K.KernelShapeError, match=r"caches\[1\]: shape"):
        K.BlockCopier([c[0], torch.zeros(5, 8, 2, 16)])
    with pytest.raises(K.KernelDTypeError, match=r"caches\[1\]: dtype"):
        K.BlockCopier([c[0], c[1].half()])
    with pytest.raises(K.KernelLayoutError, match=r"caches\[1\]"):
        K.BlockCopier([c[0], c[1].transpose(2, 3).contiguous().transpose(2, 3)])
    with pytest.raises(K.KernelShapeError, match="v_caches"):
        K.copy_blocks(c, c[:1], torch.zeros(1, 2, dtype=torch.int64))


@pytest.mark.parametrize("device", DEVICES[:1])
def test_copy_check_indices(device):
    c = [torch.arange(4.0).view(4, 1, 1, 1).expand(4, 8, 2, 16).contiguous() for _ in range(2)]
    before = [t.clone() for t in c]
    copier = K.BlockCopier(c)
    for pairs, match in (([[0, 4]], "expected ids in"), ([[0, 1], [2, 1]], "repeat"), ([[0, 1], [1, 2]], "also a source")):
        with pytest.raises(K.KernelIndexError, match=match):
            copier(torch.tensor(pairs), check_indices=True)
    for a, b in zip(c, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["kernel", "torch"])
def test_swap_roundtrip(device, method):
    gen = torch.Generator().manual_seed(6)
    kv, ks, vs = _pool(2, 20, 8, 2, 32, torch.float16, device, gen)
    pin = device == "cuda"
    host = [torch.zeros(7, 8, 2, 32, dtype=torch.float16, pin_memory=pin) for _ in range(4)]
    out_map = torch.tensor([[5, 0], [17, 6], [2, 3]], dtype=torch.int64)
    swap_src = [t.clone() for t in ks + vs]
    K.swap_blocks(ks + vs, host, out_map, method=method)
    for h, s in zip(host, swap_src):
        for src, dst in out_map.tolist():
            assert torch.equal(h[dst], s[src].cpu())
        assert not h[1].any()  # untouched host block
    staging = torch.empty(3 * 8 * 2 * 32 * 2, dtype=torch.uint8, pin_memory=pin)
    in_map = torch.tensor([[0, 11], [6, 12], [3, 13]], dtype=torch.int64)
    K.swap_blocks(host, ks + vs, in_map, staging=staging, method=method)
    for d, s, h in zip(ks + vs, swap_src, host):
        assert torch.equal(d[11:14].cpu(), h[[0, 6, 3]])
        assert torch.equal(d[:11].cpu(), s[:11].cpu())
    with pytest.raises(K.KernelIndexError, match="dst id is 7"):
        K.swap_blocks(ks + vs, host, torch.tensor([[0, 7]]))
    with pytest.raises(K.KernelShapeError, match="staging"):
        K.swap_blocks(host, ks + vs, in_map, staging=staging[:10])


@host_tensors_only
def test_swap_validation():
    dev = [torch.zeros(4, 8, 2, 16) for _ in range(2)]
    host = [torch.zeros(4, 8, 2, 16) for _ in range(2)]
    m = torch.tensor([[0, 1]])
    with pytest.raises(K.KernelArgumentError, match="method"):
        K.swap_blocks(dev, host, m, method="dma")
    with pytest.raises(K.KernelShapeError, match="dst_caches: has 1"):
        K.swap_blocks(dev, host[:1], m)
    with pytest.raises(K.KernelDTypeError, match="dst_caches: dtype"):
        K.swap_blocks(dev, [h.half() for h in host], m)
    with pytest.raises(K.KernelShapeError, match="block shape"):
        K.swap_blocks(dev, [torch.zeros(4, 8, 2, 8) for _ in range(2)], m)
    with pytest.raises(K.KernelIndexError, match="src id is -1"):
        K.swap_blocks(dev, host, torch.tensor([[-1, 1]]))
    with pytest.raises(K.KernelDTypeError, match="block_mapping"):
        K.swap_blocks(dev, host, m.int())


@pytest.mark.parametrize("device", DEVICES[1:])
def test_swap_kernel_needs_pinned_host(device):
    dev = [torch.zeros(4, 8, 2, 16, device=device)]
    host = [torch.zeros(4, 8, 2, 16)]  # pageable
    with pytest.raises(K.KernelDeviceError, match="pinned"):
        K.swap_blocks(dev, host, torch.tensor([[0, 1]]), method="kernel")
    # "auto" falls back to staged copies for pageable memory.
    dev[0][0] = 3.0
    K.swap_blocks(dev, host, torch.tensor([[0, 1]]))
    assert torch.equal(host[0][1], torch.full((8, 2, 16), 3.0))


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_config_variants(device):
    """The tuning variants (tile size, streaming cache hints) write the same rows."""
    gen = torch.Generator().manual_seed(77)
    kc = torch.randn(6, 8, 2, 64, generator=gen).to(device)
    vc = torch.randn_like(kc)
    key = torch.randn(20, 2, 64, generator=gen).to(device)
    val = torch.randn(20, 2, 64, generator=gen).to(device)
    slots = torch.randperm(48, generator=gen)[:20].to(device)
    slots[3] = -1
    rk, rv = R.ref_scatter_kv(key.cpu(), val.cpu(), kc.cpu(), vc.cpu(), slots.cpu())
    for cfg in ({"ELEMS": 1024, "STREAM": True}, {"ELEMS": 8192, "num_warps": 8}):
        k2, v2 = kc.clone(), vc.clone()
        K.scatter_kv(key, val, k2, v2, slots, config=cfg)
        assert torch.equal(k2.cpu(), rk) and torch.equal(v2.cpu(), rv)
    with pytest.raises(K.KernelArgumentError, match="config"):
        K.scatter_kv(key, val, kc, vc, slots, config={"BLOCK": 1})
