"""The row-invariant CPU linear kernel against its PyTorch twin, and its defining property: row i
of an m-row call has the bits of the one-row call, for every m and the model shapes."""

from __future__ import annotations

import pytest
import torch

from faser_kernels import cpu_linear

DTYPES = [torch.float32, torch.bfloat16]
# (out, in): ragged panels and k tails, and SmolLM2-135M's projections and a slice of its head
SHAPES = [(1, 2), (33, 18), (70, 64), (960, 576), (576, 1536), (3072, 576), (4096, 576)]


@pytest.fixture(params=DTYPES, ids=str)
def dtype(request) -> torch.dtype:
    if (reason := cpu_linear.unavailable_reason(request.param)) is not None:
        pytest.skip(reason)
    return request.param


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_equals_its_twin_to_rounding(dtype, n, k, bias):
    torch.manual_seed(n + k)
    weight = torch.randn(n, k).to(dtype) / k**0.5
    b = torch.randn(n) if bias else None
    x = torch.randn(13, k).to(dtype)
    out = cpu_linear.linear(x, cpu_linear.pack_weight(weight), b)
    twin = cpu_linear.linear_torch(x, weight, b)
    assert out.dtype == dtype and out.shape == (13, n)
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.float(), twin.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_every_row_has_the_bits_of_a_one_row_call(dtype, n, k):
    torch.manual_seed(k)
    packed = cpu_linear.pack_weight(torch.randn(n, k).to(dtype))
    x = torch.randn(40, k).to(dtype)
    alone = torch.cat([cpu_linear.linear(x[i : i + 1], packed) for i in range(40)])
    for m in (2, 3, 5, 12, 13, 16, 17, 25, 40):
        assert torch.equal(cpu_linear.linear(x[:m], packed), alone[:m]), m


def test_a_mismatched_input_is_named(dtype):
    packed = cpu_linear.pack_weight(torch.randn(8, 16).to(dtype))
    with pytest.raises(ValueError, match="in-features"):
        cpu_linear.linear(torch.randn(2, 12).to(dtype), packed)


def test_an_empty_batch_gives_an_empty_output(dtype):
    packed = cpu_linear.pack_weight(torch.randn(8, 16).to(dtype))
    assert cpu_linear.linear(torch.empty(0, 16, dtype=dtype), packed).shape == (0, 8)
