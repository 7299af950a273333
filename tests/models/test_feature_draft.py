"""The feature draft's format: written by faser.distill, read by the engine's loader; the target's
features as the engine computes them equal the teacher's; and bad pairs are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from faser.distill.feature_model import build_feature_draft, export_feature_draft
from faser.distill.teacher import teacher_labels
from faser.engine.model_pair import check_features
from faser.models.loader import load_model
from faser.runner.batch import Chunk
from faser.runner.model_runner import ModelRunner
from tests.models.conftest import DRAFT_TEST_VOCAB as VOCAB

IDS = [5, 17, 3, 96, 40, 40, 2, 61, 8]


@pytest.mark.parametrize("feature_layers", [(3,), (1, 2, 3)])
def test_round_trip_gives_the_same_logits(tiny_target, tmp_path: Path, feature_layers) -> None:
    target, target_dir = tiny_target
    token_map = torch.arange(2, VOCAB, 2)
    draft = build_feature_draft(target, feature_layers, [2], token_map).eval()
    with torch.no_grad():  # move off the initial identity fusion so that a mix-up would show
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    export_feature_draft(draft, token_map, tmp_path / "draft", {"test": True}, torch.float32)
    record = {"prompt_ids": IDS[:4], "response_ids": IDS[4:]}
    label = teacher_labels(target, [record], 4, tmp_path / "labels.pt",
                           feature_layers=feature_layers)[0]
    with torch.no_grad():
        want = draft(torch.tensor([IDS]), torch.ones(1, len(IDS), dtype=torch.long),
                     label.features[None].float())[0]

    engine_target = load_model(target_dir, "cpu", "float32", 64)
    engine_draft = load_model(tmp_path / "draft", "cpu", "float32", 64, engine_target.embed_tokens)
    check_features(engine_target, engine_draft)
    target_runner = ModelRunner(engine_target, num_blocks=8, block_size=16, device="cpu")
    target_runner.keep_features(feature_layers)
    _, features = target_runner.forward_hidden([Chunk(IDS, 0, [0, 1], num_logits=1)])
    torch.testing.assert_close(features, label.features.float(), atol=2e-3, rtol=2e-3)

    draft_runner = ModelRunner(engine_draft, num_blocks=8, block_size=16, device="cpu")
    teacher = label.features.float()  # the same (half-precision) rows the training pass read
    before = torch.cat((torch.zeros(1, teacher.shape[1]), teacher[:-1]))
    chunk = Chunk(IDS, 0, [0, 1], num_logits=len(IDS), features=before)
    torch.testing.assert_close(draft_runner.forward([chunk]), want, atol=1e-4, rtol=1e-4)


def test_the_draft_reads_the_rows_the_targets_forwards_wrote(tiny_target, tmp_path: Path) -> None:
    """The target's forwards write each token's feature row at its KV slot, whatever the block
    table; a draft chunk without features reads, at position p, p - 1's row (zeros at p = 0),
    across a block's edge and from an earlier forward: the bits of passing those rows itself."""
    target, target_dir = tiny_target
    draft = build_feature_draft(target, (1, 3), [2], torch.arange(VOCAB))
    export_feature_draft(draft, torch.arange(VOCAB), tmp_path / "draft", {}, torch.float32)
    engine_target = load_model(target_dir, "cpu", "float32", 64)
    engine_draft = load_model(tmp_path / "draft", "cpu", "float32", 64, engine_target.embed_tokens)
    target_runner = ModelRunner(engine_target, num_blocks=8, block_size=4, device="cpu")
    draft_runner = ModelRunner(engine_draft, num_blocks=8, block_size=4, device="cpu")
    with pytest.raises(ValueError, match="no features"):
        draft_runner.forward([Chunk(IDS, 0, [6, 2, 5], num_logits=1)])
    draft_runner.read_features(target_runner.keep_features((1, 3)))
    table = [6, 2, 5]  # out of order, so that a slot is not its position
    _, first = target_runner.forward_hidden([Chunk(IDS[:6], 0, table, num_logits=1)])
    _, last = target_runner.forward_hidden([Chunk(IDS[6:], 6, table, num_logits=1)])
    rows = torch.cat((torch.zeros(1, first.shape[1]), first, last[:-1]))
    for start, end in ((0, len(IDS)), (5, 7)):  # the whole request; then from inside a block
        span = IDS[start:end]
        read = draft_runner.forward([Chunk(span, start, table, num_logits=len(span))])
        given = Chunk(span, start, table, num_logits=len(span), features=rows[start:end])
        assert torch.equal(read, draft_runner.forward([given]))


def test_a_draft_reading_layers_the_target_lacks_is_refused(tiny_target, tmp_path: Path) -> None:
    target, target_dir = tiny_target
    draft = build_feature_draft(target, (2, 4), [0], torch.arange(VOCAB))
    export_feature_draft(draft, torch.arange(VOCAB), tmp_path / "draft", {}, torch.float32)
    engine_target = load_model(target_dir, "cpu", "float32", 64)
    engine_draft = load_model(tmp_path / "draft", "cpu", "float32", 64, engine_target.embed_tokens)
    with pytest.raises(ValueError, match=r"reads target layers \[2, 4\]; the target has layers"):
        check_features(engine_target, engine_draft)


def test_the_second_pass_reads_what_drafting_reads(tiny_target) -> None:
    """Training's second pass at p must see what drafting a second token at p sees: the cache
    of positions before p, made from the target's features, and its own input from the draft's
    guess at p - 1; the eval forward, checked against the engine above, is that drafting."""
    target, _ = tiny_target
    draft = build_feature_draft(target, (3,), [2], torch.arange(VOCAB))
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    ids, ones = torch.tensor([IDS]), torch.ones(1, len(IDS), dtype=torch.long)
    features = torch.randn(1, len(IDS), target.config.hidden_size)
    guesses = []
    hook = draft.norm.register_forward_hook(lambda _m, _i, out: guesses.append(out))
    with torch.no_grad():
        second = draft.train()(ids, ones, features)[1]
        own = guesses[0][0]  # the first pass's guesses of the target's final state
        draft.eval()
        for p in range(1, len(IDS)):
            drafted = features[:, : p + 1].clone()
            drafted[0, p - 1] = own[p - 1]  # row p reads row p - 1
            want = draft(ids[:, : p + 1], ones[:, : p + 1], drafted)[0, p]
            torch.testing.assert_close(second[p], want, atol=1e-5, rtol=1e-5)
    hook.remove()
