"""A draft's weights quantized (faser.runner.weights.DRAFT_WEIGHTS: int8 in bf16, GGUF's Q8_0
blocks in float32): chosen where they run, refused with a reason where they do not, the draft's
one C call (its input built in it) giving its torch path's bits, each model's panels in one
buffer of huge pages, and the engine's output still the target's own
(tests/engine/test_exactness.py runs every policy, whose draft is quantized by default)."""

from __future__ import annotations

import pytest
import torch

from faser import LLM, SamplingParams, SpecConfig
from faser.runner.batch import Chunk
from faser_kernels import huge_pages
from faser_kernels.cpu_decoder import unavailable_reason
from tests.engine.test_feature_draft import feature_pair  # noqa: F401  (a fixture)

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40))]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture
def bf16_kernels() -> None:
    if (reason := unavailable_reason(torch.bfloat16)) is not None:
        pytest.skip(reason)


@pytest.fixture
def float32_kernels() -> None:
    if (reason := unavailable_reason(torch.float32)) is not None:
        pytest.skip(reason)


def _llm(pair, dtype: str, draft_weights: str = "auto") -> LLM:
    target, draft = pair
    return LLM(str(target), draft_model=str(draft), spec=SpecConfig(policy="fixed:3"),
               dtype=dtype, num_kv_blocks=96, block_size=4, draft_weights=draft_weights)


def _weight_dtypes(model) -> set[torch.dtype]:
    return {m.packed.data.dtype for m in model.modules() if hasattr(m, "packed")}


def _blocks(model) -> set[str | None]:
    return {m.packed.blocks for m in model.modules() if hasattr(m, "packed")}


def test_auto_packs_a_bf16_draft_in_int8_and_leaves_the_target_alone(
    feature_pair, bf16_kernels  # noqa: F811
):
    pair = _llm(feature_pair, "bfloat16").engine.pair
    assert pair.draft_weights == "int8"
    assert _weight_dtypes(pair.draft) == {torch.int8}
    assert _weight_dtypes(pair.target) == {torch.bfloat16}
    same = _llm(feature_pair, "bfloat16", "same").engine.pair
    assert _weight_dtypes(same.draft) == {torch.bfloat16}


def test_auto_packs_a_float32_draft_in_q8_0_blocks_and_leaves_the_target_alone(
    feature_pair, float32_kernels  # noqa: F811
):
    pair = _llm(feature_pair, "float32").engine.pair
    assert pair.draft_weights == "q8_0"
    assert _blocks(pair.draft) == {"q8_0"}
    assert _blocks(pair.target) == {None}  # random weights: no GGUF file holds them
    assert _blocks(_llm(feature_pair, "float32", "same").engine.pair.draft) == {None}


def test_each_quantized_format_is_refused_for_the_other_dtype(feature_pair):  # noqa: F811
    with pytest.raises(ValueError, match="draft_weights 'int8' needs packed bfloat16"):
        _llm(feature_pair, "float32", "int8")
    with pytest.raises(ValueError, match="draft_weights 'q8_0' needs packed float32"):
        _llm(feature_pair, "bfloat16", "q8_0")


def test_an_unknown_draft_weights_is_named(feature_pair):  # noqa: F811
    with pytest.raises(ValueError, match="draft_weights must be one of"):
        _llm(feature_pair, "float32", "int4")


@pytest.mark.parametrize(("dtype", "draft_weights"),
                         [("bfloat16", "int8"), ("bfloat16", "same"), ("float32", "same"),
                          ("float32", "q8_0")])
def test_the_drafts_one_call_gives_its_torch_path_logits(
    feature_pair, dtype, draft_weights  # noqa: F811
):
    """The one C call builds the draft's input too (its prologue: the embedding beside the fused
    features, through fc), from the target's features and from its own guesses."""
    if (reason := unavailable_reason(getattr(torch, dtype))) is not None:
        pytest.skip(reason)
    llm = _llm(feature_pair, dtype, draft_weights)
    engine, runner = llm.engine, llm.engine.speculator.proposer.runner
    model = runner.model
    features = torch.randn(33, model.feature_dim).to(getattr(torch, dtype))
    guesses = torch.randn(2, model.config.hidden_size).to(getattr(torch, dtype))
    ids = torch.tensor([5, 6])
    assert model._prologue(ids, features[:2]) is not None
    assert model._prologue(ids, guesses) is not None
    logits = []
    for fused in (model.fused_layers, None):
        model.fused_layers = fused  # None: layer by layer, the twin
        table: list[int] = []
        engine.blocks.allocate(f"r{fused is None}", table, 40)  # 35 used
        prefill = runner.forward([Chunk(list(range(1, 31)), 0, table, 2, features[:30])])
        decode = runner.forward([Chunk([5, 6, 7], 30, table, 3, features[30:])])
        guessed = runner.forward([Chunk([8, 9], 33, table, 2, guesses)])
        logits.append((prefill, decode, guessed))
    assert all(torch.equal(a, b) for a, b in zip(*logits, strict=True))


@pytest.mark.parametrize(("dtype", "draft_weights"),
                         [("bfloat16", "int8"), ("float32", "q8_0")])
def test_a_quantized_draft_keeps_the_targets_output_and_is_still_accepted(
    feature_pair, dtype, draft_weights  # noqa: F811
):
    if (reason := unavailable_reason(getattr(torch, dtype))) is not None:
        pytest.skip(reason)
    plain = LLM(str(feature_pair[0]), dtype=dtype, num_kv_blocks=96, block_size=4)
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    llm = _llm(feature_pair, dtype, draft_weights)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert llm.engine.stats.num_accepted_tokens > 0


def test_each_models_packed_weights_share_one_buffer_of_huge_pages(
    feature_pair, bf16_kernels  # noqa: F811
):
    """faser_kernels.huge_pages: a decode step streams them all, and 4 KiB pages slow that."""
    if not huge_pages.available():
        pytest.skip("no MADV_HUGEPAGE here")
    pair = _llm(feature_pair, "bfloat16").engine.pair
    for model in (pair.target, pair.draft):
        packed = [m.packed.data for m in model.modules() if hasattr(m, "packed")]
        assert len({t.untyped_storage().data_ptr() for t in packed}) == 1
