"""Our own clients against a server that wants an API key: the real app with `api_keys`, over
HTTP (uvicorn), an engine in process. The load test and the serving benchmark fail at once,
saying so, without the key; with it every request is answered, and the load test never writes
the key to its run's folder."""

from __future__ import annotations

import json

import pytest

from benchmarks.serving import main as serving_benchmark
from deployments.access import Access
from loadtest.records import read_records
from loadtest.run import run_headless
from tests.fixtures.local_app import local_openai_app, serve_over_http

KEY = "sk-load-test-key"


@pytest.fixture(scope="module")
def keyed_server(tiny_pair):
    for app in local_openai_app(tiny_pair, Access(api_keys=frozenset({KEY}))):
        yield from serve_over_http(app)


@pytest.mark.slow
def test_a_load_test_needs_the_servers_key_and_keeps_it_out_of_its_folder(
        tmp_path, keyed_server, monkeypatch):
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


def test_the_serving_benchmark_sends_the_servers_key(keyed_server, tiny_pair):
    target, draft = tiny_pair
    args = ["--url", keyed_server, "--concurrency", "2", "--num-requests", "2", "--max-tokens",
            "3", "--prompts", "random", "--input-len", "8", "--app-arg", f"model={target}",
            "--app-arg", f"draft_model={draft}"]
    with pytest.raises(RuntimeError, match="wants an API key"):
        serving_benchmark(args)
    out = serving_benchmark([*args, "--api-key", KEY])
    assert [(s["num_completed"], s["num_failed"]) for s in out["summaries"]] == [(2, 0)]
