"""How a model's linear weights are laid out in memory for the device.

On a CPU a batch-1 step streams every weight once, so the layout decides its speed. Plain row-major
fp32 GEMMs ("dense") stream at memory bandwidth for up to 3 rows, but from 4 rows on MKL repacks
the weight inside every call: on the target's 210 projections a 4-row forward took 1.5x a 3-row
one (`benchmarks.engine`, forward table). "mkl" keeps the weights prepacked for MKL's GEMM at a few
row counts and pads a flat batch up to the next one; "mkldnn" prepacks for oneDNN. The values are
unchanged; only the layout (and so the order of floating-point accumulation) differs."""

from __future__ import annotations

import torch
from torch import nn

WEIGHT_FORMATS = ("auto", "dense", "mkldnn", "mkl")
# row counts "mkl" packs for: fewer rows than the first stay dense (already bandwidth-bound), a
# flat batch is padded up to the next, and one past the last runs dense. Each is a full copy of
# the layer's weight, so the model's linear weights take 1 + len(MKL_ROW_BUCKETS) times the memory.
MKL_ROW_BUCKETS = (4, 8, 16, 32)


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


class MKLPackedLinear(nn.Module):
    """A bias-free linear layer with its weight also packed for MKL's GEMM at each row count of
    `buckets`; the padding rows are zeros and are cut off again (rows are independent)."""

    def __init__(self, linear: nn.Linear, buckets: tuple[int, ...] = MKL_ROW_BUCKETS) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("MKLPackedLinear is for bias-free projections")
        self.out_features = linear.out_features
        self.weight = linear.weight  # shared, not copied: a tied head stays tied
        self.buckets = tuple(sorted(buckets))
        weight = linear.weight.detach().contiguous()
        for rows in self.buckets:
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
            self.register_buffer(f"packed_{rows}", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        n = x.shape[0]
        if n < self.buckets[0] or n > self.buckets[-1]:
            return nn.functional.linear(x, self.weight)
        rows = next(b for b in self.buckets if b >= n)
        if rows > n:
            x = torch.cat([x, x.new_zeros(rows - n, x.shape[1])])
        packed = getattr(self, f"packed_{rows}")
        return torch.ops.mkl._mkl_linear(x, packed, self.weight, None, rows)[:n]


def resolve_weight_format(weight_format: str, device: str, dtype: str) -> str:
    """The format "auto" stands for on this device and dtype: "mkl" for float32 on a CPU whose
    torch has MKL, else "dense"."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if weight_format != "auto":
        return weight_format
    mkl = device == "cpu" and dtype == "float32" and torch.backends.mkl.is_available()
    return "mkl" if mkl else "dense"


def pack_weights(model: nn.Module, weight_format: str, device: str) -> nn.Module:
    """Repacks the decoder layers' projections in place; "mkldnn" leaves the embedding and lm_head
    dense (the head is tied to the embedding in most small models, and a packed copy would double
    it), "mkl" packs the head too (a verification asks it for many rows)."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    weight_format = resolve_weight_format(weight_format, device, dtype)
    if weight_format == "dense":
        return model
    if weight_format == "mkl":
        return _pack_mkl(model, device)
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


def _pack_mkl(model: nn.Module, device: str) -> nn.Module:
    """Every bias-free projection and the head (a verification asks it for many rows too)."""
    if device != "cpu" or not torch.backends.mkl.is_available():
        raise ValueError("weight_format 'mkl' needs a CPU build of torch with MKL")
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("weight_format 'mkl' is for float32 weights")
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and child.bias is None:
                    setattr(parent, name, MKLPackedLinear(child))
    if isinstance(model.lm_head, nn.Linear) and model.lm_head.bias is None:
        model.lm_head = MKLPackedLinear(model.lm_head)
    return model
