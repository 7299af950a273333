"""Which implementation runs: Triton on CUDA tensors (or when forced with FASER_KERNELS=triton;
tests run Triton's interpreter on the CPU with TRITON_INTERPRET=1), the row-invariant C kernels
on CPUs that have their instructions, and the PyTorch twin otherwise (or with
FASER_KERNELS=torch)."""

from __future__ import annotations

import functools
import os

import torch


def use_triton(tensor: torch.Tensor) -> bool:
    forced = os.environ.get("FASER_KERNELS", "auto")
    if forced == "torch":
        return False
    if forced == "triton":
        return True
    return tensor.is_cuda


def attention_backend(
    device: torch.device | str, dtype: torch.dtype, head_dim: int, group: int
) -> str:
    """"triton", "cpu" (cpu_attention.c) or "torch" (the twin) for queries of this kind (`group`
    query heads per kv head)."""
    forced = os.environ.get("FASER_KERNELS", "auto")
    if forced in ("torch", "triton"):
        return forced
    if torch.device(device).type == "cuda":
        return "triton"
    return "cpu" if _cpu_attention_runs(dtype, head_dim, group) else "torch"


@functools.cache
def _cpu_attention_runs(dtype: torch.dtype, head_dim: int, group: int) -> bool:
    from faser_kernels.cpu_attention import unavailable_reason

    return unavailable_reason(dtype, head_dim, group) is None
