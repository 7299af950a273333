"""Pushes the dashboard and its Prometheus datasource to a Grafana server (grafana-client).

The datasource is created, or updated in place when its uid exists; the dashboard is saved
with `overwrite`, so pushing again replaces the previous version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deployments.dashboard import DATASOURCE_VAR, build_dashboard

DATASOURCE_UID = "faser-prometheus"
DATASOURCE_NAME = "FASER Prometheus"


@dataclass(frozen=True, slots=True)
class PushResult:
    datasource: str  # "created" or "updated"
    dashboard_url: str  # as Grafana answers, relative to its root


def datasource_body(prometheus_url: str) -> dict[str, Any]:
    if not prometheus_url.startswith(("http://", "https://")):
        raise ValueError(f"prometheus_url must be an http(s) URL, got {prometheus_url!r}")
    return {
        "uid": DATASOURCE_UID,
        "name": DATASOURCE_NAME,
        "type": "prometheus",
        "access": "proxy",
        "url": prometheus_url,
        "jsonData": {"httpMethod": "POST"},
    }


def dashboard_body(folder_uid: str | None = None) -> dict[str, Any]:
    """The save request: the dashboard bound to our datasource (its variable's default)."""
    board = build_dashboard()
    for variable in board["templating"]["list"]:
        if variable["name"] == DATASOURCE_VAR:
            variable["current"] = {"text": DATASOURCE_NAME, "value": DATASOURCE_UID}
    body: dict[str, Any] = {"dashboard": board, "overwrite": True,
                            "message": "faser dashboard push"}
    if folder_uid:
        body["folderUid"] = folder_uid
    return body


def push(
    url: str,
    token: str | None,
    prometheus_url: str,
    folder_uid: str | None = None,
    timeout_s: float = 10.0,
) -> PushResult:
    """Creates or updates the datasource, then saves the dashboard. Raises grafana-client's
    errors (GrafanaUnauthorizedError for a bad token, ...) unchanged."""
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(url, credential=token, timeout=timeout_s)
    source = datasource_body(prometheus_url)
    state = _upsert_datasource(api, source)
    answer = api.dashboard.update_dashboard(dashboard_body(folder_uid))
    return PushResult(state, str(answer.get("url", "")))


def _upsert_datasource(api: Any, source: dict[str, Any]) -> str:
    from grafana_client.client import GrafanaClientError

    try:
        api.datasource.get_datasource_by_uid(source["uid"])
    except GrafanaClientError as error:
        if error.status_code != 404:
            raise
        api.datasource.create_datasource(source)
        return "created"
    api.datasource.update_datasource_by_uid(source["uid"], source)
    return "updated"
