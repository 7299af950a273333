"""What the benchmark sends: Spec-Bench prompts as token ids, and Azure trace arrivals.

A prompt is the first turn of a Spec-Bench question with the target's chat template applied. A
model without a tokenizer (the tiny random test models) gets its prompt as UTF-8 bytes folded into
its vocabulary, and a prompt line may also carry `prompt_token_ids` directly. An open-loop
arrival is one trace row: its scaled offset, and the output length it asked for, capped.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from benchmarks.common import DEFAULT_PROMPTS, chat_ids


@dataclass(frozen=True, slots=True)
class PromptSpec:
    question_id: int | str
    category: str
    text: str
    token_ids: tuple[int, ...] | None = None  # given in the file: used as they are


@dataclass(frozen=True, slots=True)
class Arrival:
    offset_s: float  # replay seconds after the first replayed arrival
    context_tokens: int  # the trace's prompt length (reported; the prompt is Spec-Bench's own)
    max_tokens: int  # the trace's GeneratedTokens, capped


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    offset_s: float = 0.0  # open loop: when to add it; closed loop: unused


def load_prompts(path: str | Path | None, num_prompts: int) -> list[PromptSpec]:
    """The first `num_prompts` lines of a Spec-Bench JSON-lines file (cycled if it is shorter)."""
    source = Path(path) if path is not None else DEFAULT_PROMPTS
    if not source.is_file():
        raise ValueError(f"prompts: no prompt file at {source}")
    lines = [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts = [_parse_prompt(line, source, n) for n, line in enumerate(lines, 1)]
    if not prompts:
        raise ValueError(f"prompts: {source} holds no prompts")
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


def _parse_prompt(line: str, source: Path, line_no: int) -> PromptSpec:
    try:
        row = json.loads(line)
        ids = row.get("prompt_token_ids")
        turns = row.get("turns") or [""]
        text = str(turns[0])
        if ids is None and not text:
            raise ValueError("neither turns nor prompt_token_ids")
        return PromptSpec(
            row.get("question_id", line_no), str(row.get("category", "")), text,
            tuple(int(t) for t in ids) if ids is not None else None,
        )
    except (ValueError, TypeError, AttributeError) as error:
        raise ValueError(f"prompts: bad line {line_no} in {source}: {error}") from None


def encode_prompt(prompt: PromptSpec, tokenizer, vocab_size: int) -> list[int]:
    """Token ids of the prompt: given ids, else the chat template, else bytes folded into vocab."""
    if prompt.token_ids is not None:
        return [t % vocab_size for t in prompt.token_ids]
    if tokenizer is None:
        return [b % vocab_size for b in prompt.text.encode("utf-8")]
    if getattr(tokenizer, "chat_template", None):
        return chat_ids(tokenizer, prompt.text)
    return tokenizer.encode(prompt.text, add_special_tokens=False)


def fit_prompt(ids: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    """Keeps the prompt's tail (the chat template's assistant header) so prompt + output fit."""
    room = max_model_len - max_tokens
    if room < 1:
        raise ValueError(f"max_tokens ({max_tokens}) leaves no room for a prompt in "
                         f"max_model_len ({max_model_len})")
    return ids[-room:]


def read_trace(path: str | Path) -> list[tuple[float, int, int]]:
    """(offset_s from the first row, ContextTokens, GeneratedTokens) of an Azure trace CSV."""
    source = Path(path)
    if not source.is_file():
        raise ValueError(f"trace: no trace file at {source}")
    with source.open(newline="", encoding="utf-8") as handle:
        rows = [_parse_trace_row(row, source) for row in csv.DictReader(handle)]
    if not rows:
        raise ValueError(f"trace: {source} holds no rows")
    rows.sort(key=lambda row: row[0])
    first = rows[0][0]
    return [((t - first).total_seconds(), ctx, gen) for t, ctx, gen in rows]


def _parse_trace_row(row: dict[str, str], source: Path) -> tuple[datetime, int, int]:
    try:
        # the trace has 7 fractional digits; fromisoformat takes at most 6 before Python 3.11
        stamp = row["TIMESTAMP"].strip()
        head, _, frac = stamp.partition(".")
        stamp = f"{head}.{frac[:6]}" if frac else head
        return datetime.fromisoformat(stamp), int(row["ContextTokens"]), int(row["GeneratedTokens"])
    except (KeyError, ValueError, AttributeError) as error:
        raise ValueError(f"trace: bad row in {source}: {row} ({error})") from None


def trace_arrivals(
    rows: Sequence[tuple[float, int, int]], time_scale: float, max_requests: int, max_tokens: int
) -> list[Arrival]:
    """The first `max_requests` rows; replay offset = trace offset / time_scale (below 1 slows
    the replay down, as in loadtest/), output length = GeneratedTokens capped by max_tokens."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    chosen = list(rows[:max_requests])
    first = chosen[0][0]
    return [
        Arrival((t - first) / time_scale, ctx, max(1, min(gen, max_tokens)))
        for t, ctx, gen in chosen
    ]


def closed_requests(prompt_ids: Sequence[list[int]], max_tokens: int) -> list[BenchRequest]:
    return [BenchRequest(tuple(ids), max_tokens) for ids in prompt_ids]


def open_requests(
    prompt_ids: Sequence[list[int]], arrivals: Sequence[Arrival]
) -> list[BenchRequest]:
    """Arrival i gets prompt i (cycling)."""
    return [
        BenchRequest(tuple(prompt_ids[i % len(prompt_ids)]), a.max_tokens, a.offset_s)
        for i, a in enumerate(arrivals)
    ]
