"""The row-invariant CPU linear kernel against its PyTorch twin, and its defining property: row i
of an m-row call has the bits of the one-row call, for every m and the model shapes."""

from __future__ import annotations

import pytest
import torch

from faser_kernels import cpu_build, cpu_linear

DTYPES = [torch.float32, torch.bfloat16]
# (out, in): ragged panels and k tails, and SmolLM2-135M's projections and a slice of its head
SHAPES = [(1, 2), (33, 18), (70, 64), (960, 576), (576, 1536), (3072, 576), (4096, 576)]


def _runnable(dtype: torch.dtype) -> torch.dtype:
    if (reason := cpu_linear.unavailable_reason(dtype)) is not None:
        pytest.skip(reason)
    return dtype


@pytest.fixture(params=DTYPES, ids=str)
def dtype(request) -> torch.dtype:
    return _runnable(request.param)


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
    x = torch.randn(300, k).to(dtype)
    alone = torch.cat([cpu_linear.linear(x[i : i + 1], packed) for i in range(300)])
    # on AMX, past 64 rows another tile kernel, past 256 a block of rows at a time, and the
    # rows after the last whole tile from a padded copy
    for m in (2, 3, 5, 12, 13, 16, 17, 25, 40, 70, 300):
        assert torch.equal(cpu_linear.linear(x[:m], packed), alone[:m]), m


def test_bf16_takes_the_amx_tiles_where_the_cpu_has_them(bf16):
    """So that on such a CPU the tests above check the tile path's rows."""
    assert cpu_linear.uses_amx() == ("amx_bf16" in cpu_build.cpu_flags())


def test_a_mismatched_input_is_named(dtype):
    packed = cpu_linear.pack_weight(torch.randn(8, 16).to(dtype))
    with pytest.raises(ValueError, match="in-features"):
        cpu_linear.linear(torch.randn(2, 12).to(dtype), packed)


def test_an_empty_batch_gives_an_empty_output(dtype):
    packed = cpu_linear.pack_weight(torch.randn(8, 16).to(dtype))
    assert cpu_linear.linear(torch.empty(0, 16, dtype=dtype), packed).shape == (0, 8)


# -- int8 weights (a draft's) -------------------------------------------------------------------


@pytest.fixture
def bf16() -> torch.dtype:
    return _runnable(torch.bfloat16)


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_an_int8_weight_equals_its_twin_to_rounding(bf16, n, k, bias):
    torch.manual_seed(n + k)
    weight = (torch.randn(n, k) / k**0.5).to(bf16)
    b = torch.randn(n) if bias else None
    x = torch.randn(13, k).to(bf16)
    packed = cpu_linear.pack_weight(weight, int8=True)
    q, scale = cpu_linear.quantize_int8(weight)
    out = cpu_linear.linear(x, packed, b)
    assert out.dtype == bf16 and out.shape == (13, n) and packed.data.dtype == torch.int8
    twin = cpu_linear.linear_torch(x, q, b, scale)
    torch.testing.assert_close(out.float(), twin.float(), rtol=1.6e-2, atol=1.6e-2)


def test_int8_keeps_a_weight_to_half_a_step_per_output(bf16):
    weight = torch.randn(64, 96).to(bf16)
    q, scale = cpu_linear.quantize_int8(weight)
    error = (q.float() * scale[:, None] - weight.float()).abs()
    assert (error <= scale[:, None] / 2 + 1e-7).all()
    assert q.abs().amax(dim=1).eq(127).all()  # each output's largest weight spans the range


@pytest.mark.parametrize(("n", "k"), SHAPES[2:5])
def test_every_row_of_an_int8_call_has_the_bits_of_a_one_row_call(bf16, n, k):
    torch.manual_seed(k)
    packed = cpu_linear.pack_weight(torch.randn(n, k).to(bf16), int8=True)
    x = torch.randn(17, k).to(bf16)
    alone = torch.cat([cpu_linear.linear(x[i : i + 1], packed) for i in range(17)])
    for m in (2, 5, 12, 13, 17):
        assert torch.equal(cpu_linear.linear(x[:m], packed), alone[:m]), m


def test_int8_packs_only_a_bf16_weight():
    with pytest.raises(ValueError, match="int8 weights take bf16"):
        cpu_linear.pack_weight(torch.randn(8, 16), int8=True)
