"""The OpenAI features of issue 31 over the real HTTP app, in process (no Ray): the official
openai client against build_openai_app over a LocalEngineClient, on tiny random-weight models.
Each feature once, streamed and not: logprobs (chat and completions), top_logprobs, echo with
prompt logprobs, n, batched prompts, penalties and min_p."""

from __future__ import annotations

import math

import openai
import pytest

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Hello, world!"}]
GREEDY = dict(model=MODEL, temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


def off(extra: dict | None = None) -> dict:
    """Speculation off for this request: the reference the speculating answers must equal."""
    return {"ignore_eos": True, "speculation": {"policy": "off"}, **(extra or {})}


def test_chat_logprobs_equal_with_and_without_speculation(client):
    kwargs = dict(GREEDY, messages=MESSAGES, logprobs=True, top_logprobs=3)
    spec = client.chat.completions.create(**kwargs)
    plain = client.chat.completions.create(**{**kwargs, "extra_body": off()})
    assert spec.model_extra["speculation"]["drafted"] > 0
    content = spec.choices[0].logprobs.content
    assert [c.model_dump() for c in content] == [
        c.model_dump() for c in plain.choices[0].logprobs.content
    ]
    assert "".join(c.token for c in content) == spec.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.logprob >= entry.top_logprobs[-1].logprob  # greedy: the likeliest
        assert entry.bytes == list(entry.token.encode())
    streamed = client.chat.completions.create(stream=True, **kwargs)
    chunks = [c for c in streamed if c.choices and c.choices[0].logprobs]
    flat = [e.model_dump() for c in chunks for e in c.choices[0].logprobs.content]
    assert flat == [c.model_dump() for c in content]


def test_chat_without_top_logprobs_and_top_logprobs_alone(client, http):
    done = client.chat.completions.create(messages=MESSAGES, logprobs=True, **GREEDY)
    assert all(c.top_logprobs == [] for c in done.choices[0].logprobs.content)
    assert client.chat.completions.create(messages=MESSAGES, **GREEDY).choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(messages=MESSAGES, top_logprobs=2, **GREEDY)
    assert info.value.body["param"] == "top_logprobs"


def test_completion_logprobs_streamed_and_not(client):
    kwargs = dict(GREEDY, prompt="The quick brown fox", logprobs=2)
    done = client.completions.create(**kwargs)
    plain = client.completions.create(**{**kwargs, "extra_body": off()})
    lp = done.choices[0].logprobs
    assert lp == plain.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob and 1 <= len(top) <= 3
    chunks = list(client.completions.create(stream=True, **kwargs))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.token_logprobs] == lp.token_logprobs
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_echo_with_prompt_logprobs(client):
    prompt = "One two three four"
    done = client.completions.create(**dict(GREEDY, prompt=prompt, echo=True, logprobs=1))
    choice = done.choices[0]
    num_prompt = done.usage.prompt_tokens
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == num_prompt + 8
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:num_prompt]) == prompt
    assert lp.token_logprobs[num_prompt:] == client.completions.create(
        **dict(GREEDY, prompt=prompt, logprobs=1)).choices[0].logprobs.token_logprobs
    streamed = list(client.completions.create(stream=True, **dict(
        GREEDY, prompt=prompt, echo=True, logprobs=1)))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    echo_only = client.completions.create(**dict(GREEDY, prompt=prompt, echo=True))
    assert echo_only.choices[0].text == choice.text and echo_only.choices[0].logprobs is None


def test_max_tokens_zero_answers_with_the_prompt_scored(client, http):
    """The legacy API's way to score text (lm-eval's older loglikelihood body): echo with
    max_tokens 0 gives the prompt and its logprobs, and generates nothing."""
    prompt = "One two three four"
    scored = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=10,
                                       max_tokens=0)
    choice, num_prompt = scored.choices[0], scored.usage.prompt_tokens
    assert choice.text == prompt and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    longer = client.completions.create(**dict(GREEDY, prompt=prompt, echo=True, logprobs=10))
    assert choice.logprobs.token_logprobs == longer.choices[0].logprobs.token_logprobs[:num_prompt]
    assert choice.logprobs.tokens == longer.choices[0].logprobs.tokens[:num_prompt]
    # keyed by text, so tokens that decode alike share an entry
    assert all(5 < len(top) <= 11 for top in choice.logprobs.top_logprobs[1:])
    streamed = list(client.completions.create(model=MODEL, prompt=[prompt, "Five"], echo=True,
                                              max_tokens=0, stream=True))
    texts = {}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: prompt, 1: "Five"}
    assert streamed[-1].choices[0].finish_reason == "length"
    refused = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    chat = http.post("/v1/chat/completions",
                     json={"model": MODEL, "messages": MESSAGES, "max_tokens": 0})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_tokens"


def test_loglikelihood_as_lm_eval_asks_for_it(http):
    """lm-eval's local-completions loglikelihood body: a batch of token-id prompts, echoed with
    one logprob each and one generated token."""
    prompts = [[5, 6, 7, 8], [9, 10]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 1, "temperature": 0,
            "logprobs": 1, "echo": True, "seed": 1234}
    answer = http.post("/v1/completions", json=body).json()
    for prompt, choice in zip(prompts, answer["choices"], strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(prompt) + 1
        assert logprobs["token_logprobs"][0] is None
        assert all(len(top) in (1, 2) for top in logprobs["top_logprobs"][1:])


def test_n_choices_and_seeds(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=5,
                  n=3, extra_body={"ignore_eos": True})
    done = client.chat.completions.create(**kwargs)
    assert [c.index for c in done.choices] == [0, 1, 2]
    texts = [c.message.content for c in done.choices]
    assert len(set(texts)) > 1  # choice j draws with seed + j
    assert done.usage.completion_tokens == 36
    single = client.chat.completions.create(**{**kwargs, "n": 1, "seed": 6})
    assert single.choices[0].message.content == texts[1]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = {i: "" for i in range(3)}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert [streamed[i] for i in range(3)] == texts
    finals = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finals) == [0, 1, 2]


