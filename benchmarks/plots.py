"""PNG figures of a policy benchmark: each metric against load, one line per policy."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402

# (record field, axis label, scale to the unit in the label)
PANELS = (
    ("output_tokens_per_s", "output tokens / s", 1.0),
    ("mean_latency_s", "mean latency (s)", 1.0),
    ("p99_latency_s", "p99 latency (s)", 1.0),
    ("mean_tpot_s", "mean TPOT (ms)", 1e3),
    ("mean_ttft_s", "mean TTFT (s)", 1.0),
    ("mean_k", "mean k", 1.0),
)
# closed loop: load is the number of requests in flight; open loop: the trace's time scale
LOADS = (("concurrency", "concurrency (requests in flight)", "closed_loop.png"),
         ("time_scale", "trace time scale (replay rate / trace rate)", "open_loop.png"))


def plot_records(records: Sequence[dict], out_dir: str | Path, title: str = "") -> list[Path]:
    """One figure per load kind present in `records`; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for load_key, xlabel, name in LOADS:
        chosen = [r for r in records if r.get(load_key) is not None]
        if chosen:
            paths.append(_plot_load(chosen, load_key, xlabel, out / name, title))
    return paths


def _plot_load(records: Sequence[dict], load_key: str, xlabel: str, path: Path, title: str):
    panels = list(PANELS)
    if any("slo_attainment" in r for r in records):
        panels.append(("slo_attainment", "SLO attainment", 1.0))
    num_cols = 2
    num_rows = (len(panels) + num_cols - 1) // num_cols
    fig, axes = plt.subplots(num_rows, num_cols, figsize=(11, 3.2 * num_rows), squeeze=False)
    policies = list(dict.fromkeys(r["policy"] for r in records))
    for ax, (field, label, scale) in zip(axes.flat, panels, strict=False):
        for policy in policies:
            rows = sorted((r for r in records if r["policy"] == policy), key=lambda r: r[load_key])
            ax.plot([r[load_key] for r in rows], [r.get(field, 0.0) * scale for r in rows],
                    marker="o", label=policy)
        ax.set_ylabel(label)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if load_key == "concurrency" and len({r[load_key] for r in records}) > 2:
            ax.set_xscale("log", base=2)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
