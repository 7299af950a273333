"""Shared helpers of the benchmark programs: prompts, timing, tables."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = REPO.parent / "shared" / "data" / "spec_bench_dev.jsonl"


def spec_bench_prompts(path: Path, num: int) -> list[dict]:
    """First turns of Spec-Bench questions, spread over the categories (every k-th line)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    step = max(1, len(rows) // max(1, num))
    return rows[::step][:num]


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def interleaved(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Median of each run's figure; the runs take turns so that a noisy machine hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            samples[name].append(run())
    return {name: statistics.median(values) for name, values in samples.items()}


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    cells = [header] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for n, row in enumerate(cells):
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)
