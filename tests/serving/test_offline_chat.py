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


PREFILLED = [{"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": "My favourite colour is"}]


def test_continue_final_message_answers_as_the_served_endpoint(llm, local_app):
    """The conversation is rendered open, inside the assistant's last message (the closed
    rendering goes on from it), and the served chat, /tokenize and LLM.chat all take that
    rendering: the answer is the completion of those very tokens."""
    tokenizer = llm.tokenizer
    open_ids = render_chat(tokenizer, PREFILLED, continue_final_message=True)
    closed = tokenizer.decode(render_chat(tokenizer, PREFILLED, add_generation_prompt=False))
    opened = tokenizer.decode(open_ids)
    assert opened.endswith("My favourite colour is") and closed.startswith(opened)
    assert closed != opened
    with TestClient(local_app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                               max_retries=0)
        answer = client.chat.completions.create(
            model="tiny", messages=PREFILLED, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "continue_final_message": True})
        completion = client.completions.create(
            model="tiny", prompt=open_ids, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True})
        tokens = http.post("/tokenize", json={"model": "tiny", "messages": PREFILLED,
                                              "continue_final_message": True}).json()
    assert answer.usage.prompt_tokens == len(open_ids) == tokens["count"]
    assert answer.choices[0].message.content == completion.choices[0].text
    offline = llm.chat(PREFILLED, GREEDY, continue_final_message=True)[0]
    assert offline.prompt_token_ids == open_ids
    assert offline.text == answer.choices[0].message.content


@pytest.mark.parametrize(("body", "says"), [
    ({"messages": PREFILLED[:1], "continue_final_message": True}, "role is 'user'"),
    ({"messages": PREFILLED, "continue_final_message": True, "add_generation_prompt": True},
     "there is no generation prompt"),
    ({"messages": [PREFILLED[0], {"role": "assistant", "content": " "}],
      "continue_final_message": True}, "holds no text"),
])
def test_a_final_message_that_cannot_be_continued_is_a_400(local_app, llm, body, says):
    with TestClient(local_app) as http:
        response = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                           **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "continue_final_message" and says in error["message"]
    assert error["message"].count("continue_final_message") == 1
    with pytest.raises(ValueError, match=says):
        llm.chat(body["messages"], GREEDY, continue_final_message=True,
                 add_generation_prompt=body.get("add_generation_prompt"))
