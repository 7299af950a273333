"""PNG plots comparing runs over time: throughput, TTFT/TPOT percentiles, server metrics."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402

from loadtest.run_data import RunData  # noqa: E402
from loadtest.time_series import PERCENTILES, Series  # noqa: E402

FIGSIZE_PER_ROW = (10.0, 2.8)


def _figure(num_rows: int, title: str):
    width, height = FIGSIZE_PER_ROW
    fig, axes = plt.subplots(num_rows, 1, figsize=(width, height * num_rows), sharex=True)
    axes = list(axes) if num_rows > 1 else [axes]
    fig.suptitle(title)
    return fig, axes


def _save(fig, path: Path) -> Path:
    axes = fig.get_axes()
    axes[-1].set_xlabel("seconds since the run's first request")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_throughput(series: dict[str, Series], path: Path) -> Path:
    fig, (tok, req, load) = _figure(3, "Throughput")
    for name, s in series.items():
        (line,) = tok.plot(s.t_s, s.output_tok_s, marker=".", label=name)
        color = line.get_color()
        req.plot(s.t_s, s.ok_per_s, marker=".", color=color, label=f"{name} ok")
        req.plot(s.t_s, s.backpressure_per_s, ls="--", color=color, label=f"{name} 503")
        req.plot(s.t_s, s.errors_per_s, ls=":", color=color, label=f"{name} errors")
        load.plot(s.t_s, s.in_flight, marker=".", color=color, label=f"{name} in flight")
        if not np.isnan(s.users).all():
            load.step(s.t_s, s.users, where="post", ls="--", color=color, label=f"{name} users")
    tok.set_ylabel("output tok/s")
    req.set_ylabel("requests/s")
    load.set_ylabel("concurrency")
    return _save(fig, path)


def plot_latency(series: dict[str, Series], metric: str, path: Path) -> Path:
    """One panel per percentile (p50, p90, p99), one line per run; `metric` is ttft or tpot."""
    fig, axes = _figure(len(PERCENTILES), f"{metric.upper()} percentiles over time")
    for ax, q in zip(axes, PERCENTILES, strict=True):
        for name, s in series.items():
            values = s.ttft_ms[q] if metric == "ttft" else s.tpot_ms[q]
            ax.plot(s.t_s, values, marker=".", label=name)
        ax.set_ylabel(f"p{q} {metric} (ms)")
    return _save(fig, path)


def plot_metrics(runs: list[RunData], path: Path) -> Path | None:
    """Server-side series (mode, k, replicas, ...) over each run's time; None when none exist."""
    names = sorted({name for run in runs for name in run.metrics})
    if not names:
        return None
    fig, axes = _figure(len(names), "Server metrics")
    for ax, name in zip(axes, names, strict=True):
        for i, run in enumerate(runs):
            points = run.metrics.get(name, [])
            if points:  # a run keeps its colour in every panel, with or without the series
                ax.step([t - run.t0 for t, _ in points], [v for _, v in points],
                        where="post", label=run.name, color=f"C{i}")
        ax.set_ylabel(name)
    return _save(fig, path)
