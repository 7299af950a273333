"""Policies' decisions priced apart from the host's noise.

On a shared host one policy's run can meet a moment 10 % slower than the next one's, more than the
policies differ. Their decisions can still be compared: every decoding step a run took (from the
engine's decision trace, `benchmarks.policies --step-trace`) is priced at the median time that
steps of its shape took over all runs of its load level, every policy's included, and a run's
priced figure is the output tokens its decoding steps made (all but each request's first, which
its prefill makes) over the sum of those prices. A shape is
what the target and the draft computed: the decoding requests, the draft tokens verified, the
prefill tokens beside them and the frontier size. Steps that only prefill are left out; every
policy prefills the same prompts.

What the prices leave out is each policy's own cost at a shape (its planning, a feature draft's
catch-up after a step without drafting): the wall-clock figures carry those, and the host's noise
with them.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

Shape = tuple[int, int, int, int | None]


def count_lines(path: str | Path) -> int:
    """The decision trace's records so far (0 before the engine writes one)."""
    try:
        with Path(path).open(encoding="utf-8") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def read_spans(path: str | Path, spans: Sequence[Sequence[int]]) -> list[dict]:
    """The records of lines [a, b) for each span (a, b, ...)."""
    with Path(path).open(encoding="utf-8") as f:
        lines = f.read().splitlines()
    return [json.loads(line) for a, b, *_ in spans for line in lines[a:b] if line.strip()]


def shape(step: Mapping) -> Shape:
    return (len(step["k"]), sum(step["k"]), step.get("prefill_tokens") or 0,
            step.get("frontier_size"))


def priced_rates(
    runs: Mapping[str, Sequence[Mapping]], tokens: Mapping[str, int]
) -> dict[str, float]:
    """Per run: the `tokens` its decoding steps made per second, each step at its shape's median
    measured time over all `runs`. Not the tokens the steps committed: a request's last step may
    accept drafts past its max_tokens, which its output drops."""
    times: dict[Shape, list[float]] = {}
    for steps in runs.values():
        for step in steps:
            times.setdefault(shape(step), []).append(step["measured_time_s"])
    prices = {s: statistics.median(t) for s, t in times.items()}
    rates = {}
    for name, steps in runs.items():
        seconds = sum(prices[shape(s)] for s in steps)
        rates[name] = tokens[name] / seconds if seconds > 0 else 0.0
    return rates
