"""Attention over the paged KV cache for one flat, ragged batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from faser_kernels import paged_attention, store_kvcache
from faser_kernels.attention import KVGather


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where each token of the flat batch reads and writes its keys and values."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot written by each token
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: cached tokens after this forward
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32: the flat batch's request boundaries
    gather: KVGather | None = None  # the PyTorch twin's gather plan, shared by all layers


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, kv_heads, dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        key_cache, value_cache = kv_cache
        store_kvcache(key, value, key_cache, value_cache, meta.slot_mapping)
        return paged_attention(
            query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
            self.scale, meta.gather,
        )
