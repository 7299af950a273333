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


@pytest.fixture
def bf16_kernels() -> None:
    if (reason := cpu_build.unavailable_reason("cpu_ops.c", torch.bfloat16)) is not None:
        pytest.skip(reason)


def _head(rows: int, vocab: int = 1000, d: int = 72) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(rows)
    weight, hidden = torch.randn(vocab, d) * 0.1, torch.randn(rows, d)
    logits = (hidden.bfloat16() @ weight.bfloat16().T).bfloat16()
    logits[0, [3, 50, 700, 999]] = logits[0].max() + 1  # tied at the front
    logits[-1, [10, 20, 30, 40, 500, 600]] = logits[-1].max() + 1  # tied across the boundary
    return logits, hidden, weight


@pytest.mark.parametrize("num_top", [1, 4, 8])
def test_rescore_head_equals_its_twin_and_breaks_ties_by_the_lower_index(bf16_kernels, num_top):
    logits, hidden, weight = _head(6)
    out = cpu_ops.rescore_head(logits, hidden, weight, num_top)
    twin = cpu_ops.rescore_head_torch(logits, hidden, weight, num_top)
    assert torch.equal(out != logits.float(), twin != logits.float())  # the same candidates
    torch.testing.assert_close(out, twin, rtol=1e-6, atol=1e-6)  # summed in another order
    chosen = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices
    exact = (hidden @ weight.T).gather(1, chosen[:, :num_top])
    torch.testing.assert_close(out.gather(1, chosen[:, :num_top]), exact, rtol=1e-5, atol=1e-5)
    if num_top == 4:  # four of the six tied in the last row: 10, 20, 30 and 40
        assert (out[-1] != logits[-1].float()).nonzero().flatten().tolist() == [10, 20, 30, 40]


@pytest.mark.parametrize("n", [1, 15, 16, 17, 49152])
def test_argmax_rows_is_torchs_first_maximum(n):
    if (reason := cpu_build.unavailable_reason("cpu_ops.c", torch.float32)) is not None:
        pytest.skip(reason)
    torch.manual_seed(n)
    x = torch.randn(5, n)
    x[1] = 0.0  # all tied: index 0
    x[2, n // 2 :] = x[2].max() + 1  # tied from the middle on
    x[3, -1] = x[3].max() + 1  # the tail past the last full vector
    assert torch.equal(cpu_ops.argmax_rows(x), cpu_ops.argmax_rows_torch(x))


def test_head_ops_give_each_row_the_bits_of_a_one_row_call(bf16_kernels):
    logits, hidden, weight = _head(9)
    out = cpu_ops.rescore_head(logits, hidden, weight, 8)
    best = cpu_ops.argmax_rows(out)
    for i in (0, 4, 8):
        one = cpu_ops.rescore_head(logits[i : i + 1], hidden[i : i + 1], weight, 8)
        assert torch.equal(one, out[i : i + 1])
        assert torch.equal(cpu_ops.argmax_rows(one), best[i : i + 1])


def test_rescore_head_names_what_does_not_fit(bf16_kernels):
    logits, hidden, weight = _head(2)
    with pytest.raises(ValueError, match="weight"):
        cpu_ops.rescore_head(logits, hidden, weight[:, :8], 8)
    with pytest.raises(ValueError, match="float32 weight"):
        cpu_ops.rescore_head(logits, hidden, weight.bfloat16(), 8)
    with pytest.raises(ValueError, match="num_top 65"):
        cpu_ops.rescore_head(logits, hidden, weight, 65)
