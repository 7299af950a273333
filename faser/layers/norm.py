"""RMSNorm, as Llama-family checkpoints define it (weight applied after normalising in fp32)."""

from __future__ import annotations

import torch
from torch import nn


def rms_scale(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:  # [..., dim] -> [..., dim]
    """x over its root mean square, computed in fp32: RMSNorm before its weight. A feature draft
    reads the target's residual streams this way (their scale grows with depth)."""
    dtype = x.dtype
    x = x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        return self.weight * rms_scale(x, self.eps)
