"""Paged attention for a step's flat batch: each request's queries (1 for a decode, k + 1 for a
verification, a chunk for a prefill) attend causally to its own blocks, whose keys already include
this step's tokens (store_kvcache runs first)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from faser_kernels.backend import use_triton


@dataclass(frozen=True, slots=True)
class KVGather:
    """Where the twin gathers each request's keys and queries from. It depends only on the step's
    metadata, so it is planned once per forward and shared by every layer: on a CPU at batch 1
    these index computations, repeated per layer, cost as much as the attention itself."""

    slots: torch.Tensor  # [num_seqs, max_kv] int64: cache slot of each key position (0: padding)
    mask: torch.Tensor | None  # [num_seqs, 1, max_q, max_kv] bool; None: every query sees all
    token_index: torch.Tensor | None  # [num_seqs, max_q] int64; None: equal q_lens, no padding
    out_rows: torch.Tensor | None  # [num_tokens] int64: each token's row of the padded output


def plan_kv_gather(
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: cached tokens after this step's writes
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    block_size: int,
) -> KVGather:
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    max_q, min_q = int(q_lens.max()), int(q_lens.min())
    max_kv, min_kv = int(seq_lens.max()), int(seq_lens.min())
    device = seq_lens.device
    kv_pos = torch.arange(max_kv, device=device)
    blocks = block_tables[:, kv_pos // block_size].long()  # [num_seqs, max_kv]
    slots = blocks * block_size + kv_pos % block_size
    kv_valid = kv_pos[None, :] < seq_lens[:, None]
    slots = torch.where(kv_valid, slots, 0)
    q_pos = torch.arange(max_q, device=device)
    token_index = out_rows = None
    if min_q != max_q or max_q == 0:
        q_valid = q_pos[None, :] < q_lens[:, None]  # [num_seqs, max_q]
        token_index = torch.where(q_valid, cu_seqlens_q[:-1, None].long() + q_pos[None, :], 0)
        out_rows = q_valid.view(-1).nonzero().view(-1)  # padded rows in flat (request) order
    mask = None
    if max_q > 1 or min_kv != max_kv:
        # query i of a request sits at absolute position seq_len - q_len + i and sees keys up to it
        q_abs = (seq_lens - q_lens)[:, None] + q_pos[None, :]  # [num_seqs, max_q]
        mask = (kv_pos[None, None, :] <= q_abs[:, :, None]) & kv_valid[:, None, :]
        mask = mask[:, None]
    return KVGather(slots, mask, token_index, out_rows)


def paged_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: cached tokens after this step's writes
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    gather: KVGather | None = None,  # planned once per forward; planned here when not given
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Gathers each request's keys into a padded batch and runs one SDPA call: on a CPU one fused
    call beats a Python loop over requests once there are more than a handful."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if gather is None:
        gather = plan_kv_gather(block_tables, seq_lens, cu_seqlens_q, key_cache.shape[1])
    num_seqs, max_kv = gather.slots.shape
    # index_select, not advanced indexing: the same rows, copied about 3x faster on a CPU
    slots = gather.slots.view(-1)
    kv_shape = (num_seqs, max_kv, num_kv_heads, head_dim)
    keys = key_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(kv_shape)
    values = value_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(kv_shape)
    if gather.token_index is None:
        queries = query.reshape(num_seqs, num_tokens // max(num_seqs, 1), num_heads, head_dim)
    else:
        queries = query[gather.token_index]  # [num_seqs, max_q, num_heads, head_dim]
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=gather.mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    ).transpose(1, 2)  # [num_seqs, max_q, num_heads, head_dim]
    if gather.out_rows is None:
        return out.reshape(num_tokens, num_heads, head_dim)
    return out.reshape(-1, num_heads, head_dim).index_select(0, gather.out_rows)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    gather: KVGather | None = None,  # used by the twin only; the Triton kernel needs no plan
) -> torch.Tensor:
    if use_triton(query):
        from faser_kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(
            query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale
        )
    return paged_attention_torch(
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale, gather
    )
