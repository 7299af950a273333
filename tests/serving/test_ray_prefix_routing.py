"""Prefix-aware routing on a real local Ray with two engine replicas: a conversation's next turn
goes to the replica that served its first, whose prefix cache then holds its blocks, although an
idle fleet would otherwise send both conversations' next turns to the same replica."""

import threading
import time

import openai
import pytest
from ray import serve

from deployments import build_app

pytestmark = pytest.mark.ray

APP = "prefix"
MODEL = "tiny"
STATS_PERIOD_S = 0.5  # the app's routing_stats_period_s: how often replicas report their load
OPENING = "A conversation that opens with this long enough sentence, to be cached in blocks: "


@pytest.fixture(scope="module")
def client(ray_serve, tiny_pair):
    target, draft = tiny_pair
    app = build_app({
        "model": str(target), "draft_model": str(draft), "served_model_name": MODEL,
        "policy": "off", "max_model_len": 2048, "num_kv_blocks": 512, "block_size": 4,
        "max_num_seqs": 2, "max_ongoing_requests": 2, "num_replicas": 2,
        "num_cpus": 0.5, "torch_threads": 1,
    })
    serve.run(app, name=APP, route_prefix=f"/{APP}")
    yield openai.OpenAI(base_url=f"{ray_serve}/{APP}/v1", api_key="none", max_retries=0,
                        timeout=120)
    serve.delete(APP)


def complete(client: openai.OpenAI, prompt: str, max_tokens: int = 8) -> tuple[str, str, int]:
    """The replica that answered, the answer, and the prompt tokens read from its cache."""
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
    )
    done = raw.parse()
    cached = done.usage.prompt_tokens_details.cached_tokens
    return raw.headers["x-faser-replica"], done.choices[0].text, cached


def test_a_conversations_next_turn_goes_where_its_blocks_are(client):
    first_x, first_y = OPENING + "x?", OPENING.upper() + "y?"
    started, answers = threading.Event(), {}

    def long_x() -> None:
        stream = client.completions.with_raw_response.create(
            model=MODEL, prompt=first_x, max_tokens=300, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        answers["x"] = [stream.headers["x-faser-replica"], ""]
        for chunk in stream.parse():
            started.set()
            answers["x"][1] += chunk.choices[0].text if chunk.choices else ""

    thread = threading.Thread(target=long_x)
    thread.start()
    assert started.wait(60)
    # the first conversation's replica is busy: the second goes to the other one
    replica_y, text_y, _ = complete(client, first_y)
    thread.join(120)
    replica_x, text_x = answers["x"]
    assert replica_y != replica_x
    time.sleep(3 * STATS_PERIOD_S)  # the replicas have reported the fleet idle again
    # without their prefixes both next turns would go to one replica
    for replica, prompt in ((replica_x, first_x + text_x + " and?"),
                            (replica_y, first_y + text_y + " and?")):
        served_by, _, cached = complete(client, prompt)
        assert served_by == replica
        assert cached >= len(OPENING) // 8  # its first turn's blocks, at least the opening's

