"""The decoder layers in one C call per forward (faser_kernels.cpu_decoder) give the same bits as
the layer-by-layer path, its twin: the same greedy tokens in bf16 and float32, plain and
speculative, and the same features for a feature draft (whose target stops at its feature
layers)."""

from __future__ import annotations

import pytest
import torch

from faser import LLM, SamplingParams, SpecConfig
from faser.runner.batch import Chunk
from faser_kernels.cpu_decoder import unavailable_reason
from tests.engine.test_feature_draft import feature_pair  # noqa: F401  (a fixture)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 50)), [60] * 17]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _outputs(target, draft, policy: str, dtype: str, fused: bool) -> list[list[int]]:
    llm = LLM(str(target), draft_model=str(draft), spec=SpecConfig(policy=policy), dtype=dtype,
              num_kv_blocks=128, block_size=4)
    model = llm.engine.pair.target
    assert (model.fused_layers is not None) == (llm.engine.target.unfused_reason is None)
    if model.fused_layers is None:
        pytest.skip(f"the layers do not fuse here: {llm.engine.target.unfused_reason}")
    if not fused:
        model.fused_layers = None  # layer by layer: the twin
    return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("policy", ["off", "fixed:3"])
def test_fused_layers_give_the_layer_by_layer_tokens(tiny_models, dtype, policy):
    if (reason := unavailable_reason(getattr(torch, dtype))) is not None:
        pytest.skip(reason)
    pair = (tiny_models["gqa_tied"], tiny_models["gqa_tied_draft"])
    assert _outputs(*pair, policy, dtype, True) == _outputs(*pair, policy, dtype, False)


def test_a_feature_drafts_target_fuses_between_its_feature_layers(feature_pair):  # noqa: F811
    if (reason := unavailable_reason(torch.float32)) is not None:
        pytest.skip(reason)
    fused = _outputs(*feature_pair, "fixed:3", "float32", True)
    assert fused == _outputs(*feature_pair, "fixed:3", "float32", False)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_forward_without_features_gives_the_same_logits(feature_pair, dtype):  # noqa: F811
    """A step in which no request keeps features runs the target without stopping at its
    feature layers: the same bits, as the plain target's step."""
    if (reason := unavailable_reason(getattr(torch, dtype))) is not None:
        pytest.skip(reason)
    target, draft = feature_pair
    llm = LLM(str(target), draft_model=str(draft), num_kv_blocks=64, block_size=4, dtype=dtype)
    engine, runner = llm.engine, llm.engine.target
    assert runner.feature_layers
    logits = {}
    for features in (True, False):
        table: list[int] = []
        engine.blocks.allocate(f"r{features}", table, 48)
        prefill = runner.forward_hidden([Chunk(list(range(1, 41)), 0, table, 3)], features)
        decode, rows = runner.forward_hidden([Chunk([5, 6, 7], 40, table, 3)], features)
        logits[features] = (prefill[0], decode)
        hidden = runner.model.config.hidden_size
        assert rows.shape[-1] == hidden * (len(runner.feature_layers) if features else 1)
    assert all(torch.equal(a, b) for a, b in zip(logits[True], logits[False], strict=True))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_one_call_takes_the_layer_by_layer_features(feature_pair, dtype):  # noqa: F811
    """The feature rows taken inside the one C call, and its final norm, have the bits of the
    layer-by-layer path's, prefill and decode."""
    if (reason := unavailable_reason(getattr(torch, dtype))) is not None:
        pytest.skip(reason)
    target, draft = feature_pair
    llm = LLM(str(target), draft_model=str(draft), num_kv_blocks=64, block_size=4, dtype=dtype)
    engine, runner, model = llm.engine, llm.engine.target, llm.engine.pair.target
    assert any(0 < i < len(model.layers) for i in runner.feature_layers)  # a tap inside the call
    fused, outputs = model.fused_layers, {}
    for one_call in (True, False):
        model.fused_layers = fused if one_call else None
        table: list[int] = []
        engine.blocks.allocate(f"r{one_call}", table, 48)
        prefill = runner.forward_hidden([Chunk(list(range(1, 41)), 0, table, 3)])
        decode = runner.forward_hidden([Chunk([5, 6, 7], 40, table, 3)])
        outputs[one_call] = (*prefill, *decode)
    assert all(torch.equal(a, b) for a, b in zip(outputs[True], outputs[False], strict=True))
