"""Rotary position embedding with the checkpoint's theta and scaling.

The inverse frequencies come from transformers' own rope functions so that every scaling type it
knows for a static context (default, linear, llama3, yarn) matches the oracle exactly. One table is
shared by all layers and indexed once per forward."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from faser_kernels import cpu_ops

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is unsupported (have {STATIC_ROPE_TYPES})")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
        head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim
        return 1.0 / (theta**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, max_position: int) -> None:
        super().__init__()
        self.hf_config, self.max_position = hf_config, max_position
        half = rope_inv_freq(hf_config)[0].numel()
        self.register_buffer("cos", torch.empty(max_position, half), persistent=False)
        self.register_buffer("sin", torch.empty(max_position, half), persistent=False)
        if not self.cos.is_meta:
            self.reset_tables()

    def _apply(self, fn, recurse=True):
        """The tables stay float32 when the model moves to another dtype: the rotation is
        computed in float32 and rounded once."""
        super()._apply(fn, recurse)
        self.cos, self.sin = self.cos.float(), self.sin.float()
        return self

    @torch.no_grad()
    def reset_tables(self) -> None:
        """(Re)computes the tables: after a model was built on the meta device and materialised."""
        inv_freq, scaling = rope_inv_freq(self.hf_config)
        t = torch.arange(self.max_position, dtype=torch.float, device="cpu")
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        self.cos.copy_(freqs.cos() * scaling)
        self.sin.copy_(freqs.sin() * scaling)

    def forward(self, positions: torch.Tensor) -> Rope:  # positions: [num_tokens] int64
        return Rope(positions, self.cos, self.sin)


@dataclass(frozen=True)
class Rope:
    """The positions of a forward's tokens and the tables they index, shared by all layers."""

    positions: torch.Tensor  # [num_tokens] int64
    cos: torch.Tensor  # [max_position, head_dim / 2] float32
    sin: torch.Tensor

    @functools.cached_property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_tokens, 1, head_dim / 2]
        """Each token's cos and sin, gathered once per forward for the PyTorch path."""
        return self.cos[self.positions].unsqueeze(1), self.sin[self.positions].unsqueeze(1)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim], each row's heads contiguous
    rope: Rope,
) -> torch.Tensor:  # x, rotated in place
    if cpu_ops.runs_on(x):
        return cpu_ops.rotary_(x, rope.positions, rope.cos, rope.sin)
    return cpu_ops.rotate_half_(x, *rope.rows)
