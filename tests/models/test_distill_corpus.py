"""Real text for distillation (faser.distill.corpus) and training resumed from a written draft
(faser.distill.warm_start)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from faser.distill.corpus import corpus_records
from faser.distill.feature_model import build_feature_draft, export_feature_draft
from faser.distill.model import build_draft, export_draft
from faser.distill.warm_start import load_weights, read_provenance, read_token_map
from tests.fixtures.tiny_models import build_tokenizer
from tests.models.conftest import DRAFT_TEST_VOCAB as VOCAB


def test_corpus_is_full_sequences_of_prose_and_code_and_reproducible() -> None:
    tokenizer = build_tokenizer()
    records = corpus_records(tokenizer, num_tokens=4096, width=256, seed=1)
    assert records == corpus_records(tokenizer, num_tokens=4096, width=256, seed=1)
    assert {r["category"] for r in records} == {"corpus:prose", "corpus:code"}
    for r in records:
        assert len(r["prompt_ids"]) == 1 and len(r["response_ids"]) == 255  # every token labelled
        assert r["sampled"]  # so never picked as held-out answers
    assert len(records) == 4096 // 256
    other_seed = corpus_records(tokenizer, num_tokens=4096, width=256, seed=2)
    assert [r["response_ids"] for r in other_seed] != [r["response_ids"] for r in records]


def test_no_corpus_asked_is_none_and_a_bad_width_is_refused() -> None:
    tokenizer = build_tokenizer()
    assert corpus_records(tokenizer, num_tokens=0) == []
    with pytest.raises(ValueError, match="width must be >= 2"):
        corpus_records(tokenizer, num_tokens=100, width=1)


def _perturbed(draft: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return draft


def _trainable(draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in draft.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("feature", [True, False], ids=["feature", "standalone"])
def test_warm_start_restores_the_written_draft(tiny_target, tmp_path: Path, feature) -> None:
    target, _ = tiny_target
    token_map = torch.arange(2, VOCAB, 3)

    def build():
        if feature:
            return build_feature_draft(target, (1, 3), [2], token_map)
        return build_draft(target, [0, 1], token_map)

    written = _perturbed(build())
    write = export_feature_draft if feature else export_draft
    write(written, token_map, tmp_path / "draft", {"run": 1}, torch.float32)

    resumed = build()
    assert not torch.equal(*[next(iter(_trainable(d).values())) for d in (resumed, written)])
    load_weights(resumed, tmp_path / "draft")
    want, got = _trainable(written), _trainable(resumed)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    assert torch.equal(read_token_map(tmp_path / "draft"), token_map)
    assert read_provenance(tmp_path / "draft") == {"run": 1}


def test_a_deeper_draft_starts_as_the_written_one(tiny_target, tmp_path: Path) -> None:
    """The extra layer of a draft grown from a written one starts as the identity: the same
    logits, in both training passes; training then moves its output projections."""
    target, _ = tiny_target
    token_map = torch.arange(VOCAB)
    written = _perturbed(build_feature_draft(target, (1, 3), [2], token_map))
    export_feature_draft(written, token_map, tmp_path / "draft", {}, torch.float32)
    deeper = build_feature_draft(target, (1, 3), [2, 1], token_map)
    load_weights(deeper, tmp_path / "draft")
    ids = torch.randint(0, VOCAB, (2, 7))
    width = target.config.hidden_size * 2
    inputs = (ids, torch.ones_like(ids), torch.randn(2, 7, width))
    torch.testing.assert_close(deeper(*inputs), written(*inputs), rtol=1e-5, atol=1e-5)
    grown = deeper.layers[1]
    assert not grown.self_attn.o_proj.weight.any() and not grown.mlp.down_proj.weight.any()
    deeper(*inputs).logsumexp(-1).mean().backward()
    assert grown.mlp.down_proj.weight.grad.abs().sum() > 0


def test_warm_start_refuses_a_draft_of_another_shape(tiny_target, tmp_path: Path) -> None:
    target, _ = tiny_target
    token_map = torch.arange(VOCAB)
    written = build_feature_draft(target, (1, 3), [2], token_map)
    export_feature_draft(written, token_map, tmp_path / "draft", {}, torch.float32)
    other_features = build_feature_draft(target, (1, 2, 3), [2], token_map)
    with pytest.raises(ValueError, match=r"not a draft of this shape.*wrong shape \['fuse"):
        load_weights(other_features, tmp_path / "draft")
    with pytest.raises(FileNotFoundError, match="not a draft"):
        read_token_map(tmp_path)
