"""How a model's linear weights are laid out in memory for the device.

"packed": the decoder projections, the head and any other linear layer of the model's own (a
feature draft's input fusions) in the panels of the row-invariant CPU kernel
(faser_kernels.cpu_linear): row i of a call has the bits of a one-row call however many rows share
it, which is what makes a (k + 1)-position verification agree with k + 1 plain decodes bit for bit,
and the kernel streams each weight once per call, so verification costs about one decode.
"dense": torch's own linear (CUDA, or a CPU without the kernel's instructions), whose GEMMs
choose their blocking by the row count and so are not row-invariant. "auto" picks "packed" where
it runs.

A float32 model dequantized from a GGUF file (as the embedded default is: Q4_1 layers, a Q8_0
embedding) keeps each linear weight that GGUF's Q4_1 or Q8_0 holds exactly in those blocks
(cpu_linear.pack_blocks): 0.75 or 1.125 bytes a weight instead of 4, dequantized in the kernel
to the same float32 weights, so the same bits out. A bf16 model loaded from such a checkpoint
keeps them too where the loader kept the float32 values beside each bf16 layer
(faser.models.loader.CHECKPOINT_FLOAT32; the engine asks for them with packed weights), instead
of 2 bytes: the kernel rounds each weight to bf16 as it dequantizes it, as the load did.

A draft's packed weights may be quantized (`DRAFT_WEIGHTS`): a draft step streams its weights
from memory after the target's have flushed the caches, and int8 (bf16 engines) halves those
bytes, Q8_0 blocks (float32 engines) cut them to 0.28x; the target stays in its dtype, so what
the engine outputs does not change, only how often drafts are accepted.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from faser.models.loader import CHECKPOINT_FLOAT32
from faser_kernels import cpu_linear, huge_pages

WEIGHT_FORMATS = ("auto", "dense", "packed")
# "same": the target's layout and dtype; "int8": packed int8 (bf16 engines on the CPU kernel);
# "q8_0": GGUF's Q8_0 blocks (float32 engines on the CPU kernel); "auto": whichever runs
DRAFT_WEIGHTS = ("auto", "same", "int8", "q8_0")
# the packed dtype each quantized draft format takes
DRAFT_DTYPES = {"int8": "bfloat16", "q8_0": "float32"}


class RowInvariantLinear(nn.Module):
    """A linear layer through cpu_linear's kernel. The weight is kept only in its panels (or
    GGUF's blocks), except a head tied to the embedding, whose rows the embedding still reads."""

    def __init__(self, linear: nn.Linear, quantized: str = "same") -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        if quantized == "q8_0" and weight.shape[1] % cpu_linear.BLOCK == 0:  # else the panels
            self.packed = cpu_linear.quantize_q8_0(weight)
        elif quantized == "int8":
            self.packed = cpu_linear.pack_weight(weight, int8=True)
        else:
            blocks = cpu_linear.pack_blocks(_checkpoint_weight(linear), weight.dtype)
            self.packed = blocks if blocks is not None else cpu_linear.pack_weight(weight)
        bias = linear.bias
        self.register_buffer(
            "bias", None if bias is None else bias.detach().float().contiguous(), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        return cpu_linear.linear(x, self.packed, self.bias)


def _checkpoint_weight(linear: nn.Linear) -> torch.Tensor:
    """The float32 values a bf16 layer was rounded from, where the loader kept them
    (faser.models.loader.CHECKPOINT_FLOAT32), else its own weight."""
    weight = linear.weight.detach()
    kept = getattr(linear, CHECKPOINT_FLOAT32, None)
    if kept is None or weight.dtype != torch.bfloat16 or not torch.equal(kept.bfloat16(), weight):
        return weight
    return kept


def resolve_weight_format(weight_format: str, device: str, dtype: str) -> str:
    """The layout "auto" stands for: "packed" where the kernel runs for the dtype, else "dense"."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if weight_format != "auto":
        return weight_format
    return "packed" if packed_reason(device, dtype) is None else "dense"


def packed_reason(device: str, dtype: str) -> str | None:
    """None where the "packed" layout runs; else why it cannot."""
    if device != "cpu":
        return f"the row-invariant kernel is for CPUs, not {device}"
    return cpu_linear.unavailable_reason(getattr(torch, dtype))


def resolve_draft_weights(draft_weights: str, weight_format: str, dtype: str) -> str:
    """What "auto" stands for: the quantized format packed weights of the dtype take ("int8"
    for bf16, "q8_0" for float32), else "same"."""
    if draft_weights not in DRAFT_WEIGHTS:
        raise ValueError(f"draft_weights must be one of {DRAFT_WEIGHTS}, got {draft_weights!r}")
    runs = None  # the quantized format that runs here
    if weight_format == "packed":
        runs = next((f for f, d in DRAFT_DTYPES.items() if d == dtype), None)
    if draft_weights in DRAFT_DTYPES and draft_weights != runs:
        raise ValueError(f"draft_weights {draft_weights!r} needs packed "
                         f"{DRAFT_DTYPES[draft_weights]} weights, got weight_format "
                         f"{weight_format!r} and dtype {dtype!r}")
    if draft_weights == "auto":
        return runs or "same"
    return draft_weights


def pack_weights(
    model: nn.Module, weight_format: str, device: str, quantized: str = "same"
) -> nn.Module:
    """Repacks the decoder layers' projections and the model's own linear layers (the head, a
    feature draft's fusions) in place; `quantized`: a draft's DRAFT_WEIGHTS, resolved."""
    if weight_format not in WEIGHT_FORMATS or weight_format == "auto":
        raise ValueError(f"weight_format must be 'dense' or 'packed', got {weight_format!r}")
    if weight_format == "dense":
        return model
    dtype = next(model.parameters()).dtype
    if (reason := packed_reason(device, str(dtype).removeprefix("torch."))) is not None:
        raise ValueError(f"weight_format 'packed' cannot run here: {reason}")
    for parent, name, child in decoder_projections(model):
        setattr(parent, name, RowInvariantLinear(child, quantized))
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, RowInvariantLinear(child, quantized))
    _into_huge_pages([m for m in model.modules() if isinstance(m, RowInvariantLinear)])
    return model


def _into_huge_pages(linears: list[RowInvariantLinear]) -> None:
    """Every panel of the model in one buffer of huge pages (faser_kernels.huge_pages)."""
    moved = huge_pages.into_huge_pages([m.packed.data for m in linears])
    for m, data in zip(linears, moved, strict=True):
        m.packed = dataclasses.replace(m.packed, data=data)


def decoder_projections(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) of every linear projection of the decoder layers."""
    return [
        (parent, name, child)
        for layer in model.layers
        for parent in (layer.self_attn, layer.mlp)
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
