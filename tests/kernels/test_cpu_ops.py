"""The fused row ops of a decoder layer (cpu_ops.c) against their PyTorch twins, and the property
the engine relies on: a row gets the bits it gets alone, whatever else shares the call."""

from __future__ import annotations

import pytest
import torch

from faser_kernels import cpu_build, cpu_ops

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=DTYPES, ids=str)
def dtype(request) -> torch.dtype:
    if (reason := cpu_build.unavailable_reason("cpu_ops.c", request.param)) is not None:
        pytest.skip(reason)
    return request.param


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.float(), b.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("d", [16, 40, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_equals_its_twin(dtype, d, with_residual):
    torch.manual_seed(d)
    x, residual = torch.randn(9, d).to(dtype), torch.randn(9, d)
    weight = torch.rand(d).to(dtype) + 0.5
    residual = residual if with_residual else None
    out, summed = cpu_ops.add_rms_norm(x, residual, weight, 1e-5)
    twin_out, twin_summed = cpu_ops.add_rms_norm_torch(x, residual, weight, 1e-5)
    assert summed.dtype == torch.float32  # the residual stream, whatever the model's dtype
    assert torch.equal(summed, twin_summed)  # one float32 add either way
    _close(out, twin_out, dtype)


@pytest.mark.parametrize(("heads", "head_dim"), [(3, 16), (12, 64), (2, 40)])
def test_rotary_equals_its_twin_in_place_on_a_strided_view(dtype, heads, head_dim):
    torch.manual_seed(heads)
    qkv = torch.randn(7, (heads + 1) * head_dim).to(dtype)  # a trailing v head, left alone
    positions = torch.tensor([0, 5, 9, 100, 3, 3, 511])
    angles = torch.outer(torch.arange(512.0), 1 / 10000 ** (torch.arange(head_dim // 2) / 32))
    cos, sin = angles.cos(), angles.sin()
    twin = qkv.clone()
    cpu_ops.rotary_(qkv[:, : heads * head_dim].view(7, heads, head_dim), positions, cos, sin)
    cpu_ops.rotary_torch_(twin[:, : heads * head_dim].view(7, heads, head_dim), positions, cos,
                          sin)
    _close(qkv, twin, dtype)
    assert torch.equal(qkv[:, heads * head_dim :], twin[:, heads * head_dim :])


@pytest.mark.parametrize("inter", [16, 40, 1536])
def test_silu_mul_equals_its_twin(dtype, inter):
    gate_up = torch.randn(5, 2 * inter).to(dtype) * 4
    _close(cpu_ops.silu_mul(gate_up), cpu_ops.silu_mul_torch(gate_up), dtype)


def test_each_row_has_the_bits_of_a_one_row_call(dtype):
    torch.manual_seed(0)
    x, residual = torch.randn(17, 576).to(dtype), torch.randn(17, 576)
    weight = torch.rand(576).to(dtype)
    gate_up = torch.randn(17, 3072).to(dtype)
    out, _ = cpu_ops.add_rms_norm(x, residual, weight, 1e-5)
    act = cpu_ops.silu_mul(gate_up)
    for i in (0, 5, 16):
        assert torch.equal(cpu_ops.add_rms_norm(x[i : i + 1], residual[i : i + 1], weight,
                                                1e-5)[0], out[i : i + 1])
        assert torch.equal(cpu_ops.silu_mul(gate_up[i : i + 1]), act[i : i + 1])
