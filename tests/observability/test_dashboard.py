"""The dashboard as code: every expression parses (promtool), names only metrics that the
replicas or Ray Serve export, the committed JSON is the generated one, and `faser dashboard push`
sends the datasource and dashboard that Grafana's HTTP API expects (to a recording stub: no
Grafana server runs here)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deployments import dashboard
from deployments.grafana import DATASOURCE_UID, datasource_body
from deployments.metrics import CATALOGUE, exported_names
from faser.cli import main as faser_main
from tests.observability.promtool import check_expressions, metric_names

SERVE_NAMES = {dashboard.SERVE_REPLICAS, dashboard.SERVE_TARGET_REPLICAS, dashboard.SERVE_QUEUED}


def test_every_expression_passes_promtool(tmp_path) -> None:
    exprs = [dashboard.without_variables(e) for e in dashboard.expressions()]
    assert len(exprs) >= 25
    result = check_expressions(exprs, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


def test_promtool_rejects_a_broken_expression(tmp_path) -> None:
    result = check_expressions(["sum(rate(ray_faser_generation_tokens_total[1m])"], tmp_path)
    assert result.returncode != 0


def test_expressions_use_only_exported_names() -> None:
    used = set().union(*(metric_names(e) for e in dashboard.expressions()))
    assert used <= exported_names() | SERVE_NAMES, used - exported_names() - SERVE_NAMES
    # every engine metric is on the dashboard
    shown = {spec.name for spec in CATALOGUE if set(spec.exported) & used}
    assert shown == {spec.name for spec in CATALOGUE}


def test_loadtest_default_queries_parse_and_use_exported_names(tmp_path) -> None:
    from loadtest.prometheus import DEFAULT_QUERIES

    result = check_expressions(list(DEFAULT_QUERIES.values()), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    used = set().union(*(metric_names(e) for e in DEFAULT_QUERIES.values()))
    assert used <= exported_names() | SERVE_NAMES, used - exported_names() - SERVE_NAMES


def test_vllm_spec_decode_names_and_acceptance_length() -> None:
    names = exported_names()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                 "num_accepted_tokens_per_pos"):
        assert f"ray_faser_spec_decode_{name}_total" in names
    acceptance = [e for e in dashboard.expressions() if e.startswith("1 + ")]
    assert acceptance and "ray_faser_spec_decode_num_drafts_total" in acceptance[0]


def test_committed_json_is_the_generated_one() -> None:
    committed = dashboard.DEFAULT_OUT.read_text(encoding="utf-8")
    assert committed == dashboard.dashboard_json(), "run: python -m deployments.dashboard"
    board = json.loads(committed)
    assert board["uid"] == dashboard.UID
    titles = {p["title"] for p in board["panels"]}
    assert {"Throughput", "Time to first token", "Time per output token", "Mode per replica",
            "Mean acceptance length", "Replicas", "Queue", "Pruned target positions"} <= titles


class _Grafana(BaseHTTPRequestHandler):
    """Answers as Grafana does for an unknown datasource uid, a create and a dashboard save."""

    calls: list[tuple[str, str, dict | None, str | None]] = []

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.calls.append((self.command, self.path, body, self.headers.get("Authorization")))

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        self._record()
        self._answer(404, {"message": "Data source not found"})

    def do_POST(self) -> None:  # noqa: N802
        self._record()
        if self.path == "/api/dashboards/db":
            self._answer(200, {"status": "success", "url": "/d/faser-serve/faser-serve"})
        else:
            self._answer(200, {"message": "Datasource added", "id": 1})

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def grafana_stub():
    _Grafana.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Grafana)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Grafana.calls
    server.shutdown()


def test_dashboard_push_to_nothing_says_so_without_a_traceback(capsys) -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rc = faser_main(["dashboard", "push", "--url", f"http://127.0.0.1:{port}", "--token", "t"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("faser: ") and "Traceback" not in err


def test_dashboard_push_command(grafana_stub, capsys) -> None:
    url, calls = grafana_stub
    rc = faser_main(["dashboard", "push", "--url", url, "--token", "secret",
                     "--prometheus-url", "http://prom:9090"])
    assert rc == 0
    assert [(c[0], c[1]) for c in calls] == [
        ("GET", f"/api/datasources/uid/{DATASOURCE_UID}"),
        ("POST", "/api/datasources"),
        ("POST", "/api/dashboards/db"),
    ]
    assert all(c[3] == "Bearer secret" for c in calls)
    assert calls[1][2] == datasource_body("http://prom:9090")
    saved = calls[2][2]
    assert saved["overwrite"] is True and saved["dashboard"]["uid"] == dashboard.UID
    assert "datasource created" in capsys.readouterr().out


def test_datasource_url_is_checked() -> None:
    with pytest.raises(ValueError, match="prometheus_url"):
        datasource_body("prom:9090")
