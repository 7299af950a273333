"""The Grafana dashboard of FASER serve, built from the replicas' metric names.

Every expression is written from `deployments.metrics` (the names Ray exports) and Ray Serve's
own replica and queue series, so that a renamed metric changes the dashboard with it; tests
check each expression with promtool and against the names a live replica exports.

    python -m deployments.dashboard --out k8s/grafana-dashboard.json   # the committed copy
    faser dashboard push --url http://grafana:3000 --token ... --prometheus-url http://prom:9090
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deployments.metrics import (
    ALPHA,
    E2E,
    GENERATION_TOKENS,
    KV_USAGE,
    MODE,
    MODE_VALUES,
    NUM_ACCEPTED_PER_POS,
    NUM_ACCEPTED_TOKENS,
    NUM_DRAFT_TOKENS,
    NUM_DRAFTS,
    NUM_PRUNED,
    NUM_REQUEST_STEPS,
    NUM_RUNNING,
    NUM_SLO_MET,
    NUM_SLO_REQUESTS,
    NUM_WAITING,
    PREFIX_CACHE_HITS,
    PROMPT_TOKENS,
    TPOT,
    TTFT,
    K,
    MetricSpec,
)

UID = "faser-serve"
TITLE = "FASER serve"
DATASOURCE_VAR = "datasource"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "k8s" / "grafana-dashboard.json"
ENGINE_DEPLOYMENT = "FaserEngine"
# Ray Serve's own series, exported by the same endpoint as ours
SERVE_REPLICAS = "ray_serve_deployment_replica_healthy"
SERVE_TARGET_REPLICAS = "ray_serve_autoscaling_target_replicas"
SERVE_QUEUED = "ray_serve_deployment_queued_queries"
# Grafana's template variables, and what stands in for them where PromQL is parsed alone
RATE = "$__rate_interval"
SELECTOR = 'application=~"$application"'
VARIABLES = {RATE: "1m", "$application": ".*"}
QUANTILES = (0.5, 0.9, 0.99)
WIDTH, HEIGHT = 12, 8


@dataclass(frozen=True, slots=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""


def _sel(spec: MetricSpec | str, part: str = "", extra: str = "") -> str:
    """A metric's series with the dashboard's application filter: `name{application=~...}`."""
    name = spec if isinstance(spec, str) else spec.series
    name = f"{name}_{part}" if part else name
    labels = ",".join(x for x in (SELECTOR, extra) if x)
    return f"{name}{{{labels}}}"


def _rate(spec: MetricSpec, by: str = "", part: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({_sel(spec, part)}[{RATE}]))"


def _quantiles(spec: MetricSpec) -> tuple[Query, ...]:
    return tuple(
        Query(f"histogram_quantile({q}, {_rate(spec, 'le', 'bucket')})", f"p{round(q * 100)}")
        for q in QUANTILES
    )


def _per_replica(spec: MetricSpec) -> Query:
    return Query(f"max by (replica) ({_sel(spec)})", "{{replica}}")


def panels() -> tuple[Panel, ...]:
    acceptance = f"{_rate(NUM_ACCEPTED_TOKENS, 'replica')} / {_rate(NUM_DRAFTS, 'replica')}"
    per_pos = (
        f"{_rate(NUM_ACCEPTED_PER_POS, 'position')} / ignoring(position) group_left "
        f"{_rate(NUM_DRAFTS)}"
    )
    replicas = f'deployment="{ENGINE_DEPLOYMENT}"'
    return (
        Panel("Throughput", (
            Query(_rate(GENERATION_TOKENS), "output tokens/s"),
            Query(_rate(PROMPT_TOKENS), "prompt tokens/s"),
            Query(_rate(GENERATION_TOKENS, "replica"), "output {{replica}}"),
        ), "short", description="Tokens per second, all replicas and each."),
        Panel("Requests finished", (Query(_rate(E2E, "replica", "count"), "{{replica}}"),),
              "reqps"),
        Panel("Time to first token", _quantiles(TTFT), "s"),
        Panel("Time per output token", _quantiles(TPOT), "s"),
        Panel("End-to-end latency", _quantiles(E2E), "s"),
        Panel("Mean acceptance length", (
            Query(f"1 + {_rate(NUM_ACCEPTED_TOKENS)} / {_rate(NUM_DRAFTS)}", "all"),
            Query(f"1 + {acceptance}", "{{replica}}"),
        ), description="Tokens committed per speculative step: 1 + accepted / drafts (vLLM)."),
        Panel("Acceptance rate by position", (Query(per_pos, "position {{position}}"),),
              "percentunit", description="Drafts whose token at this position was accepted."),
        Panel("Draft acceptance rate", (
            Query(f"{_rate(NUM_ACCEPTED_TOKENS)} / {_rate(NUM_DRAFT_TOKENS)}", "accepted/drafted"),
        ), "percentunit"),
        Panel("Speculation length k", (
            Query(f"{_rate(NUM_DRAFT_TOKENS, 'replica')} / {_rate(NUM_REQUEST_STEPS, 'replica')}",
                  "mean {{replica}}"),
            *(Query(q.expr, f"k {q.legend}") for q in _quantiles(K)),
        ), description="Draft tokens proposed per request-step (0: plain decoding)."),
        Panel("Mode per replica", (_per_replica(MODE),), kind="state-timeline",
              description="The controller's mode: overlap (low load), prune, off (saturated)."),
        Panel("Pruned target positions", (
            Query(_rate(NUM_PRUNED, "replica"), "{{replica}}"),
            Query(f"{_rate(NUM_PRUNED)} / {_rate(NUM_DRAFT_TOKENS)}", "per draft token"),
        ), description="Target positions never computed thanks to early pruning, per second."),
        Panel("SLO attainment", (
            Query(f"{_rate(NUM_SLO_MET)} / {_rate(NUM_SLO_REQUESTS)}", "all"),
            Query(f"{_rate(NUM_SLO_MET, 'replica')} / {_rate(NUM_SLO_REQUESTS, 'replica')}",
                  "{{replica}}"),
        ), "percentunit", description="Finished requests with an SLO that met its TTFT and TPOT."),
        Panel("Replicas", (
            Query(f"sum({_sel(SERVE_REPLICAS, extra=replicas)})", "healthy"),
            Query(f"max({_sel(SERVE_TARGET_REPLICAS, extra=replicas)})", "autoscaling target"),
        )),
        Panel("Queue", (
            Query(f"sum by (replica) ({_sel(NUM_WAITING)})", "waiting {{replica}}"),
            Query(f"sum by (replica) ({_sel(NUM_RUNNING)})", "running {{replica}}"),
            Query(f"sum({_sel(SERVE_QUEUED, extra=replicas)})", "queued at the router"),
        )),
        Panel("KV cache use", (_per_replica(KV_USAGE),), "percentunit"),
        Panel("Prefix cache hit rate", (
            Query(f"{_rate(PREFIX_CACHE_HITS)} / {_rate(PROMPT_TOKENS)}", "all"),
            Query(f"{_rate(PREFIX_CACHE_HITS, 'replica')} / {_rate(PROMPT_TOKENS, 'replica')}",
                  "{{replica}}"),
        ), "percentunit", description="Prompt tokens read from the prefix cache, of all prompt "
           "tokens (a request's hits count when it finishes)."),
        Panel("Alpha (estimated acceptance)", (_per_replica(ALPHA),), "percentunit"),
    )


def expressions(board: dict[str, Any] | None = None) -> list[str]:
    """Every PromQL expression of a dashboard (default: this one), as Grafana stores it."""
    board = board or build_dashboard()
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def without_variables(expr: str) -> str:
    """The expression as Prometheus alone would take it (Grafana's variables filled in)."""
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def build_dashboard() -> dict[str, Any]:
    return {
        "uid": UID,
        "title": TITLE,
        "tags": ["faser", "ray-serve", "speculative-decoding"],
        "timezone": "browser",
        "schemaVersion": 39,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [_datasource_variable(), _application_variable()]},
        "panels": [_panel(p, i) for i, p in enumerate(panels())],
    }


