"""`faser distill --prompts`: prompt files parsed and validated (a bad line is named by file and
line), categories interleaved, every 10th prompt of a file held out, answered greedily and kept
out of training; the committed corpus itself reads cleanly."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from faser.distill.generate import GenerationConfig, _params, stage_one_prompts
from faser.distill.model import build_draft
from faser.distill.prompt_files import (
    HELD_OUT_EVERY,
    PromptFileError,
    read_prompt_file,
    read_prompt_files,
)
from faser.distill.run import held_out_split
from faser.distill.teacher import teacher_labels
from faser.distill.train import TrainConfig, train_draft
from tests.models.conftest import DRAFT_TEST_VOCAB as VOCAB

ROOT = Path(__file__).resolve().parents[2]
# data from public repositories, kept out of the repository (docs/distill_corpus.md)
CORPUS = Path(os.environ.get("FASER_DISTILL_PROMPTS", "/work/distill_prompts"))
SPEC_BENCH_CATEGORIES = {
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
    "translation", "summarization", "qa", "math_reasoning", "rag",
}


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_files_are_read_interleaved_with_every_tenth_prompt_held_out(tmp_path: Path) -> None:
    qa = _write(tmp_path / "qa.jsonl", [{"category": "qa", "prompt": f"q{i}?"} for i in range(25)])
    code = _write(tmp_path / "code.jsonl", [{"category": "coding", "prompt": "c0"}, "",
                                           {"category": "coding", "prompt": "c1"}])
    prompts = read_prompt_files([qa, code])
    assert [p.text for p in prompts[:5]] == ["q0?", "c0", "q1?", "c1", "q2?"]
    assert len(prompts) == 27
    held_out = ["q1?", "c1", "q11?", "q21?"]  # each file's 2nd, 12th, ...; blank lines don't count
    assert [p.text for p in prompts if p.held_out] == held_out
    assert all(p.held_out is False for p in prompts if p.text not in held_out)
    assert [p.text for p in read_prompt_files([qa, code], num_prompts=3)] == ["q0?", "c0", "q1?"]


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("{not json", "not a JSON object"),
        ('["qa", "What?"]', "expected the keys"),
        ('{"category": "qa", "promt": "What?"}', "expected the keys"),
        ('{"category": "qa", "prompt": "What?", "extra": 1}', "expected the keys"),
        ('{"category": "Q&A", "prompt": "What?"}', "'category' must be"),
        ('{"category": "translation:German", "prompt": "Hallo"}', "'category' must be"),
        ('{"category": "qa", "prompt": "  "}', "'prompt' must be a non-empty string"),
        ('{"category": "qa", "prompt": 3}', "'prompt' must be a non-empty string"),
    ],
)
def test_a_bad_line_names_its_file_and_line(tmp_path: Path, line: str, complaint: str) -> None:
    path = _write(tmp_path / "bad.jsonl", [{"category": "qa", "prompt": "Fine?"}, "", line])
    with pytest.raises(PromptFileError, match=complaint) as error:
        read_prompt_files([path])
    assert str(error.value).startswith(f"{path}:3: ")


def test_an_empty_or_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(PromptFileError, match="no prompts"):
        read_prompt_file(_write(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(PromptFileError, match="cannot read it"):
        read_prompt_file(tmp_path / "missing.jsonl")


def test_the_files_replace_the_built_in_first_stage(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.jsonl", [{"category": "qa", "prompt": f"q{i}?"} for i in range(9)])
    config = GenerationConfig(target="t", num_prompts=4, prompt_files=(str(path),))
    assert [p.text for p in stage_one_prompts(config)] == ["q0?", "q1?", "q2?", "q3?"]
    built_in = stage_one_prompts(GenerationConfig(target="t", num_prompts=4))
    assert len(built_in) == 4 and all(p.held_out is None for p in built_in)


def test_held_out_prompts_are_answered_greedily() -> None:
    config = GenerationConfig(target="t")
    assert not _params(3, 1, config).greedy  # every fourth prompt is sampled...
    assert _params(3, 1, config, held_out=True).greedy  # ...unless it is held out


def test_held_out_split_keeps_the_files_split_and_every_tenth_other_greedy_answer() -> None:
    files = [{"sampled": i % 4 == 3, "held_out": i % 10 == 9} for i in range(30)]
    others = [{"sampled": i % 2 == 1} for i in range(40)]  # no "held_out": built-in stages
    split = held_out_split(files + others)
    assert split.files == [9, 19, 29]
    assert split.others == [30, 50]  # the 1st and 11th of the 20 greedy others


def test_the_held_out_split_is_reported_before_training_and_after_every_epoch(
    tiny_target, tmp_path: Path
) -> None:
    target, _ = tiny_target
    gen = torch.Generator().manual_seed(0)
    records = [{"prompt_ids": torch.randint(0, VOCAB, (4,), generator=gen).tolist(),
                "response_ids": torch.randint(0, VOCAB, (8,), generator=gen).tolist()}
               for _ in range(6)]
    labels = teacher_labels(target, records, 4, tmp_path / "labels.pt")
    token_map = torch.arange(VOCAB)
    draft = build_draft(target, [0], token_map)
    config = TrainConfig(epochs=2, lr=1e-3, warmup_steps=1, batch_tokens=64)
    summary = train_draft(draft, labels[2:], labels[:2], token_map, config, lambda s: None,
                          reported={"prompt files": labels[:2]})
    by_split = summary["held_out_agreement_by_split"]["prompt files"]
    assert by_split == summary["held_out_agreement"]  # the split is all of held_out here
    assert len(by_split) == 3  # before training, then after each of the two epochs


def test_the_corpus_reads_cleanly() -> None:
    if not CORPUS.is_dir():
        pytest.skip(f"{CORPUS} is absent (set FASER_DISTILL_PROMPTS to the corpus's directory)")
    paths = sorted(CORPUS.glob("*.jsonl"))
    assert paths, f"no prompt files in {CORPUS}"
    for path in paths:
        assert path.stat().st_size < 2_000_000, f"{path.name} is over 2 MB"
        prompts = read_prompt_file(path)
        held_out = [i for i, p in enumerate(prompts) if p.held_out]
        assert held_out == list(range(1, len(prompts), HELD_OUT_EVERY))
    prompts = read_prompt_files(paths)
    categories = Counter(p.category for p in prompts)
    assert set(categories) <= SPEC_BENCH_CATEGORIES, set(categories) - SPEC_BENCH_CATEGORIES
    assert set(categories) == SPEC_BENCH_CATEGORIES  # every kind Spec-Bench covers
    assert len(prompts) >= 3000
    assert len({p.text for p in prompts}) == len(prompts)  # no prompt twice
    sources = (ROOT / "docs" / "distill_corpus.md").read_text()
    for path in paths:  # each file's source is documented
        assert path.name in sources, path.name
