"""A float32 model dequantized from GGUF's Q4_1 (as the embedded default is) runs its decoder
projections from 4-bit blocks (faser.runner.weights, cpu_linear_q4.c): the same tokens as from the
float32 panels, plain and speculative, in one C call per forward and layer by layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from faser import LLM, SamplingParams, SpecConfig
from faser.models.gguf_convert import convert_gguf
from faser_kernels import cpu_linear
from faser_kernels.cpu_decoder import unavailable_reason
from tests.engine.tiny import make_noisy_copy
from tests.models.conftest import write_tiny_gguf

PROMPTS = [[5, 6, 7, 8, 9], [12, 13], list(range(20, 60)), [40] * 17]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def q4_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama from a GGUF file (Q4_1 layers, Q8_0 embedding), and a draft that agrees with
    it only partly."""
    if (reason := unavailable_reason(torch.float32)) is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("q4")
    target = convert_gguf(write_tiny_gguf(root / "tiny.gguf"), root / "target")
    return target, make_noisy_copy(target, root / "draft", noise=0.12)


def _tokens(pair, policy: str, fused: bool = True) -> list[list[int]]:
    llm = LLM(str(pair[0]), draft_model=str(pair[1]), spec=SpecConfig(policy=policy),
              dtype="float32", num_kv_blocks=128, block_size=4)
    model = llm.engine.pair.target
    if not fused:
        model.fused_layers = None  # layer by layer
    return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


def test_the_projections_take_4_bit_blocks(q4_pair):
    llm = LLM(str(q4_pair[0]), dtype="float32", num_kv_blocks=64, block_size=4)
    model = llm.engine.pair.target
    for layer in model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                     layer.mlp.down_proj):
            assert proj.packed.data.dtype == torch.uint8
    assert model.fused_layers is not None and model.fused_layers.q4


@pytest.mark.parametrize("policy", ["off", "fixed:3"])
def test_blocks_give_the_float32_panels_tokens(q4_pair, policy, monkeypatch):
    blocks = _tokens(q4_pair, policy)
    assert blocks == _tokens(q4_pair, policy, fused=False)
    monkeypatch.setattr(cpu_linear, "pack_q4", lambda weight: None)
    assert blocks == _tokens(q4_pair, policy)


def test_speculation_stays_lossless_over_blocks(q4_pair):
    assert _tokens(q4_pair, "fixed:3") == _tokens(q4_pair, "off")
