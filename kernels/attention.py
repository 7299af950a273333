"""Paged attention for a step's flat batch: each request's queries (1 for a decode, k + 1 for a
verification, a chunk for a prefill) attend causally to its own blocks, whose keys already include
this step's tokens (store_kvcache runs first)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from faser_kernels.backend import use_triton


def paged_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: cached tokens after this step's writes
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Gathers each request's keys into a padded batch and runs one SDPA call: on a CPU one fused
    call beats a Python loop over requests once there are more than a handful."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    num_seqs = q_lens.numel()
    max_q = int(q_lens.max())
    max_kv = int(seq_lens.max())
    device = query.device

    kv_pos = torch.arange(max_kv, device=device)
    blocks = block_tables[:, kv_pos // block_size].long()  # [num_seqs, max_kv]
    slots = blocks * block_size + kv_pos % block_size
    kv_valid = kv_pos[None, :] < seq_lens[:, None]
    slots = torch.where(kv_valid, slots, 0)
    keys = key_cache.view(-1, num_kv_heads, head_dim)[slots]  # [num_seqs, max_kv, kv_heads, dim]
    values = value_cache.view(-1, num_kv_heads, head_dim)[slots]

    q_pos = torch.arange(max_q, device=device)
    q_valid = q_pos[None, :] < q_lens[:, None]  # [num_seqs, max_q]
    token_idx = torch.where(q_valid, cu_seqlens_q[:-1, None].long() + q_pos[None, :], 0)
    queries = query[token_idx]  # [num_seqs, max_q, num_heads, head_dim]

    # query i of a request sits at absolute position seq_len - q_len + i and sees keys up to it
    q_abs = (seq_lens - q_lens)[:, None] + q_pos[None, :]  # [num_seqs, max_q]
    mask = (kv_pos[None, None, :] <= q_abs[:, :, None]) & kv_valid[:, None, :]
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [num_seqs, num_heads, max_q, head_dim]
    out = out.transpose(1, 2)[q_valid]  # [num_tokens, num_heads, head_dim], in flat order
    assert out.shape[0] == query.shape[0] or num_seqs == 0
    return out


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    if use_triton(query):
        from faser_kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(
            query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale
        )
    return paged_attention_torch(
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale
    )
