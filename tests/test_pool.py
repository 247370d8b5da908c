"""KVPool shapes, dtypes, views and block copies, against a plain element-wise loop."""

import os

import pytest

torch = pytest.importorskip("torch")

from pagedkv.config import CacheSpec  # noqa: E402
from pagedkv.errors import InvalidArgumentError, InvalidBlockError, InvalidConfigError, PagedKVError  # noqa: E402
from pagedkv.kv_pool import KVPool, copy_blocks_reference  # noqa: E402


def small_spec(dtype="float32", block_size=4):
    return CacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, block_size=block_size)


def fill_random(pool, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(pool.kv.shape, generator=g).to(pool.dtype)
    pool.kv.copy_(data)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn"])
def test_shapes_dtypes_nbytes(dtype):
    spec = small_spec(dtype)
    pool = KVPool(spec, num_blocks=10)
    assert pool.kv.shape == (3, 2, 10, 4, 2, 8)
    assert pool.dtype == getattr(torch, dtype)
    assert len(pool.k_caches) == len(pool.v_caches) == 3
    for k, v in zip(pool.k_caches, pool.v_caches):
        assert k.shape == v.shape == (10, 4, 2, 8)
        assert k.dtype == v.dtype == pool.dtype
        assert k.is_contiguous() and v.is_contiguous()
    assert pool.nbytes == 10 * spec.bytes_per_block
    assert pool.num_slots == 40
    assert bool((pool.kv.float() == 0).all())


def test_views_alias_the_backing_tensor():
    pool = KVPool(small_spec(), num_blocks=5)
    k, v = pool.block_view(2, 3)
    assert k.shape == v.shape == (4, 2, 8)
    k.fill_(1.5)
    v.fill_(-2.0)
    assert bool((pool.kv[2, 0, 3] == 1.5).all()) and bool((pool.kv[2, 1, 3] == -2.0).all())
    assert bool((pool.k_caches[2][3] == 1.5).all())
    # Nothing else changed.
    assert float(pool.kv.abs().sum()) == pytest.approx(4 * 2 * 8 * 3.5)
    # Slot s = block * B + offset: the flat per-layer view puts slot 13 in block 3, offset 1.
    flat = pool.k_caches[2].view(-1, 2, 8)
    assert bool((flat[13] == 1.5).all()) and bool((flat[11] == 0).all())


def manual_copy(kv, pairs):
    """Element-by-element copy over every layer, K and V, token and head, from a snapshot."""
    src_kv = kv.clone()
    out = kv.clone()
    layers, _, _, bsz, heads, hd = kv.shape
    for src, dst in pairs:
        for layer in range(layers):
            for kv_i in range(2):
                for t in range(bsz):
                    for h in range(heads):
                        out[layer, kv_i, dst, t, h, :] = src_kv[layer, kv_i, src, t, h, :]
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize(
    "pairs_form", ["tensor_n2", "flat_int32", "list"],
)
def test_copy_blocks_matches_manual_loop(dtype, pairs_form):
    pool = KVPool(small_spec(dtype), num_blocks=12)
    fill_random(pool)
    pairs = [(0, 5), (7, 1), (3, 11), (7, 2)]  # one source fanned out to two destinations
    expected = manual_copy(pool.kv, pairs)
    arg = {
        "tensor_n2": torch.tensor(pairs, dtype=torch.int64),
        "flat_int32": torch.tensor(pairs, dtype=torch.int32).flatten(),
        "list": pairs,
    }[pairs_form]
    assert pool.copy_blocks(arg) == 4
    assert torch.equal(pool.kv.view(torch.uint8), expected.view(torch.uint8))


def test_reference_helper_agrees_with_copy_blocks():
    a = KVPool(small_spec(), num_blocks=8)
    fill_random(a, seed=3)
    b = KVPool(small_spec(), num_blocks=8)
    b.kv.copy_(a.kv)
    pairs = [(1, 4), (6, 0), (2, 7)]
    a.copy_blocks(pairs)
    copy_blocks_reference(b, pairs)
    assert torch.equal(a.kv, b.kv)


def test_copy_blocks_empty_is_noop():
    pool = KVPool(small_spec(), num_blocks=4)
    fill_random(pool)
    before = pool.kv.clone()
    assert pool.copy_blocks([]) == 0
    assert pool.copy_blocks(torch.empty(0, 2, dtype=torch.int64)) == 0
    assert torch.equal(pool.kv, before)


@pytest.mark.parametrize(
    "pairs, error",
    [
        ([(0, 4)], InvalidBlockError),          # dst out of range
        ([(-1, 2)], InvalidBlockError),         # negative src
        ([(0, 1), (2, 1)], InvalidArgumentError),  # duplicate destination
        ([(0, 1), (1, 2)], InvalidArgumentError),  # a destination that is also a source
        ([(0, 1, 2)], InvalidArgumentError),    # wrong shape
        (torch.tensor([0, 1, 2]), InvalidArgumentError),  # odd flat length
        (torch.tensor([[0.0, 1.0]]), InvalidArgumentError),  # float ids
        ([("a", "b")], InvalidArgumentError),   # not numbers
    ],
)
def test_copy_blocks_rejects_bad_pairs_without_writing(pairs, error):
    pool = KVPool(small_spec(), num_blocks=4)
    fill_random(pool)
    before = pool.kv.clone()
    with pytest.raises(error) as info:
        pool.copy_blocks(pairs)
    assert isinstance(info.value, PagedKVError)
    assert torch.equal(pool.kv, before)


def test_constructor_and_view_errors():
    with pytest.raises(InvalidConfigError):
        KVPool(small_spec(), num_blocks=0)
    with pytest.raises(InvalidConfigError):
        KVPool(small_spec(), num_blocks=2.0)
    with pytest.raises(InvalidConfigError):
        KVPool("spec", num_blocks=2)
    with pytest.raises(InvalidArgumentError):
        KVPool(small_spec(), num_blocks=2, device="not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgumentError, match="CUDA"):
            KVPool(small_spec(), num_blocks=2, device="cuda")
    pool = KVPool(small_spec(), num_blocks=2)
    with pytest.raises(InvalidBlockError):
        pool.block_view(0, 2)
    with pytest.raises(InvalidArgumentError):
        pool.block_view(3, 0)
    with pytest.raises(InvalidArgumentError):
        pool.block_view(-1, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copy_blocks_on_cuda_matches_cpu():
    cpu = KVPool(small_spec("bfloat16"), num_blocks=16)
    fill_random(cpu, seed=7)
    gpu = KVPool(small_spec("bfloat16"), num_blocks=16, device="cuda")
    gpu.kv.copy_(cpu.kv)
    pairs = torch.tensor([(3, 9), (0, 15), (3, 4)])
    cpu.copy_blocks(pairs)
    gpu.copy_blocks(pairs)
    assert torch.equal(gpu.kv.cpu(), cpu.kv)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1",
    reason="runs the Triton block copier on CPU tensors, which needs TRITON_INTERPRET=1",
)
def test_block_copier_over_the_pool_views_matches_reference():
    # The CUDA path of copy_blocks hands the pool's per-layer K and V views (one backing tensor)
    # to the Triton block copier; run that wiring interpreted on the CPU against the reference.
    pytest.importorskip("triton")
    from pagedkv.kernels.copy import BlockCopier

    pool = KVPool(small_spec("float32"), num_blocks=12)
    fill_random(pool, seed=11)
    expected = KVPool(small_spec("float32"), num_blocks=12)
    expected.kv.copy_(pool.kv)
    pairs = [(3, 9), (0, 11), (3, 4), (7, 1)]
    copy_blocks_reference(expected, pairs)
    BlockCopier(pool.k_caches + pool.v_caches)(torch.tensor(pairs, dtype=torch.int64))
    assert torch.equal(pool.kv, expected.kv)
