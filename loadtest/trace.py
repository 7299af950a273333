"""Azure LLM inference traces turned into timed requests for open-loop replay.

A trace row is (TIMESTAMP, ContextTokens, GeneratedTokens). Replay keeps the arrival pattern and
the length mix but not the production rate, which is far beyond a small test box: offsets are
divided by `time_scale` (below 1 slows the replay down) and lengths are capped. The window is in
trace seconds, so the same window picks the same rows whatever the time scale.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from loadtest.prompts import Prompt, sized_prompt

TRACES_DIR = Path(__file__).resolve().parents[2] / "shared" / "traces"
TRACES_ENV = "FASER_TRACES"
TRACE_FILES = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}


@dataclass(frozen=True, slots=True)
class TraceRow:
    offset_s: float  # seconds after the trace's first row
    context_tokens: int
    generated_tokens: int


@dataclass(frozen=True, slots=True)
class TraceWindow:
    """Which rows to replay and how: time scale, window in trace seconds, count and length caps."""

    time_scale: float = 1.0
    start_s: float = 0.0
    span_s: float | None = None
    max_requests: int | None = None
    max_prompt_tokens: int = 512
    max_output_tokens: int = 128

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.start_s < 0 or (self.span_s is not None and self.span_s <= 0):
            raise ValueError(f"trace window must have start_s >= 0 and span_s > 0: {self}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if self.max_prompt_tokens < 1 or self.max_output_tokens < 1:
            raise ValueError(f"max_prompt_tokens and max_output_tokens must be >= 1: {self}")


@dataclass(frozen=True, slots=True)
class Arrival:
    offset_s: float  # replay seconds after the first replayed arrival
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request to send at `offset_s` into the replay."""

    offset_s: float
    prompt: str
    prompt_tokens: int  # the approximate size asked for
    max_tokens: int


def trace_path(name: str) -> Path:
    """`conv` or `code` in $FASER_TRACES (default ../shared/traces beside the repo), else a path."""
    if name in TRACE_FILES:
        return Path(os.environ.get(TRACES_ENV) or TRACES_DIR) / TRACE_FILES[name]
    return Path(name)


def read_trace(path: str | os.PathLike[str]) -> list[TraceRow]:
    """Rows of an Azure trace CSV in arrival order, offsets from the first row."""
    source = Path(path)
    if not source.is_file():
        raise ValueError(f"trace: no trace file at {source}")
    with source.open(newline="", encoding="utf-8") as handle:
        raw = [_parse_row(row, source) for row in csv.DictReader(handle)]
    raw.sort(key=lambda row: row[0])
    if not raw:
        raise ValueError(f"trace: {source} holds no rows")
    first = raw[0][0]
    return [TraceRow((t - first).total_seconds(), ctx, gen) for t, ctx, gen in raw]


def _parse_row(row: dict[str, str], source: Path) -> tuple[datetime, int, int]:
    try:
        return (
            datetime.fromisoformat(row["TIMESTAMP"].strip()),
            int(row["ContextTokens"]),
            int(row["GeneratedTokens"]),
        )
    except (KeyError, ValueError) as error:
        raise ValueError(f"trace: bad row in {source}: {row} ({error})") from None


def to_arrivals(rows: Sequence[TraceRow], window: TraceWindow) -> list[Arrival]:
    """The window's rows, re-based to its first row, time-scaled, capped in length and count."""
    end_s = float("inf") if window.span_s is None else window.start_s + window.span_s
    chosen = [r for r in rows if window.start_s <= r.offset_s < end_s][: window.max_requests]
    if not chosen:
        return []
    first = chosen[0].offset_s
    return [
        Arrival(
            offset_s=(row.offset_s - first) / window.time_scale,
            prompt_tokens=max(1, min(row.context_tokens, window.max_prompt_tokens)),
            output_tokens=max(1, min(row.generated_tokens, window.max_output_tokens)),
        )
        for row in chosen
    ]


def to_requests(arrivals: Sequence[Arrival], prompts: Sequence[Prompt]) -> list[TraceRequest]:
    """Pair arrival i with prompt i (cycling), sized to the arrival's prompt length."""
    if not prompts:
        raise ValueError("prompts: need at least one prompt to pair with the trace")
    return [
        TraceRequest(
            offset_s=a.offset_s,
            prompt=sized_prompt(prompts[i % len(prompts)].text, a.prompt_tokens),
            prompt_tokens=a.prompt_tokens,
            max_tokens=a.output_tokens,
        )
        for i, a in enumerate(arrivals)
    ]
