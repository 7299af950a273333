"""The decoder layers in one C call per forward (faser_kernels.cpu_decoder) give the same bits as
the layer-by-layer path, its twin: the same greedy tokens in bf16 and float32, plain and
speculative, and the same features for a feature draft (whose target stops at its feature
layers)."""

from __future__ import annotations

import pytest
import torch

from faser import LLM, SamplingParams, SpecConfig
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
