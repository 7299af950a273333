"""Prompts for load tests: the first turn of each Spec-Bench question, sized to a token count.

No tokenizer is loaded: a load test only needs prompts of about the right length, and whitespace
words times 1.3 tracks BPE token counts of English text closely enough.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

PROMPTS_ENV = "FASER_PROMPTS"
TOKENS_PER_WORD = 1.3
# The repository is checked out beside shared/, so the data sits one level above the repo root.
DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_dev.jsonl"


@dataclass(frozen=True, slots=True)
class Prompt:
    question_id: int | str
    category: str
    text: str


def prompts_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The prompt file: the argument, else $FASER_PROMPTS, else ../shared/data beside the repo."""
    chosen = path or os.environ.get(PROMPTS_ENV) or DEFAULT_PROMPTS
    return Path(chosen)


def load_prompts(path: str | os.PathLike[str] | None = None) -> list[Prompt]:
    """Read Spec-Bench JSON lines `{question_id, category, turns}`; each prompt is turn one."""
    source = prompts_path(path)
    if not source.is_file():
        raise ValueError(f"prompts_path: no prompt file at {source} (set {PROMPTS_ENV})")
    prompts = [_parse_line(line, source, n) for n, line in enumerate(_lines(source), 1)]
    if not prompts:
        raise ValueError(f"prompts_path: {source} holds no prompts")
    return prompts


def _lines(source: Path) -> list[str]:
    return [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]


def _parse_line(line: str, source: Path, line_no: int) -> Prompt:
    row = json.loads(line)
    turns = row.get("turns")
    if not turns or not isinstance(turns[0], str):
        raise ValueError(f"turns: {source}:{line_no} has no first turn")
    return Prompt(row.get("question_id", line_no), row.get("category", ""), turns[0])


def approx_tokens(text: str) -> int:
    """About how many tokens `text` is: whitespace words times 1.3, rounded up."""
    return math.ceil(len(text.split()) * TOKENS_PER_WORD)


def sized_prompt(text: str, num_tokens: int) -> str:
    """`text` cut or padded (by repeating its words) to about `num_tokens` tokens."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    words = text.split()
    if not words:
        raise ValueError("text: cannot size an empty prompt")
    num_words = max(1, round(num_tokens / TOKENS_PER_WORD))
    repeated = words * math.ceil(num_words / len(words))
    return " ".join(repeated[:num_words])
