"""`python -m benchmarks.draft` on a tiny random pair: its figures and their bounds. Timings are
printed, never asserted."""

from __future__ import annotations

import json

import torch

from benchmarks.draft import coverage, main
from faser.outputs import RequestOutput
from tests.fixtures.tiny_models import make_tiny_pair


def _output(token_ids: list[int]) -> RequestOutput:
    return RequestOutput("r", [1], token_ids, "", True, "length")


def test_coverage_counts_the_tokens_the_drafts_vocabulary_holds():
    outputs = [_output([5, 7, 5, 9]), _output([])]
    assert coverage(outputs, torch.tensor([5, 9, 11])) == [(3, 4), (0, 0)]
    assert coverage(outputs, None) == [(4, 4), (0, 0)]  # the draft predicts the target's vocab


def test_the_benchmark_reports_alpha_and_coverage_by_category(tmp_path, capsys):
    target, draft = make_tiny_pair(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [f"Tell me about {c} {i}."]}
            for i, c in enumerate(("writing", "math", "writing"))]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "draft.json"
    main(["--target", str(target), "--draft", str(draft), "--data", str(prompts),
          "--num-prompts", "3", "--max-tokens", "6", "--timing-repeats", "2",
          "--no-prompt-lookup", "--json", str(out)])
    table = json.loads(out.read_text())["table"]
    assert set(table) == {"overall", "writing", "math"}
    assert table["overall"]["num_prompts"] == 3
    for entry in table.values():
        assert entry["coverage"] == 1.0  # this draft's output layer is the target's vocabulary
        assert 0.0 <= entry["alpha"] <= 1.0  # without lookup, within the coverage
    assert "coverage" in capsys.readouterr().out
