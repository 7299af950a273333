"""`LLM.chat` renders a conversation as the OpenAI server does, so the offline engine and the
served chat endpoint give the same greedy answer to the same conversation."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from faser import LLM, SamplingParams, SpecConfig
from faser.chat import render_chat

CONVERSATIONS = [
    [{"role": "user", "content": "Hello, world!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"},
     {"role": "assistant", "content": "return a + b"}, {"role": "user", "content": "Again"}],
]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_pair):
    target, draft = tiny_pair
    return LLM(str(target), str(draft), spec=SpecConfig(policy="fixed:3"), num_kv_blocks=128,
               max_num_seqs=4, num_threads=1)


def test_chat_answers_as_the_served_chat_endpoint(llm, local_app):
    with TestClient(local_app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                               max_retries=0)
        served = [client.chat.completions.create(
            model="tiny", messages=c, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].message.content for c in CONVERSATIONS]
    offline = llm.chat(CONVERSATIONS, GREEDY)
    assert [o.text for o in offline] == served
    assert [o.prompt_token_ids for o in offline] == [
        render_chat(llm.tokenizer, c) for c in CONVERSATIONS]
    assert llm.chat(CONVERSATIONS[1], GREEDY)[0].text == served[1]  # one conversation alone


def test_chat_without_a_template_or_messages_says_so(llm, monkeypatch):
    with pytest.raises(ValueError, match="messages must not be empty"):
        llm.chat([], GREEDY)
    with pytest.raises(ValueError, match="at least one message"):
        llm.chat([CONVERSATIONS[0], []], GREEDY)
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(CONVERSATIONS[0], GREEDY)
