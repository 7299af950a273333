"""Triton twin of `store_kvcache_torch`: one program per (token, kv head) copies that head's key
and value rows into the token's paged slot. Imported only by the dispatcher in cache.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_tokens"])
def _store_kvcache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    block_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # a negative slot marks a padding token (e.g. a CUDA-graph batch): it owns no cache row
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        d = tl.arange(0, BLOCK_D)
        mask = d < HEAD_DIM
        k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
        kc = key_cache_ptr + block * stride_kcb + offset * stride_kcs + head * stride_kch
        vc = value_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch
        tl.store(kc + d, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc + d, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, slot = block * block_size + offset
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    _check_layout(key, value, key_cache, value_cache, slot_mapping)
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens, num_kv_heads)](
        key, value, key_cache, value_cache, slot_mapping,
        num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        key_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def _check_layout(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The kernel reads head_dim as contiguous; every other stride is free (e.g. a slice of qkv)."""
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    if key_cache.shape != value_cache.shape or key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} does not hold rows of key {tuple(key.shape)}"
        )
    if slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} needs one slot a token")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
