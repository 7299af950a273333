"""A request continued after its replica died, without Ray: the engine side (a continuation's
tokens, text and usage join the part already sent) and the ingress's RayEngineClient over a fake
handle whose replica dies mid-stream (resumed, refused for a penalised request, bounded)."""

import asyncio
import json

import httpx
import pytest
import torch
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

from deployments import ingress
from deployments.api import QueueFull, build_openai_app
from deployments.continuation import Continuation
from deployments.ingress import RayEngineClient, ReplicaLost
from deployments.serving import GenerateRequest, OpenAIServing, StreamStart
from faser.config import EngineConfig, SpecConfig
from faser.engine.async_engine import AsyncLLMEngine, StreamDelta, TextDeltas
from faser.engine.llm_engine import LLMEngine
from faser.outputs import RequestOutput

MAX_MODEL_LEN = 200
MODEL = "tiny"


@pytest.fixture(scope="module")
def serving(tiny_pair):
    torch.set_num_threads(1)
    target, draft = tiny_pair
    config = EngineConfig(
        model=str(target), draft_model=str(draft), spec=SpecConfig(policy="fixed:2"),
        num_kv_blocks=64, max_num_seqs=4, num_threads=1,
    )
    engine = AsyncLLMEngine(lambda: LLMEngine(config), idle_wait_s=0.01)
    yield OpenAIServing(engine, engine.engine.tokenizer, MAX_MODEL_LEN)
    engine.shutdown()


def greedy(resume=(), stop=(), **kwargs) -> GenerateRequest:
    fields = dict(prompt="Hello, world!", max_tokens=40, temperature=0.0, ignore_eos=True)
    return GenerateRequest("completion", stop=stop, resume_token_ids=tuple(resume),
                           **{**fields, **kwargs})


def run(serving: OpenAIServing, request: GenerateRequest) -> list:
    async def collect():
        return [event async for event in serving.stream(request)]

    return asyncio.run(collect())


def token_ids(deltas: list[StreamDelta]) -> list[int]:
    return [t for delta in deltas for t in delta.token_ids]


def text(deltas: list[StreamDelta]) -> str:
    return "".join(delta.text for delta in deltas)


def client_text(serving: OpenAIServing, ids: list[int], stop: tuple[str, ...] = ()) -> str:
    """The text a client holds once it has these tokens: their text less what TextDeltas holds
    back (a delta may carry several steps' tokens, so cuts between tokens are made here)."""
    decoded = serving.tokenizer.decode(ids, skip_special_tokens=True)
    return TextDeltas(stop).delta(decoded, finished=False)


def test_a_continuation_joins_the_sent_part_exactly(serving):
    """Cut after every token of an undisturbed run: the continuation's tokens and text deltas
    follow on from the client's, usage counts the whole."""
    start, *whole = run(serving, greedy(speculation={"policy": "off"}))
    ids = token_ids(whole)
    assert len(ids) == 40 and "\ufffd" in text(whole)  # split characters to join
    for cut in range(1, 40):
        resumed_start, *rest = run(serving, greedy(ids[:cut]))
        assert resumed_start.num_prompt_tokens == start.num_prompt_tokens
        assert ids[:cut] + token_ids(rest) == ids
        assert client_text(serving, ids[:cut]) + text(rest) == text(whole), cut
        last = rest[-1]
        assert (last.num_output_tokens, last.num_prompt_tokens) == (40, start.num_prompt_tokens)
        assert last.finished and last.finish_reason == "length"


def test_the_sent_texts_decode_leaves_the_answers_text_whole(serving):
    """The stream reads its first output (the whole answer's text, decoded incrementally) before
    it decodes the sent tokens' text for its deltas: that shorter decode once went through the
    same incremental decoder, which grows only, and a repeating answer lost characters."""
    ids = [216, 371] * 10 + [216]
    resumed = Continuation(tuple(ids[:17]), 3, (), serving.tokenizer)

    def output(n: int) -> RequestOutput:
        return RequestOutput("r", [1, 2, 3], ids[17:n], "", False, None)

    resumed.whole(output(19))
    resumed.text_deltas()
    assert resumed.whole(output(21)).text == serving.tokenizer.decode(ids)


