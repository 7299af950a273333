"""A request as LangChain's ChatOpenAI sends it (its own defaults and field names), against the
real HTTP app in process: the same answer as the official openai client's, streamed and not,
with the logprobs it asks for."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

langchain_openai = pytest.importorskip("langchain_openai")

MODEL = "tiny"
PROMPT = "Hello, world!"
EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def http(local_app):
    with TestClient(local_app) as client:
        yield client


def reference(http) -> str:
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                           max_retries=0)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], temperature=0,
        max_tokens=8, extra_body=EXTRA)
    return answer.choices[0].message.content


def chat_model(http, **kwargs) -> langchain_openai.ChatOpenAI:
    return langchain_openai.ChatOpenAI(
        model=MODEL, base_url="http://testserver/v1", api_key="none", http_client=http,
        temperature=0, max_tokens=8, max_retries=0, extra_body=EXTRA, **kwargs)


def test_invoke_gives_the_openai_clients_answer_with_logprobs(http):
    message = chat_model(http, logprobs=True, top_logprobs=2).invoke(PROMPT)
    assert message.content == reference(http)
    logprobs = message.response_metadata["logprobs"]["content"]
    assert len(logprobs) == message.usage_metadata["output_tokens"] == 8
    assert all(len(entry["top_logprobs"]) == 2 for entry in logprobs)


def test_stream_gives_the_same_text(http):
    chunks = list(chat_model(http, stream_usage=True).stream(PROMPT))
    assert "".join(chunk.content for chunk in chunks) == reference(http)
    usage = [chunk.usage_metadata for chunk in chunks if chunk.usage_metadata]
    assert usage and usage[-1]["output_tokens"] == 8
