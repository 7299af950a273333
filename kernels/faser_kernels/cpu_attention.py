"""Row-invariant paged attention on x86 CPUs with AVX-512 (cpu_attention.c; float32 also with AVX2,
cpu_attention_avx2.c, for head sizes that are multiples of 8). Its PyTorch twin is
`paged_attention_torch` (attention.py), with the same signature.

Each query walks its own request's keys in a fixed order, so it gets the same bits as a decode,
a verified position or a prefill row, whatever else shares the batch; the padded SDPA calls of
the twin round differently with the padded length and the queries beside them.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from faser_kernels import cpu_build

MAX_HEAD_DIM = 128  # MAX_CHUNKS * 16 in cpu_attention.c
MAX_GROUP = 8  # query heads per kv head (MAX_GROUP)


def unavailable_reason(dtype: torch.dtype, head_dim: int, group: int = 1) -> str | None:
    """None where the kernel runs for this dtype, head size and number of query heads per kv
    head on this CPU; else why not."""
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} > {MAX_HEAD_DIM}"
    if group > MAX_GROUP:
        return f"{group} query heads per kv head > {MAX_GROUP}"
    if cpu_build.isa() == "avx2" and head_dim % 8:
        return f"head_dim {head_dim} is not a multiple of 8 (the AVX2 build's lanes)"
    return cpu_build.unavailable_reason("cpu_attention.c", dtype)


def paged_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: cached tokens after this step's writes
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    query = query.contiguous()
    block_tables, seq_lens, cu = (t.to(torch.int32).contiguous()
                                  for t in (block_tables, seq_lens, cu_seqlens_q))
    out = torch.empty_like(query)
    code = _library().faser_paged_attention(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), cu.data_ptr(), out.data_ptr(), seq_lens.numel(),
        block_tables.shape[1], block_size, num_heads, num_kv_heads, head_dim, scale,
        int(query.dtype == torch.bfloat16),
    )
    if code != 0:
        raise RuntimeError(f"cpu paged attention failed ({code}): head_dim {head_dim}, "
                           f"{num_heads} heads over {num_kv_heads} kv heads")
    return out


@functools.cache
def _library() -> ctypes.CDLL:
    lib = cpu_build.library("cpu_attention.c")
    fn = lib.faser_paged_attention
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_long] * 6 + [ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib
