"""Greedy output of every policy equals Hugging Face's own greedy generate, token for token, for a
batch of prompts of different lengths run together."""

from __future__ import annotations

import pytest

from faser import LLM, SamplingParams, SpecConfig
from faser.runner.weights import packed_reason
from faser.spec_decode.lookup import MAX_N, MIN_N, PRIOR_PRECISION

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 50)), [60] * 17]
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def run(models, shape, policy, **engine_kwargs):
    llm = LLM(
        str(models[shape]), draft_model=str(models[f"{shape}_draft"]),
        spec=SpecConfig(policy=policy), num_kv_blocks=engine_kwargs.pop("num_kv_blocks", 96),
        block_size=engine_kwargs.pop("block_size", 4), **engine_kwargs, dtype="float32",
    )
    outputs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks  # nothing leaked
    return llm, outputs


ALL_POLICIES = ["off", "fixed:1", "fixed:3", "fixed:6", "dsd", "heuristic", "faser",
                "faser-nooverlap", "faser-noprune"]


@pytest.mark.parametrize("shape", ["gqa_tied", "mha_untied", "qwen2_bias"])
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_policy_matches_hf_generate(tiny_models, hf_greedy, shape, policy):
    _, outputs = run(tiny_models, shape, policy)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy(shape, prompt, MAX_TOKENS)
        assert out.finish_reason == "length"


def test_speculation_accepts_some_and_rejects_some(tiny_models):
    llm, outputs = run(tiny_models, "gqa_tied", "fixed:4")
    stats = llm.engine.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert all(1.0 < o.spec_stats.mean_acceptance_length < 5.0 for o in outputs)


def test_a_new_request_starts_from_the_policys_observed_acceptance(tiny_models):
    llm, _ = run(tiny_models, "gqa_tied", "fixed:4")
    before = llm.engine.config.spec.alpha_prior
    observed = llm.engine.speculator.estimator.prior
    assert observed != pytest.approx(before)  # the tiny draft is no coin flip
    llm.engine.add_request("late", PROMPTS[0], GREEDY)
    late = llm.engine.scheduler.find("late")
    assert late.spec_state.alpha == pytest.approx(observed)


def test_the_cost_correction_is_learned_only_once_a_policy_profiled(tiny_models):
    llm, _ = run(tiny_models, "gqa_tied", "fixed:2")
    assert llm.engine.speculator.cost is None  # a plain policy never profiles
    llm, _ = run(tiny_models, "gqa_tied", "faser")
    cost = llm.engine.speculator.cost
    # from the steps served, drafting or not: on these tiny models the planner mostly drafts
    # nothing, as their draft costs about what their target does
    assert cost is not None and cost.num_observed + cost.num_decodes > 0
    assert llm.engine.speculator.policy("faser").cost is cost


def test_prompt_lookup_defers_to_a_draft_known_to_be_right(tiny_models, hf_greedy):
    """A draft identical to its random-weight target is always right but never sure (its
    confidences sit near 0.1); looked-up guesses would replace its tokens at first, until the
    calibration of its confidences has seen them accepted and the guesses' own precision has
    seen them rejected."""
    target = str(tiny_models["gqa_tied"])
    llm = LLM(target, draft_model=target, spec=SpecConfig(policy="fixed:4"),
              num_kv_blocks=96, block_size=4, dtype="float32",
              draft_weights="same")  # identical: not rounded into Q8_0 blocks
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy("gqa_tied", prompt, 64)
    stats = llm.engine.stats
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens
    estimator = llm.engine.speculator.estimator
    precisions = [estimator.lookup_precision(n) for n in range(MIN_N, MAX_N + 1)]
    assert min(precisions) < PRIOR_PRECISION  # a guess taken over the draft's token was wrong
    assert llm.engine.speculator.estimator.calibrated(0.1) > 0.9


