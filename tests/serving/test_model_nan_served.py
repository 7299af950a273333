"""A request the model gives a NaN for, over the real HTTP app in process (no Ray), through the
official openai client: it fails with an error of its own (code `model_output_not_finite`, which
says that sending it again fails again), before its first token and after some, streamed and
not; a healthy request on the same server is answered as before."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import openai
import pytest

from tests.engine.tiny import poison_token
from tests.fixtures.local_app import local_openai_app

MODEL = "tiny"
GREEDY = dict(model=MODEL, temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
CODE = "model_output_not_finite"


class Poisoned(NamedTuple):
    target: Path
    draft: Path
    token: int  # whose embedding the served engine sets to NaN (poison_token)
    reaching: list[int]  # a prompt without it whose greedy answer feeds it after a few tokens
    healthy: list[int]  # a prompt whose answer never feeds it
    healthy_text: str  # that answer


@pytest.fixture(scope="module")
def poisoned(tiny_pair) -> Poisoned:
    from faser import LLM, SamplingParams

    target, draft = tiny_pair
    params = SamplingParams(max_tokens=GREEDY["max_tokens"], temperature=0.0, ignore_eos=True)
    clean = LLM(str(target), num_kv_blocks=64, block_size=4, dtype="float32")
    prompts = [[5 + i, 40 + 2 * i, 7] for i in range(12)]
    outputs = clean.generate(prompts, params)
    answers = [o.token_ids for o in outputs]
    for prompt, answer in zip(prompts, answers, strict=True):
        token = answer[2]
        if token in prompt or token in answer[:2]:
            continue
        healthy = next((i for i, (p, a) in enumerate(zip(prompts, answers, strict=True))
                        if token not in p + a), None)
        if healthy is not None:
            return Poisoned(target, draft, token, prompt, prompts[healthy],
                            outputs[healthy].text)
    raise AssertionError("no prompt's greedy answer feeds a token another answer avoids")


@pytest.fixture(scope="module")
def client(poisoned):
    from fastapi.testclient import TestClient

    gen = local_openai_app((poisoned.target, poisoned.draft),
                           prepare=lambda engine: poison_token(engine, poisoned.token))
    app = next(gen)
    with TestClient(app, raise_server_exceptions=False) as http:  # a 500 is an answer here
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                            max_retries=0)
    next(gen, None)  # shuts the engine down


def test_a_prompt_holding_the_token_fails_before_any_token(client, poisoned):
    prompt = [1, 2, poisoned.token, 4]
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(prompt=prompt, **GREEDY)
    assert info.value.body["code"] == CODE
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(prompt=prompt, stream=True, **GREEDY)
    assert info.value.body["code"] == CODE


def test_an_answer_reaching_the_token_fails_after_its_tokens(client, poisoned):
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(prompt=poisoned.reaching, **GREEDY)
    assert info.value.body["code"] == CODE
    chunks = []
    with pytest.raises(openai.APIError) as info:
        for chunk in client.completions.create(prompt=poisoned.reaching, stream=True, **GREEDY):
            chunks.append(chunk)
    assert info.value.body["code"] == CODE
    assert "".join(c.choices[0].text for c in chunks)  # the tokens before the NaN came first


def test_a_healthy_request_is_answered_as_before(client, poisoned):
    done = client.completions.create(prompt=poisoned.healthy, **GREEDY)
    assert done.choices[0].finish_reason == "length"
    assert done.choices[0].text == poisoned.healthy_text