def _panel(panel: Panel, index: int) -> dict[str, Any]:
    body = {
        "id": index + 1,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": _datasource(),
        "gridPos": {"x": (index % 2) * WIDTH, "y": (index // 2) * HEIGHT, "w": WIDTH,
                    "h": HEIGHT},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": q.expr, "legendFormat": q.legend,
             "datasource": _datasource()}
            for i, q in enumerate(panel.queries)
        ],
    }
    if panel.kind == "state-timeline":
        body["fieldConfig"]["defaults"]["mappings"] = [_mode_mapping()]
    return body


def _mode_mapping() -> dict[str, Any]:
    options = {str(int(v)): {"text": mode, "index": int(v)} for mode, v in MODE_VALUES.items()}
    return {"type": "value", "options": options}


def _datasource() -> dict[str, str]:
    return {"type": "prometheus", "uid": f"${{{DATASOURCE_VAR}}}"}


def _datasource_variable() -> dict[str, Any]:
    return {"name": DATASOURCE_VAR, "type": "datasource", "query": "prometheus",
            "label": "Prometheus"}


def _application_variable() -> dict[str, Any]:
    return {
        "name": "application", "type": "query", "label": "Serve application",
        "datasource": _datasource(), "query": f"label_values({MODE.series}, application)",
        "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
    }


def dashboard_json() -> str:
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the FASER serve Grafana dashboard.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out = parser.parse_args(argv).out
    out.write_text(dashboard_json(), encoding="utf-8")
    print(f"dashboard: {len(expressions())} expressions -> {out}")


if __name__ == "__main__":
    main()
