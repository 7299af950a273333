"""Float32 weights held in 4-bit blocks (cpu_linear_q4.c): a weight dequantized from GGUF's Q4_1 by
the gguf package packs in a sixth of the float32 panels' bytes and gives their bits, for every row
count; any other weight keeps the float32 panels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from faser_kernels import cpu_linear

# (out, in): a ragged panel, one block, SmolLM2-135M's qkv, gate/up and down projections
SHAPES = [(33, 64), (70, 32), (960, 576), (3072, 576), (576, 1536)]


@pytest.fixture(autouse=True)
def _runnable():
    if (reason := cpu_linear.unavailable_reason(torch.float32)) is not None:
        pytest.skip(reason)


def gguf_weight(n: int, k: int, qtype=GGMLQuantizationType.Q4_1, seed: int = 0) -> torch.Tensor:
    """A [n, k] float32 weight as a GGUF file of that type holds it, dequantized by gguf."""
    rng = np.random.default_rng(seed)
    weight = (0.05 * rng.standard_normal((n, k))).astype(np.float32)
    return torch.from_numpy(dequantize(quantize(weight, qtype), qtype).astype(np.float32))


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_a_q4_1_weight_gives_the_float32_panels_bits(n, k):
    weight = gguf_weight(n, k)
    blocks, panels = cpu_linear.pack_q4(weight), cpu_linear.pack_weight(weight)
    assert blocks is not None and blocks.dtype == torch.float32
    assert blocks.data.numel() * 5 < panels.data.numel() * 4  # bytes: under a fifth
    torch.manual_seed(k)
    bias, x = torch.randn(n), torch.randn(100, k)
    for m in (1, 2, 3, 4, 5, 13, 48, 49, 100):  # 48 rows' accumulators per thread, then more
        got = cpu_linear.linear(x[:m], blocks, bias)
        assert torch.equal(got, cpu_linear.linear(x[:m], panels, bias)), m


def test_every_row_of_a_q4_call_has_the_bits_of_a_one_row_call_float32():
    blocks = cpu_linear.pack_q4(gguf_weight(960, 576))
    x = torch.randn(20, 576)
    alone = torch.cat([cpu_linear.linear(x[i : i + 1], blocks) for i in range(20)])
    for m in (2, 3, 5, 16, 20):
        assert torch.equal(cpu_linear.linear(x[:m], blocks), alone[:m]), m


def test_blocks_give_back_each_weight_bit_for_bit_float32():
    weight = gguf_weight(64, 96)
    weight[5, 32:64] = 0.25  # a constant block: d is 0
    q, d, m = cpu_linear.q4_blocks(weight)
    rebuilt = (q.float() * d[..., None] + m[..., None]).reshape(weight.shape)
    assert torch.equal(rebuilt.view(torch.int32), weight.view(torch.int32))
    assert int(q.max()) <= 15


@pytest.mark.parametrize("case", ["random", "q8_0", "k not a block multiple", "bfloat16"])
def test_other_weights_keep_the_float32_panels(case):
    weight = {
        "random": lambda: torch.randn(64, 64),
        "q8_0": lambda: gguf_weight(64, 64, GGMLQuantizationType.Q8_0),  # 255 levels a block
        "k not a block multiple": lambda: gguf_weight(64, 64)[:, :48].contiguous(),
        "bfloat16": lambda: gguf_weight(64, 64).bfloat16(),
    }[case]()
    assert cpu_linear.pack_q4(weight) is None
