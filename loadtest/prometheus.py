"""Optional: dump Prometheus range queries over a run's time span to `metrics.json`.

The file maps a series name to the raw `/api/v1/query_range` answer; `loadtest.report` also
accepts a hand-made file mapping names to `[[epoch_s, value], ...]` lists. Metric names follow
the serving layer's (vLLM-style spec-decode counters plus FASER's mode and k; Ray Serve's own
replica gauge); pass other queries to `dump_metrics` when they differ.
"""

from __future__ import annotations

import json
import os
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# as Ray exports FASER's metrics (deployments/metrics.py): `ray_` before each name, `_total` after
# a counter's; mean acceptance length is 1 + accepted / drafts, as vLLM derives it
DEFAULT_QUERIES = {
    "mode": "max(ray_faser_spec_mode)",
    "k": "sum(rate(ray_faser_spec_decode_num_draft_tokens_total[30s]))"
    " / sum(rate(ray_faser_spec_decode_num_request_steps_total[30s]))",
    "replicas": 'sum(ray_serve_deployment_replica_healthy{deployment="FaserEngine"})',
    "acceptance_length": "1 + sum(rate(ray_faser_spec_decode_num_accepted_tokens_total[30s]))"
    " / sum(rate(ray_faser_spec_decode_num_drafts_total[30s]))",
}
TIMEOUT_S = 10.0


def query_range(
    base_url: str, query: str, start: float, end: float, step_s: float = 1.0
) -> dict[str, Any]:
    params = urllib.parse.urlencode({"query": query, "start": start, "end": end, "step": step_s})
    url = f"{base_url.rstrip('/')}/api/v1/query_range?{params}"
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as answer:
        return json.loads(answer.read())


def dump_metrics(
    base_url: str,
    queries: Mapping[str, str],
    start: float,
    end: float,
    out_path: str | os.PathLike[str],
    step_s: float = 1.0,
) -> Path:
    dump = {name: query_range(base_url, q, start, end, step_s) for name, q in queries.items()}
    path = Path(out_path)
    path.write_text(json.dumps(dump) + "\n", encoding="utf-8")
    return path


def series_points(raw: Any) -> list[tuple[float, float]]:
    """`[(epoch_s, value)]` from a query_range answer (first series) or a list of pairs."""
    if isinstance(raw, dict):
        result = (raw.get("data") or {}).get("result") or []
        raw = result[0].get("values", []) if result else []
    points = []
    for pair in raw or []:
        try:
            points.append((float(pair[0]), float(pair[1])))
        except (TypeError, ValueError, IndexError):
            continue
    return points
