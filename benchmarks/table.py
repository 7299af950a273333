"""Benchmark records as a fixed-width text table, one row per run."""

from __future__ import annotations

from collections.abc import Sequence

# (header, record field, format); a field missing from every record drops its column
COLUMNS = (
    ("policy", "policy", "{}"),
    ("C", "concurrency", "{}"),
    ("scale", "time_scale", "{:g}"),
    ("reqs", "num_requests", "{}"),
    ("tok/s", "output_tokens_per_s", "{:.1f}"),
    ("lat s", "mean_latency_s", "{:.2f}"),
    ("p99 s", "p99_latency_s", "{:.2f}"),
    ("ttft s", "mean_ttft_s", "{:.3f}"),
    ("tpot ms", "mean_tpot_s", "{:.1f}", 1e3),
    ("acc len", "mean_acceptance_length", "{:.2f}"),
    ("k", "mean_k", "{:.2f}"),
    ("target pos", "target_positions_computed", "{}"),
    ("slo", "slo_attainment", "{:.0%}"),
    ("match", "outputs_match_first_policy", "{:.0%}"),
)


def format_table(records: Sequence[dict]) -> str:
    columns = [c for c in COLUMNS if any(c[1] in r for r in records)]
    rows = [[c[0] for c in columns]]
    for r in records:
        rows.append([_cell(r, c) for c in columns])
    widths = [max(len(row[j]) for row in rows) for j in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(record: dict, column: tuple) -> str:
    value = record.get(column[1])
    if value is None:
        return "-"
    scale = column[3] if len(column) > 3 else 1.0
    return column[2].format(value * scale if scale != 1.0 else value)
