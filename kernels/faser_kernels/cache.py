"""Write a step's keys and values into their paged slots."""

from __future__ import annotations

import torch

from faser_kernels.backend import use_triton


def store_kvcache_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, slot = block * block_size + offset
) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if use_triton(key):
        from faser_kernels.triton_cache import store_kvcache_triton

        store_kvcache_triton(key, value, key_cache, value_cache, slot_mapping)
    else:
        store_kvcache_torch(key, value, key_cache, value_cache, slot_mapping)
