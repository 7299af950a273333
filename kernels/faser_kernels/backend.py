"""Which implementation runs: Triton on CUDA tensors, or when forced with FASER_KERNELS=triton
(tests run Triton's interpreter on the CPU with TRITON_INTERPRET=1); the PyTorch twin otherwise."""

from __future__ import annotations

import os

import torch


def use_triton(tensor: torch.Tensor) -> bool:
    forced = os.environ.get("FASER_KERNELS", "auto")
    if forced == "torch":
        return False
    if forced == "triton":
        return True
    return tensor.is_cuda
