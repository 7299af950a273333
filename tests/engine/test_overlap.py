"""The overlapped step (draft and target at once on two lanes) is lossless, keeps the sampling
distribution, gives a seeded request plain decoding's answer, and reuses post-verify drafts."""

from __future__ import annotations

import itertools
import threading
from dataclasses import replace

import pytest
import torch

from faser import LLM, SamplingParams, SpecConfig
from faser.runner.lanes import Lane, make_lanes
from faser.spec_decode.planner import NO_LIMITS
from faser.spec_decode.policy import StaticPolicy
from tests.engine.test_sampling_distribution import (  # noqa: F401  (a fixture)
    NUM_SAMPLES,
    PARAMS,
    PROMPT,
    SAMPLED_TOKENS,
    assert_marginals_match,
    small_vocab_pair,
)
from tests.spec_decode.spec_profiles import roofline

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 50)), [60] * 17]
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def overlapped(target, draft, policy, frontier=None, spec_fields=None, **kwargs) -> LLM:
    spec = SpecConfig(policy=policy, frontier_size=frontier, **(spec_fields or {}))
    llm = LLM(str(target), draft_model=str(draft), spec=spec, lane_threads=(1, 1),
              num_kv_blocks=kwargs.pop("num_kv_blocks", 96), block_size=4, **kwargs,
              dtype="float32")
    return llm


@pytest.fixture(autouse=True)
def static_plans_overlap(monkeypatch):
    """Every speculative step of a static policy runs overlapped (the faser policies choose
    overlap themselves, where it pays)."""
    plan = StaticPolicy.plan

    def overlapping(self, states, load, limits=NO_LIMITS, draft_lags=()):
        chosen = plan(self, states, load, limits, draft_lags)
        return replace(chosen, mode="overlap") if any(chosen.max_k) else chosen

    monkeypatch.setattr(StaticPolicy, "plan", overlapping)


@pytest.mark.parametrize("shape", ["gqa_tied", "mha_untied"])
@pytest.mark.parametrize("policy,frontier", [
    ("fixed:3", None), ("fixed:4", 2), ("fixed:6", 1), ("heuristic", None), ("dsd", 2),
])
def test_overlap_matches_hf_generate(tiny_models, hf_greedy, shape, policy, frontier):
    llm = overlapped(tiny_models[shape], tiny_models[f"{shape}_draft"], policy, frontier)
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy(shape, prompt, MAX_TOKENS)
    assert llm.engine.speculator.overlap.stats.steps > 0
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_faser_overlaps_at_low_load_and_stays_lossless(tiny_models, hf_greedy):
    """No hook: the faser policy's own overlap mode takes the overlapped step. The cost profile
    is a fixed memory-bound one (a measured one would follow whatever else loads the machine)."""
    llm = LLM(str(tiny_models["gqa_tied"]), draft_model=str(tiny_models["gqa_tied_draft"]),
              spec=SpecConfig(policy="faser"), lane_threads=(1, 1), num_kv_blocks=96,
              block_size=4, dtype="float32")
    llm.engine.speculator.use_cost_profile(roofline())
    outputs = llm.generate(PROMPTS[:1], GREEDY)
    assert outputs[0].token_ids == hf_greedy("gqa_tied", PROMPTS[0], MAX_TOKENS)
    speculator = llm.engine.speculator
    assert speculator.policy("faser").controller.steps_in_mode["overlap"] > 0
    assert speculator.overlap.stats.steps > 0


def test_overlap_with_chunked_prefill_and_preemption(tiny_models, hf_greedy):
    llm = overlapped(tiny_models["mha_untied"], tiny_models["mha_untied_draft"], "fixed:3", 2,
                     num_kv_blocks=24, max_num_batched_tokens=8, max_num_seqs=4)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy("mha_untied", prompt, MAX_TOKENS)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_post_verify_drafts_are_reused(tiny_models, hf_greedy):
    """A draft identical to the target: every draft is accepted, and once the acceptance
    estimate says so, the drafts made while the target verified become the next step's, so the
    draft almost never runs alone."""
    target = tiny_models["gqa_tied"]
    # no prompt lookup: a random-weight model is right but never sure, and a looked-up guess
    # would replace its (always accepted) tokens
    # and the draft's weights as the target's, not rounded into Q8_0: identical means identical
    llm = overlapped(target, target, "fixed:4", spec_fields={"prompt_lookup": False},
                     draft_weights="same")
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy("gqa_tied", prompt, 64)
    stats, overlap = llm.engine.stats, llm.engine.speculator.overlap.stats
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens
    assert overlap.carried_tokens >= 0.5 * stats.num_draft_tokens
    # sequentially the draft runs k = 4 forwards per step before the target; here only in the
    # first steps (the acceptance estimate starts at the prior, too low to draft past k)
    assert overlap.exposed_draft_forwards <= 3 * 4
    assert overlap.exposed_draft_forwards < 0.25 * 4 * overlap.steps


