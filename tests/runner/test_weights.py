"""Weight layouts: the same values in another layout give the same outputs, for every row count
(the "mkl" layout pads a batch up to the row count its weights were packed for)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from faser.runner.weights import (
    MKL_ROW_BUCKETS,
    MKLPackedLinear,
    cgroup_headroom,
    pack_weights,
    resolve_weight_format,
)

needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL")


@needs_mkl
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 16, 31, 32, 33])
def test_mkl_packed_linear_equals_the_dense_product(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(64, 40, bias=False)
    packed = MKLPackedLinear(linear)
    x = torch.randn(rows, 64)
    out = packed(x)
    assert out.shape == (rows, 40)
    torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)


@needs_mkl
def test_padding_rows_do_not_change_the_real_rows():
    torch.manual_seed(0)
    packed = MKLPackedLinear(nn.Linear(32, 16, bias=False))
    x = torch.randn(5, 32)  # padded to 8
    padded = torch.cat([x, torch.randn(3, 32)])  # the same 8 rows with other padding
    assert torch.equal(packed(x), packed(padded)[:5])


@needs_mkl
def test_mkl_keeps_a_tied_head_tied_and_leaves_biased_projections_dense():
    model = _TinyModel(bias=True)
    embed = model.embed_tokens.weight
    pack_weights(model, "mkl", "cpu")
    assert isinstance(model.lm_head, MKLPackedLinear)
    assert model.lm_head.weight is embed  # no copy of the tied embedding
    assert isinstance(model.layers[0].self_attn.qkv_proj, nn.Linear)  # has a bias
    assert isinstance(model.layers[0].mlp.down_proj, MKLPackedLinear)
    assert model.lm_head.buckets == MKL_ROW_BUCKETS


@pytest.mark.parametrize(
    ("requested", "device", "dtype", "expected"),
    [
        ("auto", "cpu", "float32", "tuned" if torch.backends.mkl.is_available() else "dense"),
        ("auto", "cpu", "bfloat16", "dense"),
        ("auto", "cuda", "float32", "dense"),
        ("dense", "cpu", "float32", "dense"),
        ("mkldnn", "cpu", "float32", "mkldnn"),
    ],
)
def test_auto_picks_tuned_only_for_float32_on_a_cpu(requested, device, dtype, expected):
    assert resolve_weight_format(requested, device, dtype) == expected


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_containers_memory_limit_bounds_the_free_memory(tmp_path, version):
    folder = tmp_path if version == "v2" else tmp_path / "memory"
    folder.mkdir(exist_ok=True)
    limit, usage = ("memory.max", "memory.current") if version == "v2" else (
        "memory.limit_in_bytes", "memory.usage_in_bytes")
    (folder / limit).write_text(f"{8 * 2**30}\n")
    (folder / usage).write_text(f"{3 * 2**30}\n")
    assert cgroup_headroom(tmp_path) == 5 * 2**30
    (folder / limit).write_text("max\n" if version == "v2" else f"{2**63 - 4096}\n")
    assert cgroup_headroom(tmp_path) is None
    assert cgroup_headroom(tmp_path / "absent") is None


def test_pack_weights_wants_a_decided_layout():
    with pytest.raises(ValueError, match="auto"):
        pack_weights(_TinyModel(bias=False), "auto", "cpu")


def test_an_unknown_format_is_named():
    with pytest.raises(ValueError, match="'packed'"):
        resolve_weight_format("packed", "cpu", "float32")


def test_mkl_refuses_half_precision_weights():
    model = _TinyModel(bias=False).to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        pack_weights(model, "mkl", "cpu")


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
    """The attribute layout of faser.models.llama that pack_weights walks."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 16)
        self.layers = nn.ModuleList([_Layer(bias)])
        self.lm_head = nn.Linear(16, 50, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
