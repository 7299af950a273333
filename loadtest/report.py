"""Compare load-test runs side by side: PNG plots and a Markdown summary.

    python -m loadtest.report results/run1 results/run2 --out report/
    python -m loadtest.report results/run1 --metrics prom_dump.json --out report/

Each run folder is what `python -m loadtest.run` wrote. Server metrics (mode, k, replicas) come
from the folder's `metrics.json` or from `--metrics` (one per run, in order): a Prometheus
`query_range` dump keyed by series name, or `{name: [[epoch_s, value], ...]}`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from loadtest.plots import plot_latency, plot_metrics, plot_throughput
from loadtest.run_data import RunData, Summary, load_run, summarize
from loadtest.time_series import Series, bin_records

COLUMNS = (
    "requests", "failures", "503s", "output tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)",
    "TPOT p50 (ms)", "TPOT p99 (ms)", "latency mean (s)", "latency p99 (s)",
)
COMMON_KEYS = ("shape", "api", "model", "speculation", "duration_s")
# Every report of a replay states its time scale and length caps: the trace's own rates are not
# what a small test machine serves.
SHAPE_KEYS = {
    "trace": (
        "trace", "time_scale", "trace_start_s", "trace_span_s", "max_requests",
        "max_prompt_tokens", "max_output_tokens", "pool_users",
    ),
    "closed": ("users", "base_users", "step_users", "step_s", "max_tokens", "think_s"),
}


def write_report(
    folders: list[str | Path], out: str | Path, metrics: list[str | Path] | None = None,
    bin_s: float | None = None,
) -> Path:
    """Plots and `summary.md` for the runs in `folders`; the path of the summary."""
    if metrics and len(metrics) != len(folders):
        raise ValueError(f"metrics: got {len(metrics)} files for {len(folders)} runs")
    runs = [load_run(f, m) for f, m in zip(folders, metrics or [None] * len(folders), strict=True)]
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    series = {run.name: bin_records(run.records, run.t0, bin_s) for run in runs if run.records}
    images = _plots(runs, series, out_dir)
    summary = out_dir / "summary.md"
    summary.write_text(markdown(runs, [summarize(run) for run in runs], images), encoding="utf-8")
    return summary


def _plots(runs: list[RunData], series: dict[str, Series], out_dir: Path) -> list[Path]:
    images = []
    if series:
        images.append(plot_throughput(series, out_dir / "throughput.png"))
        images.append(plot_latency(series, "ttft", out_dir / "ttft.png"))
        images.append(plot_latency(series, "tpot", out_dir / "tpot.png"))
    metrics_png = plot_metrics(runs, out_dir / "metrics.png")
    return images + ([metrics_png] if metrics_png else [])


def _cell(value: float | int | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def _row(summary: Summary) -> list[str]:
    s = summary
    return [
        _cell(s.requests), _cell(s.failures), _cell(s.backpressure), _cell(s.output_tok_s),
        _cell(s.ttft_p50_ms), _cell(s.ttft_p99_ms), _cell(s.tpot_p50_ms), _cell(s.tpot_p99_ms),
        _cell(s.latency_mean_s, 2), _cell(s.latency_p99_s, 2),
    ]


def markdown(runs: list[RunData], summaries: list[Summary], images: list[Path]) -> str:
    """Runs as columns, figures as rows, so two runs read side by side."""
    names = [run.name for run in runs]
    lines = ["# Load test report", "", "| | " + " | ".join(names) + " |"]
    lines.append("| --- |" + " --- |" * len(names))
    rows = [_row(s) for s in summaries]
    for i, column in enumerate(COLUMNS):
        lines.append(f"| {column} | " + " | ".join(row[i] for row in rows) + " |")
    pairs = zip(runs, summaries, strict=True)
    lines += ["", "## Settings", ""] + [_settings_line(run, s) for run, s in pairs]
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in images]
    return "\n".join(lines) + "\n"


def _settings_line(run: RunData, summary: Summary) -> str:
    settings = run.settings
    keys = COMMON_KEYS + SHAPE_KEYS["trace" if settings.get("shape") == "trace" else "closed"]
    shown = ", ".join(f"{k}={settings[k]}" for k in keys if settings.get(k) is not None)
    host = run.run.get("host", "?")
    late = summary.lateness_p99_s
    lateness = f", replay lateness p99 {late:.2f} s" if late is not None else ""
    return (
        f"- **{run.name}**: {host}; {shown or 'no run.json'}; "
        f"{summary.duration_s:.1f} s measured{lateness}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="run folders written by python -m loadtest.run")
    parser.add_argument("--out", default="report")
    parser.add_argument("--metrics", nargs="*", help="one metrics JSON per run, in order")
    parser.add_argument("--bin-s", type=float, help="time-series bin width (default: auto)")
    args = parser.parse_args(argv)
    summary = write_report(args.runs, args.out, args.metrics, args.bin_s)
    print(summary.read_text(encoding="utf-8"))
    print(f"report: {summary} and plots in {summary.parent}")


if __name__ == "__main__":
    main()