def test_a_stop_string_across_the_join_ends_the_continuation(serving):
    _, *whole = run(serving, greedy(speculation={"policy": "off"}))
    ids, full = token_ids(whole), text(whole)
    tokenizer = serving.tokenizer
    for cut in range(2, 39):
        sent = tokenizer.decode(ids[:cut], skip_special_tokens=True)
        stop = full[len(sent) - 2 : len(sent) + 2]  # two characters either side of the join
        if "\ufffd" not in stop and len(stop) == 4 and full.index(stop) == len(sent) - 2:
            break
    else:
        pytest.fail("no cut with a clean stop string across it")
    _, *stopped = run(serving, greedy(stop=(stop,), speculation={"policy": "off"}))
    assert text(stopped) == full[: full.index(stop)] and stopped[-1].finish_reason == "stop"
    _, *rest = run(serving, greedy(ids[:cut], stop=(stop,)))
    assert client_text(serving, ids[:cut], (stop,)) + text(rest) == text(stopped)
    assert rest[-1].finished and rest[-1].finish_reason == "stop"


class DyingResponses:
    """A streaming call whose replica dies after `num_events` events (None: it does not; -1: it
    is refused, every queue being full)."""

    def __init__(self, events, num_events: int | None) -> None:
        self.events = events
        self.num_events = num_events

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.num_events == -1:
            await self.events.aclose()
            raise BackPressureError(num_queued_requests=8, max_queued_requests=8)
        if self.num_events == 0:
            await self.events.aclose()  # the replica's engine went with it
            raise ActorDiedError()
        if self.num_events is not None:
            self.num_events -= 1
        return await anext(self.events)

    def cancel(self) -> None:
        asyncio.ensure_future(self.events.aclose())


class DyingHandle:
    """Stands for the engine deployment's handle: call i dies after deaths[i] events."""

    def __init__(self, serving: OpenAIServing, deaths: list[int]) -> None:
        self.serving = serving
        self.deaths = list(deaths)
        self.requests: list[GenerateRequest] = []
        self.generate = self
        self.model_name = self

    def options(self, stream: bool = False):
        return self

    def remote(self, request=None, **kwargs):
        if request is None:  # model_name.remote()
            return asyncio.sleep(0, MODEL)
        self.requests.append(request)
        num_events = self.deaths.pop(0) if self.deaths else None
        return DyingResponses(self.serving.stream(request), num_events)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(ingress, "BACKOFF_S", (0.0,))


def stream_through(serving, request, deaths) -> tuple[list, DyingHandle]:
    handle = DyingHandle(serving, deaths)

    async def collect():
        return [event async for event in RayEngineClient(handle).stream(request)]

    return asyncio.run(collect()), handle


def test_a_stream_whose_replica_dies_twice_goes_on_as_if_nothing_happened(serving):
    start, *whole = run(serving, greedy())
    (resumed_start, *events), handle = stream_through(serving, greedy(), deaths=[4, 0, 6])
    assert isinstance(resumed_start, StreamStart) and len(handle.requests) == 4
    assert [len(r.resume_token_ids) for r in handle.requests][0] == 0
    assert all(isinstance(e, StreamDelta) for e in events)  # the continuations' starts dropped
    assert {e.request_id for e in events} == {resumed_start.request_id}
    assert token_ids(events) == token_ids(whole) and text(events) == text(whole)
    assert events[-1].num_output_tokens == 40
    assert events[-1].num_prompt_tokens == start.num_prompt_tokens


