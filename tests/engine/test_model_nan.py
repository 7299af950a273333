"""A request the model gives a NaN for (its prompt, or its own greedy output, feeds a token whose
embedding is NaN) fails alone with finish_reason "error", under every policy and whatever its
sampling; the other requests of its steps keep their exact output, and no KV block leaks."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import NamedTuple

import pytest

from faser import LLM, SamplingParams, SpecConfig
from faser.config import EngineConfig
from faser.engine.async_engine import MODEL_OUTPUT_NOT_FINITE, AsyncLLMEngine, ModelOutputNotFinite
from faser.engine.llm_engine import LLMEngine
from tests.engine.tiny import make_checkpoint, make_noisy_copy, poison_token
from tests.spec_decode.spec_profiles import roofline

HEALTHY = [[5, 6, 7], [40, 41, 42, 43]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)  # no seed
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)


class Poisoned(NamedTuple):
    target: Path
    draft: Path
    token: int  # whose embedding each engine sets to NaN (poison_token)
    reaching: list[int]  # a prompt without it whose greedy output reaches it
    reached: list[int]  # that output through the poisoned token: what plain decoding commits


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Poisoned:
    """The poisoned token: one that a prompt's greedy output feeds after two tokens at least (and
    not as its last) and that neither the healthy prompts nor their outputs hold."""
    root = tmp_path_factory.mktemp("nan")
    target = make_checkpoint(root / "target", "mha_untied")  # its head keeps no NaN row
    draft = make_noisy_copy(target, root / "draft", noise=0.3)  # its own weights: never NaN
    clean = LLM(str(target), num_kv_blocks=64, block_size=4, dtype="float32")
    healthy = {t for p, o in zip(HEALTHY, clean.generate(HEALTHY, GREEDY), strict=True)
               for t in p + o.token_ids}
    for first in range(60, 97):
        prompt = [first, first - 30, 3]
        reached = clean.generate([prompt], GREEDY)[0].token_ids[:-1]
        # two tokens before it at least: a paced stream then holds some back (see below)
        token = next((t for t in reached[2:]
                      if t not in healthy and t not in prompt + reached[:2]), None)
        if token is not None:
            return Poisoned(target, draft, token, prompt, reached[: reached.index(token) + 1])
    raise AssertionError("no prompt's greedy output reaches a token to poison")


def poisoned(engine: LLMEngine, token: int) -> LLMEngine:
    poison_token(engine, token)
    return engine


def engine(pair: Poisoned, policy: str) -> LLM:
    llm = LLM(str(pair.target), draft_model=str(pair.draft), spec=SpecConfig(policy=policy),
              num_kv_blocks=64, block_size=4, dtype="float32")
    llm.engine.speculator.use_cost_profile(roofline())  # so that faser speculates on tiny models
    poison_token(llm.engine, pair.token)
    return llm


@pytest.mark.parametrize("policy", ["off", "fixed:2", "faser"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED, SEEDED], ids=["greedy", "sampled", "seeded"])
def test_a_request_with_a_nan_fails_alone(pair, policy, params):
    llm = engine(pair, policy)
    alone = [o.token_ids for o in llm.generate(HEALTHY, GREEDY)]
    prompts = [[1, 2, pair.token, 4], pair.reaching, *HEALTHY]
    outputs = llm.generate(prompts, [params, GREEDY, GREEDY, GREEDY])
    assert [o.finish_reason for o in outputs] == ["error", "error", "length", "length"]
    assert outputs[0].token_ids == []  # its prompt's last row was NaN already
    assert outputs[1].token_ids == pair.reached  # whatever was drafted beyond
    assert [o.token_ids for o in outputs[2:]] == alone
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    assert not llm.engine.has_unfinished_requests()


def test_the_failure_comes_after_the_tokens_before_the_nan(pair):
    """Greedy and unspeculated: the request commits every token up to the poisoned one, whose
    row (the first to read it) fails it."""
    out = engine(pair, "off").generate([pair.reaching], GREEDY)[0]
    assert out.finish_reason == "error" and out.token_ids == pair.reached


def test_its_stream_fails_while_the_others_finish(pair):
    """In the async engine (the served path), the request's stream raises, after the tokens it
    had, and the stream beside it ends as it would alone."""
    config = EngineConfig(model=str(pair.target), draft_model=str(pair.draft), num_kv_blocks=64,
                          block_size=4, dtype="float32", num_threads=1)
    engine = AsyncLLMEngine(lambda: poisoned(LLMEngine(config), pair.token), idle_wait_s=0.01)

    async def collect(request_id: str, prompt: list[int]) -> list:
        return [out async for out in engine.generate(request_id, prompt, GREEDY)]

    async def run():
        return await asyncio.gather(collect("bad", pair.reaching), collect("good", HEALTHY[0]),
                                    return_exceptions=True)

    try:
        failed, served = asyncio.run(run())
        alone = asyncio.run(collect("alone", HEALTHY[0]))
    finally:
        engine.shutdown()
    assert isinstance(failed, ModelOutputNotFinite) and str(failed) == MODEL_OUTPUT_NOT_FINITE
    assert served[-1].finish_reason == "length"
    assert served[-1].token_ids == alone[-1].token_ids


def test_a_paced_stream_hands_over_its_tokens_before_the_failure(pair):
    """A stream that holds its outputs back (a stream interval longer than the request) gets the
    failure queued right behind its tokens: it still yields every token the request committed,
    and raises only after them."""
    config = EngineConfig(model=str(pair.target), draft_model=str(pair.draft), num_kv_blocks=64,
                          block_size=4, dtype="float32", num_threads=1)
    paced = AsyncLLMEngine(lambda: poisoned(LLMEngine(config), pair.token), idle_wait_s=0.01,
                           stream_interval_s=60.0)
    outputs = failed_stream(paced, pair.reaching, {"policy": "off"})
    assert len(outputs) == 2  # the first token at once, the others held until the failure
    assert sum((o.new_token_ids for o in outputs), []) == pair.reached


def test_a_nan_past_a_rejected_draft_token_fails_nothing(pair):
    """Plain decoding never feeds a draft token the target rejects, so a NaN row behind one is
    never read: here the draft's first guess is a poisoned token that the target does not
    choose, and the request's output is plain decoding's, to the end."""
    clean = LLM(str(pair.target), num_kv_blocks=64, block_size=4, dtype="float32")
    draft_alone = LLM(str(pair.draft), num_kv_blocks=64, block_size=4, dtype="float32")
    one = SamplingParams(max_tokens=1, temperature=0.0)
    for first in range(5, 60):
        prompt = [first, 3]
        plain = clean.generate([prompt], GREEDY)[0].token_ids
        guess = draft_alone.generate([prompt + plain[:1]], one)[0].token_ids[0]
        if guess not in prompt + plain:  # so the target rejects it, and never reaches it
            break
    else:
        raise AssertionError("the draft agrees with the target on every prompt")
    llm = LLM(str(pair.target), draft_model=str(pair.draft), spec=SpecConfig(policy="fixed:3"),
              num_kv_blocks=64, block_size=4, dtype="float32", draft_weights="same")
    poison_token(llm.engine, guess)
    out = llm.generate([prompt], GREEDY)[0]
    assert out.finish_reason == "length" and out.token_ids == plain
    assert out.spec_stats.num_draft_tokens > 0


def test_a_stream_gets_the_tokens_committed_in_the_step_that_fails(pair):
    """With the target as its own draft, the request's last step accepts every draft token up
    to the poisoned one and fails at the row that reads it: that step commits tokens and fails
    the request at once, and its stream yields those tokens before it raises."""
    config = EngineConfig(model=str(pair.target), draft_model=str(pair.target), num_kv_blocks=64,
                          block_size=4, dtype="float32", num_threads=1, draft_weights="same",
                          spec=SpecConfig(policy="fixed:3"))
    engine = AsyncLLMEngine(lambda: poisoned(LLMEngine(config), pair.token), idle_wait_s=0.01)
    outputs = failed_stream(engine, pair.reaching)
    assert len(outputs[-1].new_token_ids) > 1  # the failing step's tokens, in one output
    assert sum((o.new_token_ids for o in outputs), []) == pair.reached


def failed_stream(engine: AsyncLLMEngine, prompt: list[int], speculation: dict | None = None):
    """The outputs a greedy stream of `prompt` yields before it raises ModelOutputNotFinite, as
    it must; shuts the engine down."""
    outputs = []

    async def run():
        async for out in engine.generate("bad", prompt, GREEDY, speculation):
            outputs.append(out)

    try:
        with pytest.raises(ModelOutputNotFinite):
            asyncio.run(run())
    finally:
        engine.shutdown()
    return outputs
