"""The Responses API, driven by the official openai client against the real app in process: the
same answers (and logprobs) as the chat endpoint for the same conversation, its typed stream as
the client's own stream helper reads it, and clear 400s for what it does not take."""

from __future__ import annotations

import pytest

INSTRUCTIONS = "Answer briefly."
QUESTION = "def add(a, b):"


def chat(client, messages, max_tokens):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                          temperature=0)


@pytest.mark.parametrize("max_tokens", [3, 40])
def test_a_response_answers_as_the_chat_endpoint(client, max_tokens):
    response = client.responses.create(model="tiny", input=QUESTION, instructions=INSTRUCTIONS,
                                       max_output_tokens=max_tokens, temperature=0)
    answer = chat(client, [{"role": "system", "content": INSTRUCTIONS},
                           {"role": "user", "content": QUESTION}], max_tokens)
    assert response.output_text == answer.choices[0].message.content
    cut = answer.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    assert (response.incomplete_details is not None) == cut
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (
        answer.usage.prompt_tokens, answer.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.id.startswith("resp_") and response.model_extra["speculation"]["policy"]


def test_message_items_are_the_conversation(client):
    items = [
        {"role": "user", "content": "Hello"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hi there"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Again, "},
                                     {"type": "input_text", "text": "please"}]},
    ]
    response = client.responses.create(model="tiny", input=items, max_output_tokens=12,
                                       temperature=0)
    answer = chat(client, [{"role": "user", "content": "Hello"},
                           {"role": "assistant", "content": "Hi there"},
                           {"role": "user", "content": "Again, please"}], 12)
    assert response.output_text == answer.choices[0].message.content


def test_the_stream_is_the_response_in_typed_events(client):
    whole = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=24,
                                    temperature=0)
    with client.responses.stream(model="tiny", input=QUESTION, max_output_tokens=24,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}


def _tokens(logprobs) -> list[tuple]:
    return [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs])
            for lp in logprobs]


def test_logprobs_are_the_chat_endpoints(client):
    response = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=10,
                                       temperature=0, **LOGPROBS)
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": QUESTION}], max_tokens=10,
        temperature=0, logprobs=True, top_logprobs=2)
    content = response.output[0].content[0]
    assert content.text == answer.choices[0].message.content
    assert len(content.logprobs) == response.usage.output_tokens == 10
    assert _tokens(content.logprobs) == _tokens(answer.choices[0].logprobs.content)
    assert all(len(lp.top_logprobs) == 2 for lp in content.logprobs)
    assert response.top_logprobs == 2
    plain = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=10,
                                    temperature=0)
    assert plain.output[0].content[0].logprobs == []


def test_each_delta_carries_its_own_tokens_logprobs(client):
    with client.responses.stream(model="tiny", input=QUESTION, max_output_tokens=16,
                                 temperature=0, **LOGPROBS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert _tokens(deltas) == _tokens(done.logprobs) == _tokens(final.output[0].content[0].logprobs)
    assert len(deltas) == final.usage.output_tokens


@pytest.mark.parametrize(("body", "param"), [
    ({"include": ["reasoning.encrypted_content"]}, "include.0"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({**LOGPROBS, "top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input.0.content.0.type"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_what_it_does_not_take_is_a_400_naming_it(http, body, param):
    response = http.post("/v1/responses", json={"model": "tiny", "input": "Hi", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_switched_off_fields_and_an_unknown_model(http):
    off = {"tools": [], "tool_choice": "auto", "text": {"format": {"type": "text"}},
           "store": False, "truncation": "disabled", "metadata": {"k": "v"}, "reasoning": None}
    ok = http.post("/v1/responses", json={"model": "tiny", "input": "Hi", "max_output_tokens": 2,
                                          **off})
    assert ok.status_code == 200 and ok.json()["object"] == "response"
    missing = http.post("/v1/responses", json={"model": "gpt-5", "input": "Hi"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
