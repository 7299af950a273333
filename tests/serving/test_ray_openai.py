"""The OpenAI API served by Ray Serve on a real local Ray (no mocks), one engine replica over
tiny random-weight models, driven by the official openai client and raw HTTP."""

import concurrent.futures
import json
import time

import httpx
import openai
import pytest
from ray import serve
from transformers import AutoTokenizer

from deployments import build_app

pytestmark = pytest.mark.ray

APP = "api"
MAX_MODEL_LEN = 128
MODEL = "tiny"


@pytest.fixture(scope="module")
def base_url(ray_serve, tiny_pair):
    target, draft = tiny_pair
    app = build_app(
        {
            "model": str(target),
            "draft_model": str(draft),
            "served_model_name": MODEL,
            "policy": "fixed",
            "max_k": 3,
            "max_model_len": MAX_MODEL_LEN,
            "num_kv_blocks": 64,
            "max_num_seqs": 2,
            "max_ongoing_requests": 2,
            "max_queued_requests": 2,
            "num_cpus": 0.5,
            "torch_threads": 1,
            "retry_after_s": 3,
        }
    )
    serve.run(app, name=APP, route_prefix=f"/{APP}")
    yield f"{ray_serve}/{APP}"
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    return AutoTokenizer.from_pretrained(tiny_pair[0])


def engine_blocks() -> dict:
    handle = serve.get_deployment_handle("FaserEngine", app_name=APP)
    return handle.block_usage.remote().result()


def wait_all_blocks_free(timeout_s: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        usage = engine_blocks()
        if usage["num_free_blocks"] == usage["num_total_blocks"] and usage["num_streams"] == 0:
            return usage
        assert time.monotonic() < deadline, f"blocks still held: {usage}"
        time.sleep(0.05)


def test_health_and_models(base_url, client):
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_usage_and_speculation(client, tokenizer):
    prompt = "The quick brown fox"
    done = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
    num_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (num_prompt, 12)
    assert done.usage.total_tokens == num_prompt + 12
    assert done.choices[0].text == tokenizer.decode(tokenizer.encode(done.choices[0].text))
    spec = done.model_extra["speculation"]
    assert spec["policy"] == "fixed" and spec["drafted"] > 0
    assert spec["mean_acceptance_length"] >= 1.0

    plain = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "speculation": {"policy": "off"}},
    )
    # lossless: speculation changes nothing in greedy output
    assert plain.choices[0].text == done.choices[0].text
    assert plain.model_extra["speculation"]["drafted"] == 0
    capped = client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True, "speculation": {"policy": "fixed", "max_k": 1}},
    )
    spec = capped.model_extra["speculation"]
    assert 0 < spec["drafted"] <= 10 and capped.usage.prompt_tokens == 3


def test_a_repeated_prompt_reports_its_cached_tokens(client):
    """The second request reads the first one's full blocks (16 tokens each) from the prefix
    cache, all but the one holding the prompt's last token, and answers the same."""
    prompt = list(range(40, 80))
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                  extra_body={"ignore_eos": True})
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert again.choices[0].text == first.choices[0].text


def test_streamed_completion_equals_non_streamed(client):
    kwargs = dict(model=MODEL, prompt="Hello, world!", max_tokens=16, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_streamed_and_not(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True},
    )
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    num_prompt = len(tokenizer.encode(rendered, add_special_tokens=False))
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (num_prompt, 10)
    assert "speculation" in whole.model_extra

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == num_prompt + 10
    assert chunks[-1].model_extra["speculation"]["drafted"] >= 0


def test_seed_and_stop(client):
    kwargs = dict(model=MODEL, prompt="One two three", max_tokens=24, temperature=1.0,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(seed=7, **kwargs).choices[0].text
    assert client.completions.create(seed=7, **kwargs).choices[0].text == first

    greedy = dict(kwargs, temperature=0)
    text = client.completions.create(**greedy).choices[0].text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stopped = client.completions.create(stop=[stop], **greedy)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]
    streamed = client.completions.create(stop=stop, stream=True, **greedy)
    assert "".join(c.choices[0].text for c in streamed) == text[: text.index(stop)]


BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi"', 400, None),  # malformed JSON
    ("/v1/completions", b'{"model": "tiny"}', 400, "prompt"),  # missing field
    ("/v1/chat/completions", b'{"model": "tiny"}', 400, "messages"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": "8"}', 400,
     "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "temperature": -1}', 400,
     "temperature"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 500}', 400,
     "max_tokens"),
    ("/v1/completions", json.dumps({"model": "tiny", "prompt": list(range(3, 200))}).encode(),
     400, "prompt"),
    ("/v1/chat/completions", json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "word " * 300}]}).encode(),
     400, "messages"),
    ("/v1/completions", b'{"model": "tiny", "prompt": [99999]}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "speculation": {"max_k": 99}}',
     400, "speculation.max_k"),
    ("/v1/completions", b'{"model": "gpt-5", "prompt": "hi"}', 404, "model"),
    ("/v1/completions", b'[1, 2, 3]', 400, None),
]


