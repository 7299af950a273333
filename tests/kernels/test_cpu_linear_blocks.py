"""Float32 weights held in GGUF's blocks (cpu_linear_blocks.c): a weight dequantized from Q4_1 or
Q8_0 by the gguf package packs in 0.75 or 1.125 bytes a weight against float32's 4, its twin
(unpack_blocks) gives back its bits, and the kernel gives the float32 panels' bits for every row
count; any other weight keeps the float32 panels. Multiplied as bf16 (cpu_linear.c), the blocks
give the bits of the bf16 panels of the weight rounded to bf16, on both of the AMX kernels' paths
(a few rows, and row blocks past 64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from faser_kernels import cpu_linear

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
FORMATS = {"q4_1": (Q4_1, 0.75), "q8_0": (Q8_0, 1.125)}  # name: (GGUF type, bytes a weight)
# (out, in): a ragged panel, one block, SmolLM2-135M's qkv, gate/up and down projections
SHAPES = [(33, 64), (70, 32), (960, 576), (3072, 576), (576, 1536)]


@pytest.fixture(autouse=True)
def _runnable():
    if (reason := cpu_linear.unavailable_reason(torch.float32)) is not None:
        pytest.skip(reason)


def gguf_weight(n: int, k: int, qtype: GGMLQuantizationType, seed: int = 0) -> torch.Tensor:
    """A [n, k] float32 weight as a GGUF file of that type holds it, dequantized by gguf."""
    rng = np.random.default_rng(seed)
    weight = (0.05 * rng.standard_normal((n, k))).astype(np.float32)
    return torch.from_numpy(dequantize(quantize(weight, qtype), qtype).astype(np.float32))


@pytest.mark.parametrize("blocks", sorted(FORMATS))
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_blocks_give_the_float32_panels_bits(blocks, n, k):
    qtype, size = FORMATS[blocks]
    weight = gguf_weight(n, k, qtype)
    packed, panels = cpu_linear.pack_blocks(weight), cpu_linear.pack_weight(weight)
    assert packed is not None and packed.blocks == blocks and packed.dtype == torch.float32
    padded = panels.data.numel()  # weights, the panels' zero columns included
    assert packed.data.numel() == padded * size  # bytes, against the panels' 4 a weight
    torch.manual_seed(k)
    bias, x = torch.randn(n), torch.randn(100, k)
    for m in (1, 2, 3, 4, 5, 13, 48, 49, 100):  # 48 rows' accumulators per thread, then more
        got = cpu_linear.linear(x[:m], packed, bias)
        assert torch.equal(got, cpu_linear.linear(x[:m], panels, bias)), (blocks, m)


@pytest.mark.parametrize("blocks", sorted(FORMATS))
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_blocks_in_bf16_give_the_rounded_weights_bf16_panels_bits(blocks, n, k):
    if (reason := cpu_linear.unavailable_reason(torch.bfloat16)) is not None:
        pytest.skip(reason)
    weight = gguf_weight(n, k, FORMATS[blocks][0])
    weight[0, :32] = 0.0  # a block of zeros
    packed = cpu_linear.pack_blocks(weight, torch.bfloat16)
    assert packed is not None and packed.blocks == blocks and packed.dtype == torch.bfloat16
    panels = cpu_linear.pack_weight(weight.bfloat16())
    torch.manual_seed(k)
    bias, x = torch.randn(n), torch.randn(300, k).bfloat16()
    for m in (1, 2, 3, 4, 5, 6, 16, 17, 40, 64, 70, 300):  # 40: a last row tile alone
        got = cpu_linear.linear(x[:m], packed, bias)
        assert torch.equal(got, cpu_linear.linear(x[:m], panels, bias)), (blocks, m)


@pytest.mark.parametrize("blocks", sorted(FORMATS))
def test_the_twin_gives_back_each_weight_bit_for_bit_float32(blocks):
    weight = gguf_weight(64, 96, FORMATS[blocks][0])
    weight[5, 32:64] = 0.25 if blocks == "q4_1" else 0.0  # a constant block: d is 0
    packed = cpu_linear.pack_blocks(weight)
    assert packed.blocks == blocks
    unpacked = cpu_linear.unpack_blocks(packed)
    assert torch.equal(unpacked.view(torch.int32), weight.view(torch.int32))


@pytest.mark.parametrize("blocks", sorted(FORMATS))
def test_every_row_of_a_blocks_call_has_the_bits_of_a_one_row_call_float32(blocks):
    packed = cpu_linear.pack_blocks(gguf_weight(960, 576, FORMATS[blocks][0]))
    x = torch.randn(20, 576)
    alone = torch.cat([cpu_linear.linear(x[i : i + 1], packed) for i in range(20)])
    for m in (2, 3, 5, 16, 20):
        assert torch.equal(cpu_linear.linear(x[:m], packed), alone[:m]), m


@pytest.mark.parametrize("case", ["random", "q5_0", "k not a block multiple", "bfloat16"])
def test_other_weights_keep_the_float32_panels(case):
    weight = {
        "random": lambda: torch.randn(64, 64),
        "q5_0": lambda: gguf_weight(64, 64, GGMLQuantizationType.Q5_0),  # d * (q - 16), 5 bits
        "k not a block multiple": lambda: gguf_weight(64, 64, Q4_1)[:, :48].contiguous(),
        "bfloat16": lambda: gguf_weight(64, 64, Q4_1).bfloat16(),
    }[case]()
    assert cpu_linear.pack_blocks(weight) is None


def test_any_float32_weight_rounds_into_q8_0_blocks_within_half_a_step():
    """A draft's weights (faser.runner.weights, draft_weights "q8_0"): held by no GGUF file, so
    rounded, each within half its block's step of the weight and no farther than GGUF's own Q8_0
    rounding; the kernel then gives the float32 panels' bits of the rounded weight."""
    weight = torch.from_numpy(
        (0.05 * np.random.default_rng(0).standard_normal((70, 96))).astype(np.float32))
    weight[3, :32] = 0.0  # a block of zeros: its step is 0
    by_gguf = dequantize(quantize(weight.numpy(), Q8_0), Q8_0).astype(np.float32)
    packed = cpu_linear.quantize_q8_0(weight)
    assert packed.blocks == "q8_0" and cpu_linear.pack_blocks(weight) is None
    rounded = cpu_linear.unpack_blocks(packed)
    step = (weight.reshape(-1, 32).abs().amax(dim=-1) / 127).to(torch.float16).float()
    error = (rounded - weight).abs().reshape(-1, 32)
    assert (error <= step[:, None] * 0.5 * (1 + 2**-10)).all()
    assert torch.equal(rounded[3, :32], torch.zeros(32))
    assert error.max() <= (torch.from_numpy(by_gguf) - weight).abs().max()
    x = torch.randn(5, 96)
    assert torch.equal(cpu_linear.linear(x, packed), cpu_linear.linear(
        x, cpu_linear.pack_weight(rounded)))


def test_q8_0_rounding_names_what_it_cannot_take():
    with pytest.raises(ValueError, match="Q8_0 takes a float32 weight of k a multiple of 32"):
        cpu_linear.quantize_q8_0(torch.randn(8, 40))
    with pytest.raises(ValueError, match="Q8_0 takes a float32 weight"):
        cpu_linear.quantize_q8_0(torch.randn(8, 64, dtype=torch.bfloat16))
