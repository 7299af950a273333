"""Prefix caching in the engine: requests that begin like an earlier one read its blocks instead
of computing them, and not one token of any request changes, under every policy, chunked
prefill, preemption, sampling and prompt logprobs."""

from __future__ import annotations

import pytest

from faser import LLM, SamplingParams, SpecConfig

SYSTEM = list(range(10, 41))  # 31 tokens: seven full blocks of 4, and one token more
PROMPTS = [SYSTEM + [50, 51], SYSTEM + [52], SYSTEM + [53, 54, 55], SYSTEM[:9] + [60, 61]]
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def engine(models, policy: str, prefix_caching: bool = True, **kwargs) -> LLM:
    return LLM(str(models["gqa_tied"]), draft_model=str(models["gqa_tied_draft"]),
               spec=SpecConfig(policy=policy), num_kv_blocks=kwargs.pop("num_kv_blocks", 96),
               block_size=4, dtype="float32", prefix_caching=prefix_caching, **kwargs)


@pytest.mark.parametrize("policy", ["off", "fixed:3", "faser"])
def test_a_shared_prefix_is_read_not_computed_and_no_token_changes(tiny_models, hf_greedy,
                                                                   policy):
    llm = engine(tiny_models, policy)
    first = llm.generate(PROMPTS[:1], GREEDY)[0]
    assert first.num_cached_tokens == 0
    computed = llm.engine.target.num_positions_computed
    later = llm.generate(PROMPTS[1:], GREEDY)
    for prompt, out in zip(PROMPTS, [first, *later], strict=True):
        assert out.token_ids == hf_greedy("gqa_tied", prompt, MAX_TOKENS)
    # the first request's blocks of the system prompt, and the fourth's first two blocks
    assert [o.num_cached_tokens for o in later] == [28, 28, 8]
    fresh = engine(tiny_models, policy, prefix_caching=False)
    fresh.generate(PROMPTS[:1], GREEDY)
    before = fresh.engine.target.num_positions_computed
    fresh.generate(PROMPTS[1:], GREEDY)
    saved = fresh.engine.target.num_positions_computed - before
    assert saved - (llm.engine.target.num_positions_computed - computed) >= 28 + 28 + 8 - 8
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks  # cached blocks are free


def test_an_answer_is_cached_for_the_next_turn(tiny_models, hf_greedy):
    """A conversation's next turn sends the last answer back: its blocks are read too."""
    llm = engine(tiny_models, "fixed:3")
    first = llm.generate([PROMPTS[0]], GREEDY)[0]
    turn = PROMPTS[0] + first.token_ids + [70, 71]
    again = llm.generate([turn], GREEDY)[0]
    assert again.token_ids == hf_greedy("gqa_tied", turn, MAX_TOKENS)
    # every full block of the first prompt and its answer, but the last answer token's
    assert again.num_cached_tokens == (len(PROMPTS[0]) + MAX_TOKENS - 1) // 4 * 4


def test_chunked_prefill_and_preemption_with_shared_blocks(tiny_models, hf_greedy):
    """Too few blocks for the batch and a budget below a prompt: requests are preempted while
    others hold the blocks they share, and recompute from what stays cached."""
    llm = engine(tiny_models, "fixed:3", num_kv_blocks=22, max_num_batched_tokens=8,
                 max_num_seqs=4)
    llm.generate(PROMPTS[:1], GREEDY)
    outputs = llm.generate(PROMPTS * 2, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(PROMPTS * 2, outputs, strict=True):
        assert out.token_ids == hf_greedy("gqa_tied", prompt, MAX_TOKENS)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_sampled_requests_and_prompt_logprobs_are_unchanged(tiny_models):
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7, logprobs=2),
              SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1)]
    outputs = {}
    for caching in (False, True):
        llm = engine(tiny_models, "fixed:3", prefix_caching=caching)
        llm.generate(PROMPTS[:1], GREEDY)
        outputs[caching] = [llm.generate(PROMPTS[1:2], p)[0] for p in params]
    for cached, fresh in zip(outputs[True], outputs[False], strict=True):
        assert cached.token_ids == fresh.token_ids
        assert cached.logprobs == fresh.logprobs
        assert cached.prompt_logprobs == fresh.prompt_logprobs
    # the sampled request read the cache; one that asks for prompt logprobs scores every position
    assert [o.num_cached_tokens for o in outputs[True]] == [28, 0]
