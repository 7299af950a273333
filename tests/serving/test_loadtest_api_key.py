"""The load test against a server that wants an API key: the real app with `api_keys`, over HTTP
(uvicorn), an engine in process. Without the key the run fails at once saying so; with it every
request is answered, and the key is sent but never written to the run's folder."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn

from deployments.access import Access
from loadtest.records import read_records
from loadtest.run import run_headless
from tests.fixtures.local_app import local_openai_app

KEY = "sk-load-test-key"


@pytest.fixture(scope="module")
def keyed_server(tiny_pair):
    for app in local_openai_app(tiny_pair, Access(api_keys=frozenset({KEY}))):
        yield from _serve(app)


def _serve(app):
    """`app` over HTTP on a free port, for a client in another process (Locust)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.mark.slow
def test_a_run_needs_the_servers_key_and_keeps_it_out_of_its_folder(tmp_path, keyed_server,
                                                                      monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="wants an API key"):
        run_headless(keyed_server, out=tmp_path / "none", duration_s=5)
    with pytest.raises(RuntimeError, match="refused the API key"):
        run_headless(keyed_server, out=tmp_path / "wrong", duration_s=5, api_key="sk-wrong")
    prompts = tmp_path / "prompts.jsonl"  # short enough for the tiny model's context
    prompts.write_text("".join(json.dumps({"turns": [f"Question {i}?"]}) + "\n" for i in range(4)))
    out = run_headless(keyed_server, out=tmp_path / "run", api_key=KEY, shape="step", users=2,
                       base_users=2, duration_s=4, max_tokens=4, model="tiny",
                       prompts_path=str(prompts))
    records = read_records(out / "records.jsonl")
    assert records and all(r.status == "ok" for r in records)
    assert not any(KEY in path.read_text(errors="replace") for path in out.iterdir())
