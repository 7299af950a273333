"""The `slo` extension from the HTTP body to the engine and back, without Ray: the schema, the
deployment's default (AppArgs), the request's own fields winning, and `speculation.slo_met`."""

import asyncio

import pytest
import torch
from pydantic import ValidationError

from deployments.api import to_generate_request
from deployments.args import AppArgs
from deployments.openai_schemas import ChatCompletionRequest, CompletionRequest
from deployments.responses import speculation_report
from deployments.serving import GenerateRequest, OpenAIServing, RequestError, StreamStart
from faser.config import EngineConfig, SpecConfig
from faser.engine.async_engine import AsyncLLMEngine, StreamDelta
from faser.engine.llm_engine import LLMEngine


def test_slo_field_parses_and_reaches_the_generate_request():
    request = CompletionRequest.model_validate_json(
        b'{"model": "m", "prompt": "hi", "slo": {"tpot_ms": 50, "ttft_ms": 0.5}}'
    )
    assert to_generate_request(request).slo == {"tpot_ms": 50.0, "ttft_ms": 0.5}
    chat = ChatCompletionRequest.model_validate_json(
        b'{"model": "m", "messages": [{"role": "user", "content": "a"}], "slo": {}}'
    )
    assert to_generate_request(chat).slo is None


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "prompt": "hi", "slo": {"tpot_ms": 0}}',
        b'{"model": "m", "prompt": "hi", "slo": {"ttft_ms": -1}}',
        b'{"model": "m", "prompt": "hi", "slo": {"tpot_ms": "50"}}',
        b'{"model": "m", "prompt": "hi", "slo": 50}',
    ],
)
def test_bad_slo_bodies_are_rejected(body):
    with pytest.raises(ValidationError, match="slo"):
        CompletionRequest.model_validate_json(body)


def test_deployment_default_slo():
    assert AppArgs().default_slo() is None
    args = AppArgs.model_validate({"slo_tpot_ms": "40"})
    assert args.default_slo() == {"tpot_ms": 40.0}
    with pytest.raises(ValidationError, match="slo_ttft_ms"):
        AppArgs.model_validate({"slo_ttft_ms": 0})


@pytest.fixture(scope="module")
def engine(tiny_pair):
    torch.set_num_threads(1)
    target, draft = tiny_pair
    config = EngineConfig(
        model=str(target), draft_model=str(draft), spec=SpecConfig(policy="fixed:2"),
        num_kv_blocks=64, max_num_seqs=4, num_threads=1,
    )
    async_engine = AsyncLLMEngine(lambda: LLMEngine(config), idle_wait_s=0.01)
    yield async_engine
    async_engine.shutdown()


async def last_delta(serving: OpenAIServing, request: GenerateRequest) -> StreamDelta:
    events = [e async for e in serving.stream(request)]
    assert isinstance(events[0], StreamStart), events[0]
    assert isinstance(events[-1], StreamDelta) and events[-1].finished
    return events[-1]


def test_default_slo_applies_and_the_request_wins(engine):
    serving = OpenAIServing(engine, None, 200, default_slo={"ttft_ms": 1e6, "tpot_ms": 1e6})

    def request(slo=None):
        return GenerateRequest("completion", prompt=[1, 2, 3], max_tokens=6, temperature=0.0,
                               slo=slo)

    async def run():
        plain = OpenAIServing(engine, None, 200)
        return (
            await last_delta(serving, request()),
            await last_delta(serving, request({"tpot_ms": 1e-3})),
            await last_delta(plain, request()),
        )

    default, own, none = asyncio.run(run())
    assert speculation_report(default, "fixed").slo_met is True  # the deployment's loose SLO
    assert speculation_report(own, "fixed").slo_met is False  # its own impossible TPOT
    assert speculation_report(none, "fixed").slo_met is None
    assert engine.engine.stats.num_slo_requests == 2


def test_bad_slo_reaches_the_client_as_a_400(engine):
    serving = OpenAIServing(engine, None, 200, default_slo={"tbt_ms": 5})

    async def run():
        return [e async for e in serving.stream(GenerateRequest("completion", prompt=[1, 2]))]

    events = asyncio.run(run())
    assert isinstance(events[0], RequestError) and events[0].status == 400
    assert "tbt_ms" in events[0].message
