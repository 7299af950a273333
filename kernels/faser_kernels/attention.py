"""Paged attention for a step's flat batch: each request's queries (1 for a decode, k + 1 for a
verification, a chunk for a prefill) attend causally to its own blocks, whose keys already include
this step's tokens (store_kvcache runs first)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from faser_kernels.backend import attention_backend

# Requests with at most this many queries (decodes, verifications) share one padded SDPA call;
# a longer prefill chunk gets a call of its own: padded into one batch with it, thirty decodes
# would each compute a chunk's worth of query rows (a mixed step ran 20x slower that way)
SHARED_MAX_Q = 16
# Each shared call pads every request's keys to the longest context in it, and the gather of
# those padded keys is most of a CPU step at long contexts. Requests are split by context length
# where a split saves more padded key positions than this, the price of one more call per layer
# (about what gathering this many positions costs on a CPU; see split_by_context).
SPLIT_COST_POSITIONS = 512


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Requests attended in one padded SDPA call, and where their keys and queries come from."""

    slots: torch.Tensor  # [num_seqs, max_kv] int64: cache slot of each key position (0: padding)
    mask: torch.Tensor | None  # [num_seqs, 1, max_q, max_kv] bool; None: every query sees all
    token_index: torch.Tensor | None  # [num_seqs, max_q] int64; None: equal q_lens, no padding
    out_rows: torch.Tensor | None  # [num_tokens] int64: each token's row of the padded output
    tokens: torch.Tensor | None  # [num_tokens] int64: the group's rows of the flat batch; None: all


@dataclass(frozen=True, slots=True)
class KVGather:
    """The twin's plan for one step. It depends only on the step's metadata, so it is made once
    per forward and shared by every layer: on a CPU at batch 1 these index computations, repeated
    per layer, cost as much as the attention itself."""

    groups: tuple[KVGroup, ...]


def plan_kv_gather(
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: cached tokens after this step's writes
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    block_size: int,
) -> KVGather:
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    subsets = request_groups(q_lens.tolist(), seq_lens.tolist())
    if len(subsets) == 1:
        return KVGather((_plan_group(block_tables, seq_lens, cu_seqlens_q, block_size, None),))
    groups = []
    for subset in subsets:
        index = torch.tensor(subset, device=seq_lens.device)
        lens = q_lens[index].long()
        starts = cu_seqlens_q[:-1][index].long()
        cu = F.pad(lens.cumsum(0), (1, 0))
        # the flat rows of the subset's tokens: start_i + 0 .. start_i + len_i - 1, in order
        tokens = torch.repeat_interleave(starts - cu[:-1], lens) + torch.arange(
            int(cu[-1]), device=seq_lens.device
        )
        groups.append(_plan_group(block_tables[index], seq_lens[index], cu, block_size, tokens))
    return KVGather(tuple(groups))


def request_groups(q_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Which requests share a padded SDPA call. A prefill chunk gets one of its own; decodes are
    kept apart from verifications (in one call every decode would be padded to the longest
    verification's queries: with k = 1 anywhere in the step, twice a decode's attention work);
    and each of those is split by context length (split_by_context)."""
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    verifies = [i for i, n in enumerate(q_lens) if n != 1 and n <= SHARED_MAX_Q]
    alone = [[i] for i, n in enumerate(q_lens) if n > SHARED_MAX_Q]
    return split_by_context(decodes, seq_lens) + split_by_context(verifies, seq_lens) + alone


def split_by_context(requests: list[int], seq_lens: list[int]) -> list[list[int]]:
    """`requests` split into groups of similar context length: the runs of the requests sorted by
    length that minimise the padded key positions gathered (each group's size times its longest
    context) plus SPLIT_COST_POSITIONS per group, found by dynamic programming over the sorted
    order. Each group keeps the requests' own order (one group of all keeps the flat batch's)."""
    if len(requests) <= 2:
        return [requests] if requests else []
    order = sorted(requests, key=seq_lens.__getitem__)
    best = [0.0] + [float("inf")] * len(order)  # best[j]: the cheapest split of order[:j]
    start_of = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        longest = seq_lens[order[end - 1]]
        for start in range(end):
            cost = best[start] + (end - start) * longest + SPLIT_COST_POSITIONS
            if cost < best[end]:
                best[end], start_of[end] = cost, start
    groups, end = [], len(order)
    while end > 0:
        groups.append(sorted(order[start_of[end]:end]))
        end = start_of[end]
    return groups[::-1]


def _plan_group(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # boundaries within the group's own tokens
    block_size: int,
    tokens: torch.Tensor | None,
) -> KVGroup:
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
    return KVGroup(slots, mask, token_index, out_rows, tokens)


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
    """Gathers each group's keys into a padded batch and runs one SDPA call per group: on a CPU
    one fused call beats a Python loop over requests once there are more than a handful."""
    if gather is None:
        gather = plan_kv_gather(block_tables, seq_lens, cu_seqlens_q, key_cache.shape[1])
    if len(gather.groups) == 1 and gather.groups[0].tokens is None:
        return _attend_group(query, key_cache, value_cache, gather.groups[0], scale)
    out = torch.empty_like(query)
    for group in gather.groups:
        part = _attend_group(query.index_select(0, group.tokens), key_cache, value_cache, group,
                             scale)
        out.index_copy_(0, group.tokens, part)
    return out


def _attend_group(
    query: torch.Tensor,  # [group tokens, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: KVGroup,
    scale: float,
) -> torch.Tensor:  # [group tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs, max_kv = group.slots.shape
    # index_select, not advanced indexing: the same rows, copied about 3x faster on a CPU
    slots = group.slots.view(-1)
    kv_shape = (num_seqs, max_kv, num_kv_heads, head_dim)
    keys = key_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(kv_shape)
    values = value_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(kv_shape)
    if group.token_index is None:
        queries = query.reshape(num_seqs, num_tokens // max(num_seqs, 1), num_heads, head_dim)
    else:
        queries = query[group.token_index]  # [num_seqs, max_q, num_heads, head_dim]
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=group.mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    ).transpose(1, 2)  # [num_seqs, max_q, num_heads, head_dim]
    if group.out_rows is None:
        return out.reshape(num_tokens, num_heads, head_dim)
    return out.reshape(-1, num_heads, head_dim).index_select(0, group.out_rows)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    gather: KVGather | None = None,  # used by the twin only; the kernels need no plan
) -> torch.Tensor:
    group = query.shape[1] // key_cache.shape[2]
    backend = attention_backend(query.device, query.dtype, query.shape[-1], group)
    if backend == "triton":
        from faser_kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(
            query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale
        )
    if backend == "cpu":
        from faser_kernels.cpu_attention import paged_attention_cpu

        return paged_attention_cpu(
            query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale
        )
    return paged_attention_torch(
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale, gather
    )
