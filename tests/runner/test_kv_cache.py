"""The paged KV cache's tensors: their shape, zeros until written, and on CPU one buffer of huge
pages where the OS gives them."""

import pytest
import torch

from faser.runner.kv_cache import allocate_kv_cache
from faser_kernels import huge_pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_layer_gets_a_zero_key_and_value_cache(dtype):
    caches = allocate_kv_cache(3, 5, 4, 2, 8, dtype, "cpu")
    assert len(caches) == 3
    for key, value in caches:
        for t in (key, value):
            assert t.shape == (5, 4, 2, 8) and t.dtype == dtype
            assert not t.any()
    caches[0][0][1, 2] = 1.0  # one slot written: nothing else moves
    assert caches[0][0].count_nonzero() == 2 * 8
    assert sum(int(t.count_nonzero()) for k, v in caches for t in (k, v)) == 2 * 8


def test_a_cpu_cache_lies_in_one_buffer_of_huge_pages():
    if not huge_pages.available():
        pytest.skip("no MADV_HUGEPAGE here")
    caches = allocate_kv_cache(2, 64, 16, 3, 64, torch.bfloat16, "cpu")
    tensors = [t for pair in caches for t in pair]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert all(t.data_ptr() % huge_pages.ALIGN == 0 for t in tensors)
