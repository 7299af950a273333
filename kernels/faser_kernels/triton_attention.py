"""Triton twin of `paged_attention_torch`: flash-style paged attention over a step's flat batch.

One program per (request, query block, kv head). Its rows are (query position, query head of the
kv head's group) pairs, so a decode (one query) under GQA still fills a tensor-core tile with the
group's heads and reads each key once for all of them. Keys stream in tiles of BLOCK_N positions,
each gathered through the block table, under an online softmax (running max and sum, exp2).

The programs of all requests share one grid axis without knowing `max(q_len)` on the host: request
i owns program ids [cu_seqlens_q[i] // BLOCK_Q + i, ...), which leaves room for its
ceil(q_len / BLOCK_Q) blocks, and a program finds its request by binary search. Programs past a
request's last block return at once. So no step shape ever forces a host sync or a recompile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _find_request(cu_seqlens_q_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Largest i with cu_seqlens_q[i] // BLOCK_Q + i <= pid (that key is non-decreasing in i)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_block <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr,
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    num_seqs, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    block_size,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of 2
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of 2, at least 16 for tl.dot
    BLOCK_Q: tl.constexpr,  # query positions a program
    BLOCK_N: tl.constexpr,  # key positions a tile
    PRECISION: tl.constexpr,  # "ieee" keeps fp32 exact; tf32 would cost ~1e-3
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_request(cu_seqlens_q_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # query j sits at absolute position context_len + j

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_pos = q_block * BLOCK_Q + rows // GROUP_PAD  # [BLOCK_M]
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (q_pos < q_len) & (rows % GROUP_PAD < GROUP)
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    token = (q_start + q_pos).to(tl.int64)
    q_ptrs = query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_M, D]

    q_abs = context_len + q_pos
    # the block's last query sees the most keys; nothing beyond it needs reading
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, kv_end, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < kv_end
        block = tl.load(table + k_pos // block_size, mask=k_valid, other=0).to(tl.int64)
        offset = k_pos % block_size
        kv_mask = k_valid[:, None] & d_valid[None, :]
        k_rows = key_cache_ptr + block * stride_kb + offset * stride_ks + kv_head * stride_kh
        v_rows = value_cache_ptr + block * stride_vb + offset * stride_vs + kv_head * stride_vh
        k = tl.load(k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = (k_pos[None, :] <= q_abs[:, None]) & k_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a row with nothing visible yet (only padding rows) keeps m = -inf: shift by 0 instead
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc=acc, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: cached tokens after this step's writes
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    _check_shapes(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q)
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = _block_q(num_tokens, num_seqs, group_pad)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache,
        block_tables, seq_lens, cu_seqlens_q,
        num_seqs, scale * 1.4426950408889634,  # log2(e): the kernel works in exp2
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        key_cache.shape[1],
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_Q=block_q,
        BLOCK_N=64 if head_dim <= 64 else 32,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out


def _block_q(num_tokens: int, num_seqs: int, group_pad: int) -> int:
    """Query positions a program: enough rows (positions x group heads) for a 16-row tensor-core
    tile, more when the step is prefill-heavy. Decided from shapes alone, so no host sync."""
    mean_q = -(-num_tokens // num_seqs)
    rows = 64 if mean_q >= 16 else 16
    return max(1, rows // group_pad)


def _check_shapes(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
) -> None:
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape != value_cache.shape or key_cache.shape[3] != head_dim:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} / value_cache {tuple(value_cache.shape)} "
            f"do not match query head_dim {head_dim}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError("cu_seqlens_q needs num_seqs + 1 entries and block_tables num_seqs rows")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_tables", block_tables)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