@pytest.mark.parametrize("path, body, status, param", BAD_REQUESTS)
def test_bad_input_gets_its_status_and_an_openai_error(base_url, path, body, status, param):
    response = httpx.post(f"{base_url}{path}", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_MODEL_LEN * 2)
    wait_all_blocks_free()


def test_client_disconnecting_mid_stream_frees_its_blocks(base_url):
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 100, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        usage = engine_blocks()
        assert usage["num_free_blocks"] < usage["num_total_blocks"]  # still generating
    # the with-block closed the connection mid-stream
    wait_all_blocks_free(timeout_s=5.0)


def test_burst_past_the_queue_gets_503s_and_every_accepted_request_completes(base_url):
    body = {"model": MODEL, "prompt": [9, 10, 11], "max_tokens": 60, "temperature": 0,
            "ignore_eos": True}

    def post(_):
        return httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)

    with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
        responses = list(pool.map(post, range(12)))
    statuses = sorted(r.status_code for r in responses)
    accepted = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 503]
    assert len(accepted) + len(rejected) == 12, statuses
    assert len(accepted) >= 2 and rejected, statuses
    for r in accepted:
        assert r.json()["usage"]["completion_tokens"] == 60
    for r in rejected:
        assert r.headers.get("retry-after") == "3", (r.text, r.headers)
        assert r.json()["error"]["code"] == "queue_full"
    wait_all_blocks_free()


@pytest.mark.parametrize(
    ("field", "value"),
    [("logit_bias", {"5": 101}), ("tools", [{"type": "function", "function": {"name": "f"}}]),
     ("top_logprobs", 2), ("response_format", {"type": "json_object"})],
)
def test_a_field_that_would_change_the_output_is_a_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            **{field: value},
        )
    assert info.value.body["param"] == field


def test_switched_off_fields_and_top_k_are_served(client):
    """As LangChain's ChatOpenAI sends a request: penalties at 0, n = 1, a user id; top_k = 1
    leaves one candidate, so even a sampled request gives the greedy answer."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6,
                  n=1, presence_penalty=0, frequency_penalty=0, user="someone")
    greedy = client.chat.completions.create(temperature=0, **kwargs)
    top1 = client.chat.completions.create(temperature=1.0, seed=3, extra_body={"top_k": 1},
                                          **kwargs)
    assert top1.choices[0].message.content == greedy.choices[0].message.content


def test_choices_and_logprobs_cross_ray(client):
    """n = 2 fans out into two engine requests, each routed on its own; the logprobs' token
    texts come from the replica, which renders and decodes every generation."""
    kwargs = dict(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, n=2, logprobs=2,
                  echo=True, extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    done = client.completions.create(**kwargs)
    assert [c.index for c in done.choices] == [0, 1]
    assert done.choices[0].logprobs == done.choices[1].logprobs  # greedy: the same answer
    assert done.choices[0].text.startswith("Hello") and done.usage.completion_tokens == 10
    streamed = list(client.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == 0)
    assert text == done.choices[0].text
    wait_all_blocks_free()


def test_tokenize_detokenize_and_version_in_vllms_shapes(base_url, client, tokenizer):
    prompt = "hello world"
    tokens = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": prompt}).json()
    assert tokens["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]})
    assert text.json() == {"prompt": prompt}
    messages = [{"role": "user", "content": "hello"}]
    chat = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": messages}).json()
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens  # what the chat endpoint itself renders
    assert httpx.get(f"{base_url}/version").json()["version"]


def test_tokenize_errors_name_what_is_wrong(base_url):
    bad_id = httpx.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": [10**9]})
    assert bad_id.status_code == 400 and bad_id.json()["error"]["param"] == "tokens"
    both = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": "a", "messages": []})
    assert both.status_code == 400
    other = httpx.post(f"{base_url}/tokenize", json={"model": "nope", "prompt": "a"})
    assert other.status_code == 404


def test_the_responses_api_through_serve(client):
    """/v1/responses over Serve's proxy and the ingress: the chat endpoint's greedy answer, and
    the same answer in the typed stream, every block freed after."""
    question = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model=MODEL, messages=question, max_tokens=6,
                                          temperature=0)
    response = client.responses.create(model=MODEL, input=question, max_output_tokens=6,
                                       temperature=0)
    assert response.output_text == chat.choices[0].message.content
    events = list(client.responses.create(model=MODEL, input="Hello", max_output_tokens=6,
                                          temperature=0, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == response.output_text
    assert events[-1].type == f"response.{response.status}"
    wait_all_blocks_free()
