"""The corpus of real training prompts (docs/distill_corpus.md; its directory named by
FASER_DISTILL_PROMPTS, as it is not in the repository) shares nothing with the Spec-Bench
prompts the draft is measured on: no prompt equals a Spec-Bench turn once normalised, and none is
a near-duplicate of one (character 8-gram Jaccard, or one inside the other, at 0.8 or more)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from faser.distill.overlap import NgramIndex
from faser.distill.prompt_files import read_prompt_files

ROOT = Path(__file__).resolve().parents[2]
SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench_dev.jsonl"
CORPUS = Path(os.environ.get("FASER_DISTILL_PROMPTS", "/work/distill_prompts"))
THRESHOLD = 0.8


def test_the_index_finds_copies_rewordings_and_containment() -> None:
    references = [
        "Who played Anna in Once Upon a Time?",
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
        "cultural experiences and must-see attractions.",
        "The committee met on Tuesday to discuss the budget for next year and agreed to raise "
        "spending on schools and roads by five percent.",
    ]
    index = NgramIndex(references)
    assert index.exact("who played  anna in once upon a time") == 0
    assert index.exact("Who played Elsa in Frozen?") is None
    reworded = index.worst(
        "Compose an engaging travel blog post about your recent trip to Hawaii, highlighting "
        "cultural experiences and must see attractions!"
    )
    assert reworded.reference == 1 and reworded.jaccard >= THRESHOLD
    inside = index.worst(f"Summarize: {references[2]} Critics called it too little, too late.")
    assert inside.reference == 2 and inside.jaccard < THRESHOLD <= inside.containment
    unrelated = index.worst("Write a Python function that merges two sorted lists.")
    assert unrelated is None or max(unrelated.jaccard, unrelated.containment) < 0.5


def test_the_corpus_does_not_overlap_spec_bench() -> None:
    if not SPEC_BENCH.is_file():
        pytest.skip(f"{SPEC_BENCH} is absent (it is not part of the repository)")
    if not CORPUS.is_dir():
        pytest.skip(f"{CORPUS} is absent (set FASER_DISTILL_PROMPTS to the corpus's directory)")
    turns = [t for line in SPEC_BENCH.read_text().splitlines() for t in json.loads(line)["turns"]]
    index = NgramIndex(turns)
    prompts = read_prompt_files(sorted(CORPUS.glob("*.jsonl")))
    assert prompts
    exact = [p.text for p in prompts if index.exact(p.text) is not None]
    assert not exact, f"prompts equal to Spec-Bench turns: {exact[:3]}"
    near = []
    for p in prompts:
        worst = index.worst(p.text)
        if worst and max(worst.jaccard, worst.containment) >= THRESHOLD:
            turn = turns[worst.reference]
            near.append((worst.jaccard, worst.containment, p.text[:80], turn[:80]))
    assert not near, f"{len(near)} near-duplicates of Spec-Bench turns, e.g. {near[:3]}"