def test_batched_prompts_are_prompt_major(client):
    prompts = ["The quick brown fox", "Hello, world!"]
    done = client.completions.create(**dict(GREEDY, prompt=prompts, n=2))
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(**dict(GREEDY, prompt=p)).choices[0].text
             for p in prompts]
    assert [c.text for c in done.choices] == [alone[0], alone[0], alone[1], alone[1]]
    ids = client.completions.create(**dict(GREEDY, prompt=[[5, 6, 7], [8, 9]]))
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    chunks = list(client.completions.create(stream=True, **dict(GREEDY, prompt=prompts)))
    streamed = ["", ""]
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == alone


@pytest.mark.parametrize("penalty", [
    {"presence_penalty": 1.5}, {"frequency_penalty": 2.0}, {"repetition_penalty": 3.0},
])
def test_penalties_change_greedy_output_and_stay_lossless(client, penalty):
    kwargs = dict(GREEDY, prompt=[5, 6, 7, 5, 6, 7], max_tokens=24)
    plain = client.completions.create(**kwargs).choices[0].text
    body = dict(kwargs, extra_body={"ignore_eos": True, **penalty})
    penalised = client.completions.create(**body)
    assert penalised.choices[0].text != plain
    assert penalised.model_extra["speculation"]["drafted"] > 0
    reference = client.completions.create(**dict(kwargs, extra_body=off(penalty)))
    assert penalised.choices[0].text == reference.choices[0].text
    streamed = client.completions.create(stream=True, **body)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == reference.choices[0].text


def test_min_p_one_leaves_only_the_likeliest_token(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=8, seed=1)
    greedy = client.chat.completions.create(temperature=0, extra_body={"ignore_eos": True},
                                            **kwargs)
    sampled = client.chat.completions.create(temperature=1.5, **kwargs,
                                             extra_body={"min_p": 1.0, "ignore_eos": True})
    assert sampled.choices[0].message.content == greedy.choices[0].message.content
    loose = client.chat.completions.create(temperature=1.5, stream=True, **kwargs,
                                           extra_body={"min_p": 0.0, "ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in loose if c.choices) != (
        greedy.choices[0].message.content)


def test_logprobs_are_finite_json(http):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "logprobs": 5, "echo": True}
    answer = http.post("/v1/completions", json=body).json()
    values = [v for v in answer["choices"][0]["logprobs"]["token_logprobs"] if v is not None]
    assert values and all(math.isfinite(v) for v in values)


def test_a_model_is_looked_up_and_unknown_routes_answer_in_openai_shape(client, http):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("org/other")
    assert missing.value.body["code"] == "model_not_found"
    for method, path, status in [("GET", "/v1/embeddings", 404), ("GET", "/v1/chat/completions",
                                                                  405)]:
        response = http.request(method, path)
        assert response.status_code == status
        assert path in response.json()["error"]["message"]
    assert http.request("GET", "/v1/completions").headers["allow"] == "POST"


def test_logit_bias_steers_greedy_answers_and_stays_lossless(client, http):
    bias = {"7": 2.0, "11": 1.5, "13": -100}
    plain = client.completions.create(prompt="Hello", **GREEDY)
    spec = client.completions.create(prompt="Hello", **GREEDY, logit_bias=bias)
    reference = client.completions.create(prompt="Hello", **{**GREEDY, "extra_body": off()},
                                          logit_bias=bias)
    assert spec.choices[0].text == reference.choices[0].text != plain.choices[0].text
    assert spec.model_extra["speculation"]["drafted"] > 0
    forced = client.chat.completions.create(messages=MESSAGES, **GREEDY, logit_bias={"7": 100},
                                            logprobs=True)
    seven = http.post("/detokenize", json={"model": "tiny", "tokens": [7]}).json()["prompt"]
    assert [c.token for c in forced.choices[0].logprobs.content] == [seven] * 8


def test_a_top_k_past_any_vocabulary_is_a_400_not_a_failed_step(http):
    """10**30 once reached the step, overflowed its int64 tensor and failed every request in
    it; any top_k up to MAX_TOP_K is taken (past the vocabulary it cuts nothing)."""
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    response = http.post("/v1/completions", json={**body, "top_k": 10**30})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_k"
    assert http.post("/v1/completions", json={**body, "top_k": 2**31 - 1}).status_code == 200


@pytest.mark.parametrize(("bias", "says"), [
    ({"x": 1}, "token ids written as integers"), ({"5": 101}, "lies in [-100, 100]"),
    ({"99999999": 1}, "outside the vocabulary"),
    ({str(i): 1 for i in range(301)}, "at most 300"),
])
def test_a_bad_logit_bias_is_a_400_naming_it(http, bias, says):
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi",
                                                  "max_tokens": 2, "logit_bias": bias})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "logit_bias" and says in error["message"], error
