"""A float32 model dequantized from a GGUF file (Q4_1 layers, a Q8_0 embedding, as the embedded
default) runs its linear layers from those blocks (faser.runner.weights, cpu_linear_blocks.c): the
same tokens as from the float32 panels, plain and speculative, in one C call per forward and
layer by layer."""

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
def gguf_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama from a GGUF file (Q4_1 layers, Q8_0 embedding), and a draft that agrees with
    it only partly."""
    if (reason := unavailable_reason(torch.float32)) is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("gguf")
    target = convert_gguf(write_tiny_gguf(root / "tiny.gguf"), root / "target")
    return target, make_noisy_copy(target, root / "draft", noise=0.12)


def _tokens(pair, policy: str, fused: bool = True) -> list[list[int]]:
    llm = LLM(str(pair[0]), draft_model=str(pair[1]), spec=SpecConfig(policy=policy),
              dtype="float32", num_kv_blocks=128, block_size=4)
    model = llm.engine.pair.target
    if not fused:
        model.fused_layers = None  # layer by layer
    return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


def test_the_linear_layers_take_the_files_blocks(gguf_pair):
    llm = LLM(str(gguf_pair[0]), dtype="float32", num_kv_blocks=64, block_size=4)
    model = llm.engine.pair.target
    for layer in model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                     layer.mlp.down_proj):
            assert proj.packed.blocks == "q4_1"
    assert model.lm_head.packed.blocks == "q8_0"  # tied to the embedding
    assert model.fused_layers is not None and bool((model.fused_layers.blocks == 1).all())


@pytest.mark.parametrize("policy", ["off", "fixed:3"])
def test_blocks_give_the_float32_panels_tokens(gguf_pair, policy, monkeypatch):
    blocks = _tokens(gguf_pair, policy)
    assert blocks == _tokens(gguf_pair, policy, fused=False)
    monkeypatch.setattr(cpu_linear, "pack_blocks", lambda weight: None)
    assert blocks == _tokens(gguf_pair, policy)


def test_speculation_stays_lossless_over_blocks(gguf_pair):
    assert _tokens(gguf_pair, "fixed:3") == _tokens(gguf_pair, "off")
