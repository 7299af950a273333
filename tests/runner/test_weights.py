"""Weight layouts: "packed" gives torch's products to rounding and the same bits for a row
however many rows share the call; "auto" picks it only where its kernel runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from faser.runner.weights import (
    RowInvariantLinear,
    pack_weights,
    packed_reason,
    resolve_weight_format,
)

DTYPES = ["float32", "bfloat16"]


def needs_packed(dtype: str):
    reason = packed_reason("cpu", dtype)
    return pytest.mark.skipif(reason is not None, reason=f"no packed layout: {reason}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_packing_replaces_every_projection_the_head_and_the_models_own_linears(dtype):
    if (reason := packed_reason("cpu", dtype)) is not None:
        pytest.skip(reason)
    model = _TinyModel(bias=True).to(getattr(torch, dtype))
    x = torch.randn(7, 16, dtype=model.embed_tokens.weight.dtype)
    expected = model.layers[0].self_attn.qkv_proj(x).float()
    pack_weights(model, "packed", "cpu")
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, RowInvariantLinear) and isinstance(model.lm_head, RowInvariantLinear)
    assert isinstance(model.fc, RowInvariantLinear)  # a feature draft's input fusion
    assert model.lm_head.out_features == 50
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(qkv(x).float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    ("requested", "device", "dtype", "expected"),
    [
        ("auto", "cuda", "float32", "dense"),
        ("auto", "cuda", "bfloat16", "dense"),
        ("dense", "cpu", "float32", "dense"),
        ("packed", "cpu", "bfloat16", "packed"),
    ],
)
def test_explicit_layouts_stay_and_auto_is_dense_off_the_cpu(requested, device, dtype, expected):
    assert resolve_weight_format(requested, device, dtype) == expected


@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_is_packed_exactly_where_the_kernel_runs(dtype):
    expected = "packed" if packed_reason("cpu", dtype) is None else "dense"
    assert resolve_weight_format("auto", "cpu", dtype) == expected


def test_the_half_precision_kernel_does_not_exist():
    assert packed_reason("cpu", "float16") is not None
    assert packed_reason("cuda", "float32") is not None


def test_pack_weights_wants_a_decided_layout():
    with pytest.raises(ValueError, match="auto"):
        pack_weights(_TinyModel(bias=False), "auto", "cpu")


def test_an_unknown_format_is_named():
    with pytest.raises(ValueError, match="'tuned'"):
        resolve_weight_format("tuned", "cpu", "float32")


class _Attention(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(16, 48, bias=bias)
        self.o_proj = nn.Linear(16, 16, bias=False)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(16, 64, bias=False)
        self.down_proj = nn.Linear(32, 16, bias=False)


class _Layer(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.self_attn = _Attention(bias)
        self.mlp = _Mlp()


class _TinyModel(nn.Module):
    """The attribute layout of faser.models.llama (and a feature draft's `fc`) that pack_weights
    walks."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 16)
        self.fc = nn.Linear(32, 16, bias=False)
        self.layers = nn.ModuleList([_Layer(bias)])
        self.lm_head = nn.Linear(16, 50, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
