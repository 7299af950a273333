"""How a model's linear weights are laid out in memory for the device.

On a CPU a batch-1 step streams every weight once, so the layout decides its speed: weights
prepacked for oneDNN ("mkldnn") ran about twice as fast as plain row-major fp32 GEMMs here, and stay
fast for the few extra tokens of a verification. The values are unchanged; only the layout (and so
the order of floating-point accumulation) differs."""

from __future__ import annotations

import torch
from torch import nn

WEIGHT_FORMATS = ("dense", "mkldnn")


class PackedLinear(nn.Module):
    """A linear layer whose weight is held in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("weight", weight.to_mkldnn(), persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else torch.zeros(self.out_features)
        self.register_buffer("bias", bias.float().to_mkldnn(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        return torch._C._nn.mkldnn_linear(x.to_mkldnn(), self.weight, self.bias).to_dense()


def pack_weights(model: nn.Module, weight_format: str, device: str) -> nn.Module:
    """Repacks the decoder layers' projections in place (the embedding and lm_head stay dense:
    the head is tied to the embedding in most small models, and a packed copy would double it)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if weight_format == "dense":
        return model
    if device != "cpu" or not torch.backends.mkldnn.is_available():
        raise ValueError("weight_format 'mkldnn' needs a CPU with oneDNN")
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("weight_format 'mkldnn' is for float32 weights (bf16 is oneDNN already)")
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, PackedLinear(child))
    return model
