"""The distilled draft's format: written by faser.distill, read by the engine's loader with the
target's embedding lent to it; and the committed default draft with the default target."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from faser.distill.model import build_draft, export_draft
from faser.engine.model_pair import check_vocab
from faser.models.loader import load_model, load_token_map
from faser.runner.batch import Chunk
from faser.runner.model_runner import ModelRunner
from tests.models.conftest import DRAFT_TEST_VOCAB as VOCAB


def _engine_logits(model, token_ids: list[int]) -> torch.Tensor:  # [seq, out_vocab]
    runner = ModelRunner(model, num_blocks=8, block_size=16, device="cpu")
    return runner.forward([Chunk(token_ids, 0, [0, 1], num_logits=len(token_ids))])


def test_round_trip_gives_the_same_logits(tiny_target, tmp_path: Path) -> None:
    target, target_dir = tiny_target
    token_map = torch.arange(1, VOCAB, 3)  # a reduced output vocabulary
    draft = build_draft(target, [0, 2], token_map).eval()
    with torch.no_grad():  # the draft must differ from the target's layers to tell them apart
        draft.body.layers[0].mlp.down_proj.weight.mul_(1.5)
    export_draft(draft, token_map, tmp_path / "draft", {"test": True}, dtype=torch.float32)

    engine_target = load_model(target_dir, "cpu", "float32", 64)
    engine_draft = load_model(tmp_path / "draft", "cpu", "float32", 64, engine_target.embed_tokens)
    loaded_map = load_token_map(tmp_path / "draft")
    check_vocab(engine_target, engine_draft, loaded_map)

    ids = [5, 17, 3, 96, 40, 40, 2, 61, 8]
    with torch.no_grad():
        want = draft(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
    assert torch.equal(loaded_map, token_map)
    assert engine_draft.embed_tokens is engine_target.embed_tokens
    torch.testing.assert_close(_engine_logits(engine_draft, ids), want, atol=1e-4, rtol=1e-4)


def test_export_stores_half_precision_and_no_embedding(tiny_target, tmp_path: Path) -> None:
    from safetensors import safe_open

    target, _ = tiny_target
    export_draft(build_draft(target, [0], torch.arange(10)), torch.arange(10), tmp_path, {})
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("lm_head.weight").dtype == torch.float16
    assert not any("embed_tokens" in n for n in names)
    assert "lm_head.weight" in names and "model.norm.weight" in names


def test_a_draft_without_its_target_is_refused(tiny_target, tmp_path: Path) -> None:
    target, _ = tiny_target
    export_draft(build_draft(target, [0], torch.arange(10)), torch.arange(10), tmp_path, {})
    with pytest.raises(ValueError, match="faser_tie_embedding_to_target"):
        load_model(tmp_path, "cpu", "float32", 64)


def test_check_vocab_rejects_a_token_map_of_the_wrong_size(tiny_target, tmp_path: Path) -> None:
    target, target_dir = tiny_target
    export_draft(build_draft(target, [0], torch.arange(10)), torch.arange(10), tmp_path, {})
    engine_target = load_model(target_dir, "cpu", "float32", 64)
    engine_draft = load_model(tmp_path, "cpu", "float32", 64, engine_target.embed_tokens)
    with pytest.raises(ValueError, match="token map"):
        check_vocab(engine_target, engine_draft, torch.arange(11))
    with pytest.raises(ValueError, match="draft_token_map"):
        check_vocab(engine_target, engine_draft, None)


@pytest.mark.model
def test_committed_draft_keeps_the_default_targets_greedy_output() -> None:
    from faser import LLM, SamplingParams, SpecConfig
    from faser.models.resolver import ModelFetchError, resolve_model

    try:
        resolve_model(None)
    except ModelFetchError as exc:
        pytest.skip(f"the SmolLM2 wheel cannot be had here: {exc}")
    assert (resolve_model(None, kind="draft") / "model.safetensors").is_file()
    pair = LLM(spec=SpecConfig(policy="fixed:4"), num_threads=1)  # no arguments: the default pair
    plain = LLM("smollm2-135m-instruct", num_threads=1)
    texts = ("What is the capital of France?", "Write a haiku about autumn.")
    prompts = [
        plain.tokenizer.encode(
            plain.tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for t in texts
    ]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    fast, slow = pair.generate(prompts, params), plain.generate(prompts, params)

    assert [o.token_ids for o in fast] == [o.token_ids for o in slow]
    assert sum(o.spec_stats.num_draft_tokens for o in fast) > 0