@pytest.mark.parametrize("policy,frontier,seeded", [
    ("fixed:2", None, False), ("fixed:3", 1, False), ("fixed:3", 1, True),
])
def test_overlap_keeps_the_sampling_distribution(small_vocab_pair, policy, frontier,  # noqa: F811
                                                 seeded, monkeypatch):
    target, draft = small_vocab_pair
    monkeypatch.setattr(torch, "seed", itertools.count(10**6).__next__)  # runs repeat
    llm = overlapped(target, draft, policy, frontier, num_kv_blocks=4096, max_num_seqs=128,
                     max_num_batched_tokens=1024)
    params = [SamplingParams(max_tokens=SAMPLED_TOKENS, seed=i if seeded else None,
                             ignore_eos=True, **PARAMS) for i in range(NUM_SAMPLES)]
    outputs = llm.generate([PROMPT] * NUM_SAMPLES, params)
    assert_marginals_match(outputs, target)
    stats = llm.engine.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if frontier is not None:  # a request rejected early drafted its next step during the step
        assert llm.engine.speculator.overlap.stats.carried_tokens > 0


def test_a_seeded_answer_overlapped_is_plain_decodings(small_vocab_pair):  # noqa: F811
    target, draft = small_vocab_pair
    params = [SamplingParams(max_tokens=16, seed=s, ignore_eos=True, **PARAMS) for s in (7, 8)]
    llm = overlapped(target, draft, "fixed:3", 2)
    runs = [llm.generate([PROMPT, [4, 5]], params) for _ in range(2)]
    plain = LLM(str(target), spec=SpecConfig(policy="off"), num_kv_blocks=96, block_size=4,
                dtype="float32").generate([PROMPT, [4, 5]], params)
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in plain]
    assert llm.engine.speculator.overlap.stats.steps > 0


def test_lane_has_its_own_thread_count():
    main = torch.get_num_threads()
    lane = Lane("t", num_threads=1)
    assert lane.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == main
    lane.close()


def test_lanes_run_at_once():
    """Each lane waits for the other inside its task: only concurrent lanes get through."""
    lanes = make_lanes("cpu", (1, 1))
    meet = threading.Barrier(2, timeout=10)
    futures = [lanes.target.submit(meet.wait), lanes.draft.submit(meet.wait)]
    assert sorted(f.result() for f in futures) == [0, 1]
    lanes.close()


def test_lane_threads_are_checked():
    with pytest.raises(ValueError, match="lane_threads"):
        make_lanes("cpu", (1, 0))
    with pytest.raises(ValueError, match="lane_threads"):
        Lane("t", num_threads=0)


def test_overlap_drafts_on_from_a_cached_prefix(tiny_models, hf_greedy):
    """Requests that begin like an earlier one read its blocks, the draft's half included, and
    the overlapped steps after them stay lossless."""
    llm = overlapped(tiny_models["gqa_tied"], tiny_models["gqa_tied_draft"], "fixed:3")
    llm.generate(PROMPTS[2:3], GREEDY)
    longer = [PROMPTS[2] + [1, 2], PROMPTS[2][:30] + [3]]
    outputs = llm.generate(longer, GREEDY)
    for prompt, out in zip(longer, outputs, strict=True):
        assert out.token_ids == hf_greedy("gqa_tied", prompt, MAX_TOKENS)
    assert [o.num_cached_tokens for o in outputs] == [40, 28]
    assert llm.engine.speculator.overlap.stats.steps > 0
