"""benchmarks.engine's long prompts for the first-token table: text, not noise, cut to each
length, and a clear error when the prompts file holds too few tokens."""

from __future__ import annotations

import json

import pytest

from benchmarks.engine import long_prompts
from tests.fixtures.tiny_models import build_tokenizer


def test_each_prompt_is_the_runs_first_tokens(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"turns": ["hello world " * 20, "def add(a, b): return a + b"]}] * 3
    path.write_text("\n".join(json.dumps(r) for r in rows))
    tokenizer = build_tokenizer()
    short, long = long_prompts(path, tokenizer, [10, 40])
    assert len(short) == 10 and len(long) == 40 and long[:10] == short
    assert short == tokenizer.encode(rows[0]["turns"][0])[:10]
    with pytest.raises(ValueError, match="prefill_tokens: the prompts hold"):
        long_prompts(path, tokenizer, [100_000])
