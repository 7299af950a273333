"""The async engine over the real engine on tiny random-weight models: concurrent streams,
validation before the stream starts, and an abandoned stream freeing its KV blocks at once."""

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from faser.config import EngineConfig, SpecConfig
from faser.engine.async_engine import AsyncLLMEngine
from faser.engine.llm_engine import LLMEngine
from faser.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_pair):
    torch.set_num_threads(1)
    target, draft = tiny_pair
    config = EngineConfig(
        model=str(target),
        draft_model=str(draft),
        spec=SpecConfig(policy="fixed", num_speculative_tokens=3),
        num_kv_blocks=64,
        max_num_seqs=4,
        num_threads=1,
    )
    async_engine = AsyncLLMEngine(lambda: LLMEngine(config), idle_wait_s=0.01)
    yield async_engine
    async_engine.shutdown()


async def collect(engine, request_id, prompt, params, spec=None):
    return [out async for out in engine.generate(request_id, prompt, params, spec)]


async def wait_until(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@contextlib.contextmanager
def tiny_engine(tiny_pair, **fields) -> Iterator[AsyncLLMEngine]:
    """An async engine of its own over the tiny pair, shut down after."""
    target, draft = tiny_pair
    config = EngineConfig(model=str(target), draft_model=str(draft), num_kv_blocks=64,
                          num_threads=1, **fields)
    engine = AsyncLLMEngine(lambda: LLMEngine(config), idle_wait_s=0.01)
    try:
        yield engine
    finally:
        engine.shutdown()


def test_concurrent_streams_finish_and_free_their_blocks(engine):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def run():
        return await asyncio.gather(
            collect(engine, "a", [3, 4, 5, 6], greedy),
            collect(engine, "b", "Hello world", greedy, {"policy": "off"}),
            collect(engine, "c", [7, 8], SamplingParams(max_tokens=5, seed=3, ignore_eos=True)),
        )

    a, b, c = asyncio.run(run())
    assert [len(x[-1].token_ids) for x in (a, b, c)] == [12, 12, 5]
    assert all(x[-1].finished and x[-1].finish_reason == "length" for x in (a, b, c))
    # each step's new tokens add up to the whole output
    assert sum((o.new_token_ids for o in a), []) == a[-1].token_ids
    assert b[-1].spec_stats.num_draft_tokens == 0
    assert engine.engine.num_free_blocks == engine.engine.num_total_blocks


def test_bad_request_raises_before_the_stream_starts(engine):
    too_long = SamplingParams(max_tokens=engine.engine.max_model_len)
    with pytest.raises(ValueError, match="max_tokens"):
        asyncio.run(collect(engine, "bad", [1, 2, 3], too_long))
    with pytest.raises(ValueError, match="speculation"):
        asyncio.run(collect(engine, "bad2", [1, 2], SamplingParams(), {"nonsense": 1}))
    assert engine.num_streams == 0


def test_abandoned_stream_aborts_and_frees_blocks_at_once(engine):
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def run():
        stream = engine.generate("leaver", list(range(3, 40)), long)
        first = await anext(stream)
        assert not first.finished
        assert engine.engine.num_free_blocks < engine.engine.num_total_blocks
        await stream.aclose()  # what a disconnecting client does
        total = engine.engine.num_total_blocks
        await wait_until(lambda: engine.engine.num_free_blocks == total, timeout_s=2.0)
        await wait_until(lambda: not engine.engine.has_unfinished_requests(), timeout_s=2.0)

    asyncio.run(run())
    assert engine.num_streams == 0


def test_a_slow_consumer_gets_the_steps_it_missed_as_one_output(engine):
    """Outputs that queue up while the consumer is busy come as one, the newest, with all their
    tokens as its new ones: fewer deltas, the same tokens."""
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    async def run(pause_s: float):
        outputs = []
        async for out in engine.generate(f"slow{pause_s}", [3, 4, 5, 6], greedy, {"policy": "off"}):
            outputs.append(out)
            await asyncio.sleep(pause_s)  # the engine steps on meanwhile
        return outputs

    fast, slow = asyncio.run(run(0.0)), asyncio.run(run(0.3))
    assert len(slow) < len(fast)
    assert sum((o.new_token_ids for o in slow), []) == slow[-1].token_ids
    assert slow[-1].token_ids == fast[-1].token_ids


def test_a_paced_stream_sends_its_first_token_at_once_and_the_rest_when_due(tiny_pair):
    """With a stream interval longer than the whole request, a stream gets two outputs: the
    first token as soon as it exists, then every other token with the end; the same tokens as
    an unpaced stream."""
    target, draft = tiny_pair
    config = EngineConfig(model=str(target), draft_model=str(draft), num_kv_blocks=64,
                          max_num_seqs=4, num_threads=1)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    paced = AsyncLLMEngine(lambda: LLMEngine(config), idle_wait_s=0.01, stream_interval_s=60.0)
    try:
        outputs = asyncio.run(collect(paced, "paced", [3, 4, 5, 6], greedy, {"policy": "off"}))
    finally:
        paced.shutdown()
    assert [len(o.new_token_ids) for o in outputs] == [1, 11]
    assert [o.finished for o in outputs] == [False, True]
    assert sum((o.new_token_ids for o in outputs), []) == outputs[-1].token_ids
    unpaced = AsyncLLMEngine(lambda: LLMEngine(config), idle_wait_s=0.01)
    try:
        plain = asyncio.run(collect(unpaced, "plain", [3, 4, 5, 6], greedy, {"policy": "off"}))
    finally:
        unpaced.shutdown()
    assert plain[-1].token_ids == outputs[-1].token_ids


def test_open_streams_share_a_budget_of_hand_offs(tiny_pair):
    """With no interval of its own but a budget of two hand-offs a minute for the replica, two
    open streams each get their first token at once and the rest with the end (a minute apart
    each, were the requests that long)."""
    target, draft = tiny_pair
    config = EngineConfig(model=str(target), draft_model=str(draft), num_kv_blocks=64,
                          max_num_seqs=4, num_threads=1)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def both(engine):
        return await asyncio.gather(
            collect(engine, "a", [3, 4, 5, 6], greedy, {"policy": "off"}),
            collect(engine, "b", [7, 8, 9], greedy, {"policy": "off"}),
        )

    engine = AsyncLLMEngine(lambda: LLMEngine(config), idle_wait_s=0.01,
                            stream_deltas_per_s=2 / 60)
    try:
        streams = asyncio.run(both(engine))
    finally:
        engine.shutdown()
    for outputs in streams:
        assert [len(o.new_token_ids) for o in outputs] == [1, 11]
        assert sum((o.new_token_ids for o in outputs), []) == outputs[-1].token_ids


def test_building_the_engine_fails_in_the_constructor(tiny_pair):
    def broken():
        raise RuntimeError("no such model")

    with pytest.raises(RuntimeError, match="no such model"):
        AsyncLLMEngine(broken)


def test_a_failed_step_fails_the_requests_it_ran_and_no_others(tiny_pair):
    """A row whose distribution is NaN (a repetition penalty past its bounds, set behind
    validation's back, as a model's own NaN would make it) fails its step: its request fails,
    while one waiting for a place (one sequence at a time) is served as if nothing happened."""
    broken = SamplingParams(max_tokens=8, temperature=1.0)  # unseeded: drawn by inverse CDF
    object.__setattr__(broken, "repetition_penalty", 1e-300)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def run(engine):
        return await asyncio.gather(collect(engine, "broken", [1, 2, 3, 4, 5], broken),
                                    collect(engine, "waiting", [7, 8, 9], greedy),
                                    return_exceptions=True)

    with tiny_engine(tiny_pair, max_num_seqs=1) as engine:
        failed, served = asyncio.run(run(engine))
        alone = asyncio.run(collect(engine, "alone", [7, 8, 9], greedy))
        assert isinstance(failed, RuntimeError) and "engine step failed" in str(failed)
        assert not isinstance(served, BaseException), served
        assert served[-1].token_ids == alone[-1].token_ids and len(alone[-1].token_ids) == 8
        assert engine.engine.num_free_blocks == engine.engine.num_total_blocks


def test_a_request_that_finished_in_a_failed_step_is_not_left_hanging(tiny_pair):
    """A step can finish one request and then raise on another's output: the finished one's end
    was never sent, so it fails with the step rather than wait for an end that never comes."""

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    async def run(engine):
        return await asyncio.wait_for(asyncio.gather(
            collect(engine, "short", [1, 2, 3], params(2)),
            collect(engine, "long", [4, 5, 6], params(8)), return_exceptions=True), 30)

    with tiny_engine(tiny_pair, max_num_seqs=2, spec=SpecConfig(policy="off")) as engine:
        build_output = engine.engine._output

        def failing(seq, new):  # raises on "long" in the step that finishes "short"
            if (seq.request_id == "long" and len(seq.output_token_ids) == 2
                    and not seq.finish_reason):
                raise RuntimeError("no output for long")
            return build_output(seq, new)

        engine.engine._output = failing
        short, long = asyncio.run(run(engine))
        assert isinstance(long, RuntimeError) and "engine step failed" in str(long)
        assert isinstance(short, RuntimeError), short


def test_a_step_that_raises_on_an_abort_does_not_raise_again(tiny_pair):
    """An aborted request leaves the engine in the next step's outputs; a step that raised while
    building them used to keep the abort, raise again on every step and fail every later
    request."""
    greedy = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def run(engine):
        stream = engine.generate("leaver", [3, 4, 5], greedy)
        await anext(stream)
        await stream.aclose()  # the abort
        await wait_until(lambda: not engine.engine.has_unfinished_requests(), timeout_s=5.0)
        return await collect(engine, "next", [3, 4, 5], replace(greedy, max_tokens=4))

    with tiny_engine(tiny_pair, spec=SpecConfig(policy="off")) as engine:
        build_output = engine.engine._output

        def failing(seq, new):
            if seq.finish_reason == "abort":
                raise RuntimeError("no output for an abort")
            return build_output(seq, new)

        engine.engine._output = failing
        assert len(asyncio.run(run(engine))[-1].token_ids) == 4


def test_a_failed_step_hands_over_the_tokens_a_paced_stream_held(tiny_pair):
    """A paced stream holds the tokens of earlier steps back; when a later step fails, the
    stream yields them (the engine committed them) before it raises."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    target, draft = tiny_pair
    config = EngineConfig(model=str(target), draft_model=str(draft), num_kv_blocks=64,
                          num_threads=1, spec=SpecConfig(policy="off"))
    paced = AsyncLLMEngine(lambda: LLMEngine(config), idle_wait_s=0.01, stream_interval_s=60.0)
    outputs = []

    async def run():
        async for out in paced.generate("failing", [3, 4, 5], greedy):
            outputs.append(out)

    try:
        build_output = paced.engine._output

        def failing(seq, new):  # raises in the step that commits the fifth token
            if len(seq.output_token_ids) == 5:
                raise RuntimeError("no output")
            return build_output(seq, new)

        plain = asyncio.run(collect(paced, "plain", [3, 4, 5], greedy))[-1].token_ids
        paced.engine._output = failing
        with pytest.raises(RuntimeError, match="engine step failed"):
            asyncio.run(run())
    finally:
        paced.shutdown()
    assert [len(o.new_token_ids) for o in outputs] == [1, 3]  # the first at once, then 3 held
    assert sum((o.new_token_ids for o in outputs), []) == plain[:4]
