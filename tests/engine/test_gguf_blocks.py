"""A model dequantized from a GGUF file (Q4_1 layers, a Q8_0 embedding, as the embedded default)
runs its linear layers from those blocks (faser.runner.weights, cpu_linear_blocks.c), in float32
and in bf16 (each weight rounded as it is dequantized): the same
tokens as from the dtype's panels, plain and speculative, in one C call per forward and layer by
layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from faser import LLM, SamplingParams, SpecConfig
from faser.models.gguf_convert import convert_gguf
from faser.models.loader import CHECKPOINT_FLOAT32
from faser_kernels import cpu_linear
from faser_kernels.cpu_decoder import unavailable_reason
from tests.engine.tiny import make_noisy_copy
from tests.models.conftest import write_tiny_gguf

PROMPTS = [[5, 6, 7, 8, 9], [12, 13], list(range(20, 60)), [40] * 17]
DTYPES = ["float32", "bfloat16"]
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


def _runs(dtype: str) -> None:
    if (reason := unavailable_reason(getattr(torch, dtype))) is not None:
        pytest.skip(reason)


def _tokens(pair, policy: str, dtype: str, fused: bool = True) -> list[list[int]]:
    llm = LLM(str(pair[0]), draft_model=str(pair[1]), spec=SpecConfig(policy=policy),
              dtype=dtype, num_kv_blocks=128, block_size=4)
    model = llm.engine.pair.target
    if not fused:
        model.fused_layers = None  # layer by layer
    return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_linear_layers_take_the_files_blocks(gguf_pair, dtype):
    _runs(dtype)
    llm = LLM(str(gguf_pair[0]), dtype=dtype, num_kv_blocks=64, block_size=4)
    model = llm.engine.pair.target
    for layer in model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                     layer.mlp.down_proj):
            assert proj.packed.blocks == "q4_1" and proj.packed.dtype == getattr(torch, dtype)
    assert model.lm_head.packed.blocks == "q8_0"  # tied to the embedding
    # the loader's float32 copies went with the layers they were kept for
    assert not any(hasattr(m, CHECKPOINT_FLOAT32) for m in model.modules())
    assert model.fused_layers is not None and bool((model.fused_layers.blocks == 1).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", ["off", "fixed:3"])
def test_blocks_give_the_dtypes_panels_tokens(gguf_pair, policy, dtype, monkeypatch):
    _runs(dtype)
    blocks = _tokens(gguf_pair, policy, dtype)
    assert blocks == _tokens(gguf_pair, policy, dtype, fused=False)
    monkeypatch.setattr(cpu_linear, "pack_blocks", lambda weight, dtype=None: None)
    assert blocks == _tokens(gguf_pair, policy, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_speculation_stays_lossless_over_blocks(gguf_pair, dtype):
    _runs(dtype)
    assert _tokens(gguf_pair, "fixed:3", dtype) == _tokens(gguf_pair, "off", dtype)