def test_sampled_requests_continue_and_a_seeded_one_exactly(serving):
    """A seeded request's tokens are races keyed by its seed and their positions
    (faser/layers/race.py): continued after two deaths, it gives the undisturbed answer."""
    sampled = greedy(temperature=1.0)
    events, _ = stream_through(serving, sampled, deaths=[3])
    assert events[-1].finished and events[-1].num_output_tokens == 40
    seeded = greedy(temperature=1.0, seed=5)
    undisturbed = run(serving, seeded)[1:]
    resumed, handle = stream_through(serving, seeded, deaths=[3, 7])
    sent = [len(r.resume_token_ids) for r in handle.requests]
    assert len(sent) == 3 and 0 < sent[1] < sent[2]
    assert token_ids(resumed[1:]) == token_ids(undisturbed)
    assert text(resumed[1:]) == text(undisturbed)
    with pytest.raises(ReplicaLost, match="penalties"):  # they count the output alone
        stream_through(serving, greedy(frequency_penalty=0.5), deaths=[3])
    # lost before any token was sent: served again from the start
    penalised = greedy(temperature=1.0, seed=5, frequency_penalty=0.5)
    retried, _ = stream_through(serving, penalised, deaths=[0, 1])
    assert token_ids(retried[1:]) == token_ids(run(serving, penalised)[1:])


def test_a_continuation_waits_for_room_and_deaths_are_bounded(serving):
    events, handle = stream_through(serving, greedy(), deaths=[3, -1, -1, 5, -1])
    assert len(handle.requests) == 6 and events[-1].num_output_tokens == 40
    with pytest.raises(QueueFull):  # nothing sent yet: a 503 the client may retry
        stream_through(serving, greedy(), deaths=[-1])
    with pytest.raises(ReplicaLost, match="4 times"):
        stream_through(serving, greedy(), deaths=[2, 2, 2, 2])


def test_a_continuation_gives_up_waiting_for_room_after_resume_wait_s(serving, monkeypatch):
    monkeypatch.setattr(ingress, "BACKOFF_S", (0.05,))
    monkeypatch.setattr(ingress, "RESUME_WAIT_S", 0.2)
    with pytest.raises(ReplicaLost, match="no replica took"):
        stream_through(serving, greedy(), deaths=[3] + [-1] * 50)


def post(serving, deaths, body: dict, path: str = "/v1/completions",
         ) -> tuple[httpx.Response, DyingHandle]:
    handle = DyingHandle(serving, deaths)
    app = build_openai_app(RayEngineClient(handle))

    async def send():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body)

    return asyncio.run(send()), handle


def test_over_http_a_non_streamed_answer_is_whole_and_a_lost_stream_ends_cleanly(serving):
    body = {"model": MODEL, "prompt": "Hello, world!", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    undisturbed, _ = post(serving, [], body)
    resumed, handle = post(serving, [5, 3], body)
    assert len(handle.requests) == 3 and resumed.status_code == 200
    assert resumed.json()["choices"] == undisturbed.json()["choices"]
    # the same counts; the continuations may have read the first attempt's blocks from the cache
    usage, again = undisturbed.json()["usage"], resumed.json()["usage"]
    del usage["prompt_tokens_details"], again["prompt_tokens_details"]
    assert again == usage

    penalised = {**body, "frequency_penalty": 0.5, "stream": True}
    lost, _ = post(serving, [4], penalised)
    lines = [line for line in lost.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert (error["type"], error["code"]) == ("internal_error", "engine_failed")
    assert "actor" not in lost.text.lower() and "penalt" not in error["message"]


def test_a_lost_response_stream_ends_with_response_failed(serving):
    """The Responses API's stream, once started, ends a request that cannot be continued (its
    replica died more often than MAX_DEATHS) with its own failure event, no internals in it."""
    body = {"model": MODEL, "input": "Hello, world!", "max_output_tokens": 40, "temperature": 0,
            "stream": True}
    lost, handle = post(serving, [2] * (ingress.MAX_DEATHS + 1), body, "/v1/responses")
    assert lost.status_code == 200 and len(handle.requests) == ingress.MAX_DEATHS + 1
    events = [json.loads(line.removeprefix("data: ")) for line in lost.text.splitlines()
              if line.startswith("data: ")]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "actor" not in lost.text.lower()
