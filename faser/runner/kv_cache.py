"""The paged KV cache tensors of one model, and the feature cache a feature draft reads."""

from __future__ import annotations

import torch

from faser_kernels import huge_pages


def kv_bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (key, value) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim].

    Zero-filled: a slot read before it is written must not hold NaNs that a masked softmax would
    still multiply by zero (0 * NaN is NaN). On CPU in huge pages where the OS gives them
    (faser_kernels.huge_pages): attention reads each request's blocks from anywhere in the cache."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if device == "cpu":
        caches = huge_pages.zeros(shape, dtype, 2 * num_layers)
    else:
        caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * num_layers)]
    return list(zip(caches[0::2], caches[1::2], strict=True))


def allocate_feature_cache(
    num_blocks: int, block_size: int, dim: int, dtype: torch.dtype, device: str
) -> torch.Tensor:
    """[num_blocks * block_size + 1, dim]: the target's feature row of each KV slot, indexed by
    the same slot mapping, so a request's features live in its blocks and need no bookkeeping
    of their own. The last row stays zero: what a position with nothing before it reads.
    Zero-filled, as the KV cache is: a slot read before it is written holds no NaN."""
    shape = (num_blocks * block_size + 1, dim)
    if device == "cpu":
        return huge_pages.zeros(shape, dtype, 1)[0]
    return torch.zeros(shape, dtype=dtype, device=device)
