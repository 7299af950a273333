"""API keys and the body limit on the app served by Ray Serve (a real local Ray), driven by the
official openai client and raw HTTP: a valid Bearer key is served, a missing or wrong one is a
401 in OpenAI's error shape, /health stays open, and a body past the limit is a 413."""

import httpx
import openai
import pytest
from ray import serve

from deployments import build_app
from deployments.access import API_KEYS_ENV, Access
from deployments.args import AppArgs

pytestmark = pytest.mark.ray

APP = "secured"
KEYS = ["key-one", "key-two"]
LIMIT = 4096


@pytest.fixture(scope="module")
def base_url(ray_serve, tiny_pair):
    target, draft = tiny_pair
    app = build_app({
        "model": str(target), "draft_model": str(draft), "served_model_name": "tiny",
        "policy": "off", "max_model_len": 128, "num_kv_blocks": 32, "max_num_seqs": 2,
        "num_cpus": 0.5, "torch_threads": 1, "api_keys": ",".join(KEYS),
        "max_body_bytes": LIMIT,
    })
    serve.run(app, name=APP, route_prefix=f"/{APP}")
    yield f"{ray_serve}/{APP}"
    serve.delete(APP)


def complete(base_url: str, key: str) -> str:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    return out.choices[0].text


def test_each_configured_key_is_served(base_url):
    assert all(isinstance(complete(base_url, key), str) for key in KEYS)


def test_a_wrong_or_missing_key_is_a_401(base_url):
    with pytest.raises(openai.AuthenticationError) as caught:
        complete(base_url, "key-three")
    assert caught.value.status_code == 401
    bare = httpx.get(f"{base_url}/v1/models", timeout=30)
    assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
    assert bare.json()["error"]["code"] == "invalid_api_key"


def test_health_needs_no_key(base_url):
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200


def test_a_body_past_the_limit_is_a_413(base_url):
    body = {"model": "tiny", "prompt": "x" * LIMIT, "max_tokens": 1}
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    response = httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_keys_come_from_the_arguments_or_the_environment(monkeypatch):
    assert AppArgs.model_validate({"api_keys": "a, b"}).api_keys == ["a", " b"]
    assert Access.from_settings(["a", " b", ""], LIMIT).api_keys == {"a", "b"}
    monkeypatch.setenv(API_KEYS_ENV, "env-key")
    assert Access.from_settings(None, LIMIT).api_keys == {"env-key"}
    assert Access.from_settings([], LIMIT).api_keys == frozenset()  # explicitly open
    monkeypatch.delenv(API_KEYS_ENV)
    assert not Access.from_settings(None, LIMIT).api_keys
