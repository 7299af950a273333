"""RMSNorm, as Llama-family checkpoints define it (weight applied after normalising in fp32)."""

from __future__ import annotations

import torch
from torch import nn

from faser_kernels import cpu_ops

FEATURE_EPS = 1e-6  # a feature draft's RMS scaling of the target's residual streams


def rms_scale(x: torch.Tensor, eps: float = FEATURE_EPS) -> torch.Tensor:  # [..., d] -> [..., d]
    """x over its root mean square, computed in fp32: RMSNorm before its weight. A feature draft
    reads the target's residual streams this way (their scale grows with depth)."""
    dtype = x.dtype
    x = x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def add_rms_scale(
    x: torch.Tensor,  # [num_tokens, dim], the model's dtype
    residual: torch.Tensor,  # [num_tokens, dim] float32
) -> torch.Tensor:  # [num_tokens, dim], x's dtype
    """rms_scale(x + residual) in x's dtype, with the kernel the fused layers take their feature
    rows with (faser_kernels.cpu_decoder), so both paths give a feature draft the same bits."""
    unit = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    add_norm = cpu_ops.add_rms_norm if cpu_ops.runs_on(x) else cpu_ops.add_rms_norm_torch
    return add_norm(x, residual, unit, FEATURE_EPS)[0]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        return self.weight * rms_scale(x, self.eps)

    def add_norm(
        self,
        x: torch.Tensor,  # [num_tokens, dim]
        residual: torch.Tensor | None,  # [num_tokens, dim] float32: the stream; None at first
        out_dtype: torch.dtype | None = None,  # of the normed output; None: x's
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the normed x + residual, and x + residual (fp32)
        """The residual add fused with the norm that reads it (one kernel on a CPU). The stream
        stays float32 whatever the model's dtype: rounded at every layer, its error builds up."""
        if cpu_ops.runs_on(x):
            return cpu_ops.add_rms_norm(x, residual, self.weight, self.eps, out_dtype)
        return cpu_ops.add_rms_norm_torch(x, residual, self.weight, self.eps, out_dtype)
