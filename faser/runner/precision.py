"""The dtype a device computes natively: bfloat16 on CUDA devices that support it and on CPUs with
AVX-512 bf16 or AMX instructions (there a bf16 product costs no more than an fp32 one and reads
half the bytes), float32 elsewhere."""

from __future__ import annotations

import torch

from faser_kernels.cpu_build import cpu_flags

DTYPES = ("auto", "float32", "bfloat16", "float16")
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype "auto" stands for on `device`; any other is kept."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    return "bfloat16" if computes_bf16(device) else "float32"


def computes_bf16(device: str) -> bool:
    if torch.device(device).type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return any(flag in cpu_flags() for flag in BF16_CPU_FLAGS)
