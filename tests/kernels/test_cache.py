"""store_kvcache: the twin against a plain per-token copy, the Triton kernel against the twin."""

from __future__ import annotations

import sys

import pytest
import torch

from faser_kernels.cache import store_kvcache, store_kvcache_torch

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPES = [  # (num_tokens, num_kv_heads, head_dim, num_blocks, block_size)
    (1, 1, 16, 2, 4),
    (7, 2, 8, 4, 4),
    (13, 3, 64, 3, 16),
    (5, 5, 128, 2, 3),  # odd heads, a block size that is not a power of 2
]


def _inputs(num_tokens, num_kv_heads, head_dim, num_blocks, block_size, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    # key and value as slices of one fused projection, as the model hands them over
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    return [t.to(device) for t in (key, value, cache[0], cache[1], slots)]


@pytest.mark.parametrize("shape", SHAPES)
def test_twin_writes_each_token_to_its_slot(shape):
    key, value, key_cache, value_cache, slots = _inputs(*shape, seed=0)
    before = key_cache.clone()
    store_kvcache_torch(key, value, key_cache, value_cache, slots)
    block_size = shape[4]
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(key_cache[slot // block_size, slot % block_size], key[t])
        assert torch.equal(value_cache[slot // block_size, slot % block_size], value[t])
    untouched = torch.ones(key_cache.shape[:2], dtype=torch.bool)
    untouched.view(-1)[slots] = False
    assert torch.equal(key_cache[untouched], before[untouched])


@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_twin(interpreted, shape):
    store_kvcache_triton = interpreted["triton_cache"].store_kvcache_triton
    key, value, key_cache, value_cache, slots = _inputs(*shape, seed=1)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    store_kvcache_torch(key, value, expected_k, expected_v, slots)
    store_kvcache_triton(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_triton_skips_padding_slots(interpreted):
    key, value, key_cache, value_cache, slots = _inputs(4, 2, 16, 2, 4, seed=2)
    slots[1] = -1
    before = key_cache.clone()
    interpreted["triton_cache"].store_kvcache_triton(key, value, key_cache, value_cache, slots)
    kept = torch.cat([slots[:1], slots[2:]])
    assert torch.equal(key_cache.view(-1, 2, 16)[kept], key[[0, 2, 3]])
    changed = (key_cache != before).any(-1).any(-1).view(-1).nonzero().view(-1)
    assert sorted(changed.tolist()) == sorted(kept.tolist())


def test_triton_rejects_mismatched_shapes(interpreted):
    key, value, key_cache, value_cache, slots = _inputs(4, 2, 16, 2, 4, seed=3)
    with pytest.raises(ValueError, match="slot_mapping"):
        interpreted["triton_cache"].store_kvcache_triton(
            key, value, key_cache, value_cache, slots[:3]
        )


def test_dispatcher_forced_to_triton(interpreted, monkeypatch):
    monkeypatch.setenv("FASER_KERNELS", "triton")
    monkeypatch.setitem(sys.modules, "faser_kernels.triton_cache", interpreted["triton_cache"])
    key, value, key_cache, value_cache, slots = _inputs(6, 2, 16, 3, 4, seed=4)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    store_kvcache_torch(key, value, expected_k, expected_v, slots)
    store_kvcache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_triton_matches_twin(shape, dtype):
    from faser_kernels.triton_cache import store_kvcache_triton

    key, value, key_cache, value_cache, slots = (
        t.to(dtype) if t.is_floating_point() else t for t in _inputs(*shape, seed=5, device="cuda")
    )
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    store_kvcache_torch(key, value, expected_k, expected_v, slots)
    store_kvcache_triton(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
