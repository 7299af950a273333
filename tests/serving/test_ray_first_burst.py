"""A fresh app's first requests, on a real local Ray: /tokenize is answered without the engines,
and of a burst past the engines' queues every request is answered or refused in OpenAI's shape
(a JSON 503 with Retry-After), never with Ray's own text, and those answered complete."""

import concurrent.futures
import os
import signal
import time

import httpx
import pytest
import ray
from ray import serve

from deployments import build_app

pytestmark = pytest.mark.ray

APP = "burst"
MODEL = "tiny"


@pytest.fixture(scope="module")
def base_url(ray_serve, tiny_pair):
    target, draft = tiny_pair
    app = build_app({
        "model": str(target), "draft_model": str(draft), "served_model_name": MODEL,
        "max_model_len": 128, "num_kv_blocks": 64, "max_num_seqs": 2,
        "max_ongoing_requests": 2, "max_queued_requests": 2, "num_cpus": 0.5,
        "torch_threads": 1, "retry_after_s": 3,
    })
    serve.run(app, name=APP, route_prefix=f"/{APP}")
    yield f"{ray_serve}/{APP}"
    serve.delete(APP)


def test_tokenize_is_answered_while_no_engine_can_answer(base_url):
    """/tokenize and /detokenize are answered by the ingress's copy of the engines' renderer,
    fetched as the ingress starts: with the engine replica's process stopped (SIGSTOP) before any
    of them was asked, where a queue would have held or refused them, they still answer at once.
    (The copy used to be fetched by the first /tokenize, which waited behind generation.)"""
    assert httpx.get(f"{base_url}/v1/models", timeout=60).status_code == 200
    time.sleep(1.0)  # the ingress asks for the renderer right after the model's name
    (pid,) = engine_pids()
    os.kill(pid, signal.SIGSTOP)
    try:
        first = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": "hello"},
                           timeout=5)
        text = httpx.post(f"{base_url}/detokenize",
                          json={"model": MODEL, "tokens": first.json()["tokens"]}, timeout=5)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert first.status_code == 200, first.text
    assert text.status_code == 200 and text.json() == {"prompt": "hello"}


def test_a_first_burst_is_answered_or_refused_in_openais_shape(base_url):
    """A burst past the engines' queues: before the ingress learnt the model's name as it starts,
    each first request asked for it and took a place in the engines' queue, and the burst
    overflowed it; Ray answered in its own words."""
    completion = {"model": MODEL, "prompt": [9, 10, 11], "max_tokens": 20, "temperature": 0,
                  "ignore_eos": True}

    def send(i: int) -> httpx.Response:
        if i % 4 == 3:
            return httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": "hello"},
                              timeout=60)
        return httpx.post(f"{base_url}/v1/completions",
                          json={**completion, "stream": i % 2 == 0}, timeout=60)

    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        responses = list(pool.map(send, range(16)))
    assert any(r.status_code == 200 for r in responses)
    for r in responses:
        assert r.status_code in (200, 503), (r.status_code, r.text)
        if r.status_code == 503:
            assert r.headers.get("retry-after") == "3", r.text
            assert r.json()["error"]["code"] == "queue_full", r.text
        elif "completions" in str(r.request.url) and not r.text.startswith("data:"):
            assert r.json()["usage"]["completion_tokens"] == 20


def engine_pids() -> list[int]:
    """The worker pids of this app's live engine replicas (Ray's actor table has them)."""
    prefix = f"SERVE_REPLICA::{APP}#FaserEngine#"
    return [a["Pid"] for a in ray._private.state.actors().values()
            if a["Name"].startswith(prefix) and a["State"] == "ALIVE"]
