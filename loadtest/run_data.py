"""One finished run read back from its folder, and the figures a report compares.

Records (`records.jsonl`) are the source of truth; a folder without them (a run from another
tool) falls back to Locust's `locust_stats.csv` for the summary and has no time series.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.prometheus import series_points
from loadtest.records import RequestRecord, read_records


@dataclass(frozen=True)
class RunData:
    name: str
    folder: Path
    run: dict[str, Any]  # run.json, empty when absent
    records: list[RequestRecord]
    metrics: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    @property
    def settings(self) -> dict[str, Any]:
        return self.run.get("settings", {})

    @property
    def t0(self) -> float:
        """Time zero for plots: the first request's send time, else the run's start."""
        if self.records:
            return min(r.start for r in self.records)
        return float(self.run.get("started", 0.0))


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    ok: int
    failures: int
    backpressure: int
    duration_s: float
    output_tok_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    latency_mean_s: float | None
    latency_p99_s: float | None
    lateness_p99_s: float | None  # trace replay: how far from open loop the run drifted


def load_run(folder: str | Path, metrics_path: str | Path | None = None) -> RunData:
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"run: {path} is not a run folder")
    run_json = path / "run.json"
    run = json.loads(run_json.read_text(encoding="utf-8")) if run_json.is_file() else {}
    records_path = path / "records.jsonl"
    records = read_records(records_path) if records_path.is_file() else []
    metrics_file = Path(metrics_path) if metrics_path else path / "metrics.json"
    metrics = _load_metrics(metrics_file) if metrics_file.is_file() else {}
    return RunData(path.name, path, run, records, metrics)


def _load_metrics(path: Path) -> dict[str, list[tuple[float, float]]]:
    """Series by name from a Prometheus dump or a `{name: [[t, v], ...]}` file."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError(f"metrics: {path} must map series names to series")
    series = {name: series_points(value) for name, value in raw.items()}
    return {name: points for name, points in series.items() if points}


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(run: RunData) -> Summary:
    if not run.records:
        return _summary_from_locust(run)
    records = run.records
    ok = [r for r in records if r.status == "ok"]
    end = max(r.start + r.latency_s for r in records)
    duration = max(end - run.t0, 1e-9)
    ms = lambda values, q: None if not values else percentile(values, q) * 1000.0
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    latency = [r.latency_s for r in ok]
    lateness = [r.lateness_s for r in records if r.lateness_s is not None]
    return Summary(
        requests=len(records), ok=len(ok),
        failures=sum(r.status == "error" for r in records),
        backpressure=sum(r.status == "backpressure" for r in records),
        duration_s=duration, output_tok_s=sum(r.output_tokens for r in ok) / duration,
        ttft_p50_ms=ms(ttft, 50), ttft_p99_ms=ms(ttft, 99),
        tpot_p50_ms=ms(tpot, 50), tpot_p99_ms=ms(tpot, 99),
        latency_mean_s=float(np.mean(latency)) if latency else None,
        latency_p99_s=percentile(latency, 99), lateness_p99_s=percentile(lateness, 99),
    )


def _summary_from_locust(run: RunData) -> Summary:
    stats = run.folder / "locust_stats.csv"
    if not stats.is_file():
        raise ValueError(f"run: {run.folder} has neither records.jsonl nor locust_stats.csv")
    with stats.open(newline="", encoding="utf-8") as handle:
        rows = {(row["Type"], row["Name"]): row for row in csv.DictReader(handle)}
    post = next((r for (t, n), r in rows.items() if t == "POST" and "503" not in n), None)
    busy = next((r for (t, n), r in rows.items() if t == "POST" and "503" in n), None)
    count = lambda row, col: float(row[col]) if row and row.get(col) not in (None, "N/A") else None
    duration = max(float(run.run.get("ended", 0)) - float(run.run.get("started", 0)), 1e-9)
    answered = int(count(post, "Request Count") or 0)
    failures = int(count(post, "Failure Count") or 0)
    tokens = answered * (count(post, "Average Content Size") or 0.0)
    ttft, tpot = rows.get(("METRIC", "ttft")), rows.get(("METRIC", "tpot"))
    mean_ms, p99_ms = count(post, "Average Response Time"), count(post, "99%")
    return Summary(
        requests=answered + int(count(busy, "Request Count") or 0), ok=answered - failures,
        failures=failures, backpressure=int(count(busy, "Request Count") or 0),
        duration_s=duration, output_tok_s=tokens / duration,
        ttft_p50_ms=count(ttft, "50%"), ttft_p99_ms=count(ttft, "99%"),
        tpot_p50_ms=count(tpot, "50%"), tpot_p99_ms=count(tpot, "99%"),
        latency_mean_s=None if mean_ms is None else mean_ms / 1000.0,
        latency_p99_s=None if p99_ms is None else p99_ms / 1000.0, lateness_p99_s=None,
    )
