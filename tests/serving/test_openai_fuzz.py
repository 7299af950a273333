"""A fuzz of bad bodies against the real HTTP app in process (no Ray): seeded random mutations of
valid completion, chat and Responses API requests (wrong types, out-of-range numbers, unknown and
unsupported fields, missing fields, broken JSON). No body may get a 5xx, every 4xx is an OpenAI
error, and a body that carries an output-changing field this server does not implement is never a
200."""

from __future__ import annotations

import json
import random

import pytest
from fastapi.testclient import TestClient

NUM_BODIES = 450
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 3}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
RESPONSE = {"model": "tiny", "input": "Hi", "max_output_tokens": 3}
BODIES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/v1/responses": RESPONSE}
# fields that would change the output and are not implemented, with values that do not turn
# them off; echo and top_logprobs are implemented by one endpoint each
UNSUPPORTED = {
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
    "functions": [{"name": "f"}], "function_call": "auto",
    "response_format": {"type": "json_object"}, "best_of": 3, "suffix": "end",
    "prompt_logprobs": 1, "min_tokens": 2, "stop_token_ids": [5], "modalities": ["audio"],
}
UNSUPPORTED_BY = {"/v1/chat/completions": {"echo": True}, "/v1/completions": {"top_logprobs": 2}}
# fields both endpoints take, and values inside and outside their ranges
FIELDS = {
    "max_tokens": [1, 5, 0, -3, 10**6], "temperature": [0, 0.7, 2.5, -1],
    "top_p": [0.5, 1, 0, 1.5], "top_k": [-1, 0, 5, -2], "min_p": [0.1, 0, 1, -0.1, 1.1],
    "presence_penalty": [0.5, -2, 2.1, -3], "frequency_penalty": [1, 2, -2.5, 9],
    "repetition_penalty": [1.2, 0.5, 0, -1], "n": [1, 2, 0, 65, -1], "seed": [0, -5, 2**64],
    "stop": ["x", ["a", "b"], [""], ["a"] * 5], "stream": [True, False],
    "ignore_eos": [True, False], "speculation": [{"policy": "off"}, {"max_k": 99}],
    "slo": [{"tpot_ms": 50}, {"ttft_ms": -1}], "stream_options": [{"include_usage": True}],
    "user": ["someone"], "metadata": [{"a": "b"}],
    "logit_bias": [{}, {"5": 10}, {"5": -100.5}, {"x": 1}, {"99999999": 1}, {"5": "a"}],
}
ENDPOINT_FIELDS = {
    "/v1/completions": {"logprobs": [0, 2, 5, 6, -1, True], "echo": [True, False],
                        "prompt": ["", [], ["a", "b"], [[1, 2], [3]], [1, "a"], [[]],
                                   [10**9], [1, 2, 3], 5]},
    "/v1/chat/completions": {"logprobs": [True, False, 1], "top_logprobs": [0, 3, 20, 21, -1],
                             "max_completion_tokens": [2, 0],
                             "messages": [[], [{"role": "tool", "content": "x"}],
                                          [{"role": "user"}], [{"role": "user", "content": 5}],
                                          [{"role": "user", "content": [{"type": "image"}]}]]},
}
RESPONSE_FIELDS = {
    "max_output_tokens": [1, 5, 0, -3, 10**6], "temperature": [0, 0.7, 2.5, -1],
    "top_p": [0.5, 1, 0, 1.5], "stream": [True, False], "instructions": ["Be brief.", "", 5],
    "input": ["", [], 5, [{"role": "user", "content": "x"}], [{"role": "tool", "content": "x"}],
              [{"type": "function_call_output", "output": "x"}], [{"role": "user"}],
              [{"role": "user", "content": [{"type": "input_image"}]}]],
    "speculation": [{"policy": "off"}, {"max_k": 99}], "slo": [{"tpot_ms": 50}, {"ttft_ms": -1}],
    "tool_choice": ["none", "auto"], "store": [True, False], "user": ["someone"],
}
RESPONSE_UNSUPPORTED = {
    "tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
    "text": {"format": {"type": "json_object"}}, "reasoning": {"effort": "low"},
    "previous_response_id": "resp_1", "conversation": "conv_1", "background": True,
    "include": ["reasoning.encrypted_content"], "truncation": "auto", "top_logprobs": 2,
    "prompt": {"id": "p"}, "max_tool_calls": 2,
}
WRONG_TYPES = ["1", None, [], {}, True, 1.5, 10**30, "NaN", -(10**30)]


def mutate(rng: random.Random, path: str, body: dict) -> tuple[bytes, bool]:
    """A mutated body and whether it carries an unsupported output-changing field."""
    body = json.loads(json.dumps(body))
    fields = fields_of(path)
    for _ in range(rng.randint(1, 2)):
        kind = rng.choices(range(7), weights=[6, 3, 2, 2, 1, 1, 1])[0]
        if kind == 0:  # a known field, in or out of its range
            name = rng.choice(sorted(fields))
            body[name] = rng.choice(fields[name])
        elif kind == 1:  # a known field of the wrong type
            body[rng.choice(sorted(fields))] = rng.choice(WRONG_TYPES)
        elif kind == 2:  # an unknown field
            body[f"x_{rng.randrange(1000)}"] = rng.choice(WRONG_TYPES)
        elif kind == 3:  # an unsupported field
            name, value = rng.choice(sorted(unsupported_of(path).items()))
            body[name] = value
        elif kind == 4 and body:  # a missing field
            del body[rng.choice(sorted(body))]
        elif kind == 5:  # broken JSON
            raw = json.dumps(body).encode()
            return raw[: rng.randrange(len(raw))], carries_unsupported(path, body)
        elif kind == 6:  # not an object, or a number JSON cannot hold
            raw = json.dumps(body).replace(": 3", ": 1e999")
            raw = rng.choice([b"[1, 2]", b"null", b'"text"', raw.encode()])
            return raw, carries_unsupported(path, body)
    return json.dumps(body).encode(), carries_unsupported(path, body)


def fields_of(path: str) -> dict[str, list]:
    if path == "/v1/responses":
        return RESPONSE_FIELDS
    return {**FIELDS, **ENDPOINT_FIELDS[path]}


def unsupported_of(path: str) -> dict:
    if path == "/v1/responses":
        return RESPONSE_UNSUPPORTED
    return {**UNSUPPORTED, **UNSUPPORTED_BY[path]}


def carries_unsupported(path: str, body: dict) -> bool:
    return any(body.get(name) == value for name, value in unsupported_of(path).items())


@pytest.fixture(scope="module")
def http(local_app):
    with TestClient(local_app, raise_server_exceptions=False) as client:
        yield client


def test_fuzzed_bodies_get_no_5xx_and_no_silently_ignored_field(http):
    rng = random.Random(31)
    statuses: dict[int, int] = {}
    for i in range(NUM_BODIES):
        path = sorted(BODIES)[i % len(BODIES)]
        content, unsupported = mutate(rng, path, BODIES[path])
        response = http.post(path, content=content, headers={"content-type": "application/json"})
        status = response.status_code
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500 and "engine_failed" not in response.text, (path, content)
        if unsupported:
            assert status != 200, (path, content)
        if status >= 400:
            error = response.json()["error"]
            assert error["message"] and error["type"], response.text
    assert statuses.get(200, 0) >= 40 and statuses.get(400, 0) >= 250, statuses  # both seen