@pytest.mark.parametrize("frontier_size", [1, 2])
def test_frontiers_prune_and_stay_lossless(tiny_models, hf_greedy, frontier_size):
    """Verification in frontiers computes no position after a rejection."""
    one, one_out = run(tiny_models, "gqa_tied", "fixed:6")
    spec = SpecConfig(policy="fixed:6", frontier_size=frontier_size)
    llm = LLM(str(tiny_models["gqa_tied"]), draft_model=str(tiny_models["gqa_tied_draft"]),
              spec=spec, num_kv_blocks=96, block_size=4, dtype="float32")
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy("gqa_tied", prompt, MAX_TOKENS)
    stats = llm.engine.stats
    assert stats.num_pruned_positions > 0
    # the same drafts were verified; pruning only removed target positions
    assert stats.num_accepted_tokens == one.engine.stats.num_accepted_tokens
    computed = one.engine.target.num_positions_computed, llm.engine.target.num_positions_computed
    assert computed[0] - computed[1] == stats.num_pruned_positions


def test_chunked_prefill_and_preemption_keep_output(tiny_models, hf_greedy):
    """A token budget smaller than a prompt and too few KV blocks for the batch: chunks and
    preemptions must not change a single token."""
    llm, outputs = run(
        tiny_models, "mha_untied", "fixed:3", num_kv_blocks=24, block_size=4,
        max_num_batched_tokens=8, max_num_seqs=4,
    )
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy("mha_untied", prompt, MAX_TOKENS)


def test_smaller_draft_architecture(tiny_models, hf_greedy):
    llm = LLM(str(tiny_models["gqa_tied"]), draft_model=str(tiny_models["small_draft"]),
              spec=SpecConfig(policy="fixed:3"), num_kv_blocks=96, block_size=4, dtype="float32")
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy("gqa_tied", prompt, MAX_TOKENS)


def test_per_request_policy_override_mixes_in_one_batch(tiny_models, hf_greedy):
    llm = LLM(str(tiny_models["gqa_tied"]), draft_model=str(tiny_models["gqa_tied_draft"]),
              spec=SpecConfig(policy="off"), num_kv_blocks=96, block_size=4, dtype="float32")
    engine = llm.engine
    specs = [None, {"policy": "fixed", "max_k": 2}, {"policy": "fixed", "max_k": 5}, None]
    for i, (prompt, spec) in enumerate(zip(PROMPTS, specs, strict=True)):
        engine.add_request(str(i), prompt, GREEDY, speculation=spec)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for i, prompt in enumerate(PROMPTS):
        assert done[str(i)].token_ids == hf_greedy("gqa_tied", prompt, MAX_TOKENS)
    assert done["0"].spec_stats.num_draft_tokens == 0
    assert done["2"].spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("weight_format", ["dense", "packed"])
@pytest.mark.parametrize("policy", ["fixed:3", "faser"])
def test_every_weight_layout_keeps_greedy_output(tiny_models, hf_greedy, weight_format, policy):
    """Verification runs many rows where plain decoding runs one, in either layout."""
    if weight_format == "packed" and (reason := packed_reason("cpu", "float32")) is not None:
        pytest.skip(reason)
    llm, outputs = run(tiny_models, "gqa_tied", policy, weight_format=weight_format)
    assert llm.engine.pair.weight_format == weight_format
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy("gqa_tied", prompt, MAX_TOKENS)


def test_auto_layout_is_decided_once_for_the_pair(tiny_models):
    llm, _ = run(tiny_models, "gqa_tied", "off")
    expected = "packed" if packed_reason("cpu", "float32") is None else "dense"
    assert llm.engine.pair.weight_format == expected


@pytest.mark.parametrize("max_tokens", [2, 3, 5])
def test_a_request_drafts_no_more_than_it_has_tokens_left(tiny_models, hf_greedy, max_tokens):
    """n tokens left, at most n - 1 drafted: the bonus token is the n-th. After the prefill's
    token, each step commits at least one, so m tokens allow at most (m - 2) + (m - 3) + ... + 0
    drafts; two leave nothing to draft."""
    llm = LLM(str(tiny_models["gqa_tied"]), draft_model=str(tiny_models["gqa_tied_draft"]),
              spec=SpecConfig(policy="fixed:8"), num_kv_blocks=96, block_size=4,
              dtype="float32")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS:
        out = llm.generate([prompt], params)[0]
        assert out.token_ids == hf_greedy("gqa_tied", prompt, max_tokens)
        assert out.spec_stats.num_draft_tokens <= (max_tokens - 2) * (max_tokens - 1) // 2
