"""SLO-aware speculation on synthetic costs and acceptances, with no model loaded."""

import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from faser.config import SpecConfig
from faser.engine.sequence import Sequence
from faser.sampling_params import SamplingParams
from faser.spec.controller import ControllerConfig
from faser.spec.goodput import StepCost, choose_k, survival
from faser.spec.plan import LoadView
from faser.spec.policy import make_policy
from faser.spec.slo import (
    CATCH_UP_TOKENS,
    Slo,
    request_met,
    tpot_deadline,
    tpot_deadlines,
    ttft_step_limit,
)
from faser.spec.state import SpecState
from tests.spec.spec_profiles import linear, roofline

FAST = ControllerConfig(patience=1)
COMPUTE_BOUND = linear(fixed_s=0.010, per_token_s=0.0004, draft_s=0.0002)


def faser(profile=COMPUTE_BOUND, k=8, frontier_size=None):
    config = SpecConfig(policy="faser", num_speculative_tokens=k, frontier_size=frontier_size)
    return make_policy(config, cost_model=profile, controller_config=FAST)


def states(*alphas, max_k=8):
    return [SpecState(alpha=a, policy="faser", max_k=max_k) for a in alphas]


def load(n, budget=512):
    return LoadView(n, 0, 0, budget, 0.1)


def num_frontiers(plan) -> int:
    if not any(plan.max_k):
        return 0
    return math.ceil(max(plan.max_k) / plan.frontier_size) if plan.frontier_size else 1


# -- the targets ------------------------------------------------------------------------------


def test_slo_from_the_api_in_milliseconds():
    assert Slo.parse(None) is None
    assert Slo.parse({}) is None
    assert Slo.parse({"tpot_ms": 50}) == Slo(tpot_s=0.05)
    assert Slo.parse({"tpot_ms": 20.0, "ttft_ms": 500}) == Slo(0.02, 0.5)
    assert Slo.from_ms(None, None) is None


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"tpot_ms": 0}, "tpot_ms"),
        ({"tpot_ms": -5}, "tpot_ms"),
        ({"ttft_ms": "100"}, "ttft_ms"),
        ({"ttft_ms": True}, "ttft_ms"),
        ({"tpot_ms": float("nan")}, "tpot_ms"),
        ({"tpot_ms": float("inf")}, "tpot_ms"),
        ({"tbt_ms": 5}, "tbt_ms"),
        ("fast", "slo"),
    ],
)
def test_bad_slo_is_a_value_error_naming_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        Slo.parse(value)


def test_request_met_by_ttft_and_tpot():
    slo = Slo(tpot_s=0.010, ttft_s=0.100)
    # arrival 0, first token at 0.05, 11 tokens by 0.15: TPOT 0.010 exactly
    assert request_met(slo, 0.0, 0.05, 0.15, 11) is True
    assert request_met(slo, 0.0, 0.05, 0.16, 11) is False  # TPOT 0.011
    assert request_met(slo, 0.0, 0.11, 0.12, 2) is False  # TTFT 0.11
    assert request_met(Slo(ttft_s=0.1), 0.0, 0.05, 9.0, 3) is True  # no TPOT promise
    assert request_met(slo, 0.0, 0.05, 0.05, 1) is True  # one token: no TPOT to speak of
    assert request_met(None, 0.0, 0.05, 0.15, 11) is None
    assert request_met(slo, 0.0, 0.05, None, 11) is None  # not finished


def test_tpot_deadline_follows_the_budget_left():
    t = 0.010
    assert tpot_deadline(t, 5.0, None, 1, 64) == t  # no token yet: the target itself
    # 11 tokens, 10 since the first, in exactly 0.1 s: on track
    assert tpot_deadline(t, 1.1, 1.0, 11, 64) == pytest.approx(t)
    # 0.05 s ahead, spread over the 53 tokens left
    assert tpot_deadline(t, 1.05, 1.0, 11, 64) == pytest.approx(t + 0.05 / 53)
    # 0.05 s behind, made up within CATCH_UP_TOKENS
    assert tpot_deadline(t, 1.15, 1.0, 11, 64) == pytest.approx(t - 0.05 / CATCH_UP_TOKENS)
    # behind with 2 tokens left: they must make it up alone
    assert tpot_deadline(t, 1.15, 1.0, 11, 13) == pytest.approx(t - 0.05 / 2)


def make_seq(slo, prompt_len=4, num_output=0, arrival=0.0, first=None, max_tokens=64):
    seq = Sequence(
        "r", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
        SpecState(0.5, "faser", 4, slo=slo), torch.Generator(),
    )
    seq.output_token_ids = list(range(num_output))
    seq.arrival_time, seq.first_token_time = arrival, first
    return seq


def test_deadlines_and_ttft_limit_from_engine_sequences():
    on_track = make_seq(Slo(tpot_s=0.01), num_output=11, first=1.0)
    no_slo = make_seq(None, num_output=11, first=1.0)
    only_ttft = make_seq(Slo(ttft_s=0.5), num_output=11, first=1.0)
    assert tpot_deadlines([on_track, no_slo, only_ttft], 1.1) == [pytest.approx(0.01), None, None]

    waiting = make_seq(Slo(ttft_s=0.5), prompt_len=8, arrival=1.0)
    # its prefill ends in this step (8 of 8 tokens): the step must end by 1.5
    assert ttft_step_limit([(waiting, 8)], 1.2) == pytest.approx(0.3)
    assert ttft_step_limit([(waiting, 4)], 1.2) is None  # a chunk: no first token this step
    assert ttft_step_limit([(waiting, 8)], 1.6) is None  # missed already: nothing to save
    assert ttft_step_limit([(make_seq(None), 4)], 1.2) is None


# -- the policy -------------------------------------------------------------------------------


def test_tight_tpot_lowers_k_and_frontier_count():
    """Unconstrained, the likely request drafts 8 in 4 frontiers of 2 and the step takes 14 ms,
    while the unlikely one commits 1.3 tokens a step: 11 ms a token. With a TPOT of 8.6 ms the
    step is cut to what both can keep."""
    policy = faser(frontier_size=2)
    free = policy.plan(states(0.95, 0.3), load(2))
    assert free.max_k == [8, 1] and num_frontiers(free) == 4
    tpot = 0.6 * free.notes["predicted_time_s"]
    tight = faser(frontier_size=2).plan(states(0.95, 0.3), load(2), tpot_deadlines_s=[tpot] * 2)
    assert sum(tight.max_k) < sum(free.max_k) and max(tight.max_k) < max(free.max_k)
    assert num_frontiers(tight) < num_frontiers(free)
    # every request's expected time per token now fits its target
    time_s = tight.notes["predicted_time_s"]
    for e in tight.notes["expected_accepted"]:
        assert time_s / (1 + e) <= tpot * (1 + 1e-9)
    assert tight.notes["slo_changed"] is True
    assert tight.notes["slo_unconstrained_k"] == free.max_k
    assert tight.notes["slo_met_predicted"] is True


def test_tight_tpot_turns_speculation_off_when_only_plain_decoding_keeps_it():
    profile = linear(fixed_s=0.010, per_token_s=0.0005, draft_s=0.0001)
    free = faser(profile).plan(states(0.95, 0.95, 0.3, 0.3), load(4))
    assert free.mode == "prune" and free.max_k == [4, 4, 0, 0]
    base = 0.012  # the plain step: 10 ms + 4 tokens
    plan = faser(profile).plan(
        states(0.95, 0.95, 0.3, 0.3), load(4), tpot_deadlines_s=[None, None, base, base]
    )
    assert plan.max_k == [0, 0, 0, 0] and plan.mode == "off"
    assert plan.notes["slo_changed"] is True


@settings(max_examples=60, deadline=None)
@given(
    alphas=st.lists(st.floats(0.05, 0.99), min_size=1, max_size=10),
    profile=st.sampled_from([roofline(), roofline(knee=8), COMPUTE_BOUND, linear(0.01, 0.002)]),
    budget=st.integers(0, 300),
    with_ttft=st.booleans(),
)
def test_loose_targets_change_nothing(alphas, profile, budget, with_ttft):
    free = faser(profile).plan(states(*alphas), load(len(alphas), budget))
    loose = faser(profile).plan(
        states(*alphas), load(len(alphas), budget), tpot_deadlines_s=[10.0] * len(alphas),
        max_step_time_s=10.0 if with_ttft else None,
    )
    assert (loose.max_k, loose.frontier_size, loose.mode, loose.overlap) == (
        free.max_k, free.frontier_size, free.mode, free.overlap,
    )
    if free.mode != "off" or any(free.max_k):
        assert loose.notes["slo_changed"] is False


def test_no_slo_plans_as_before():
    plan = faser().plan(states(0.9, 0.5), load(2))
    assert not any(key.startswith("slo_") for key in plan.notes)


def test_the_request_behind_its_target_is_favoured():
    """Three alike requests; the first is behind (a tighter per-token deadline). Speculation is
    kept for it, trimmed for the others."""
    acceptance = [[0.8] * 4] * 3
    free = choose_k(acceptance, StepCost(COMPUTE_BOUND, 3))
    assert free.ks[0] == free.ks[1] == free.ks[2] > 0
    behind = 0.9 * free.step_time_s / (1 + free.expected_accepted[0])
    choice = choose_k(
        acceptance, StepCost(COMPUTE_BOUND, 3), tpot_deadlines_s=[behind, None, None]
    )
    assert choice.meets_deadlines
    assert choice.ks[0] > choice.ks[1] and choice.ks[0] > choice.ks[2]
    assert choice.step_time_s <= behind * (1 + choice.expected_accepted[0]) * (1 + 1e-9)


def test_a_request_past_saving_holds_nobody_back():
    free = faser().plan(states(0.9, 0.9), load(2))
    plan = faser().plan(states(0.9, 0.9), load(2), tpot_deadlines_s=[1e-6, None])
    assert plan.max_k == free.max_k
    assert plan.notes["slo_num_past_saving"] == 1 and plan.notes["slo_changed"] is False


def test_ttft_limit_caps_the_step():
    free = faser().plan(states(0.9, 0.9), load(2))
    limit = 0.9 * free.notes["predicted_time_s"]
    plan = faser().plan(states(0.9, 0.9), load(2), max_step_time_s=limit)
    assert sum(plan.max_k) < sum(free.max_k)
    assert plan.notes["predicted_time_s"] <= limit
    assert plan.notes["slo_changed"] is True


def test_trim_keeps_the_plans_deadlines():
    policy = faser(frontier_size=2)
    request = states(0.95, 0.3)
    tpot = 0.6 * faser(frontier_size=2).plan(request, load(2)).notes["predicted_time_s"]
    plan = policy.plan(request, load(2), tpot_deadlines_s=[tpot] * 2)
    confident = [[0.99] * k for k in plan.max_k]
    ks = policy.trim(plan, request, confident)
    assert all(0 <= k <= d for k, d in zip(ks, plan.max_k, strict=True))
    time_s = plan.notes["trimmed_time_s"]
    for e in plan.notes["trimmed_expected_accepted"]:
        assert time_s / (1 + e) <= tpot * (1 + 1e-9)


def brute_force(acceptance, profile, deadlines):
    """Every k vector: the best goodput among those that keep every deadline (None: none do)."""
    probs = [survival(a) for a in acceptance]
    best = None
    for ks in itertools.product(*(range(len(a) + 1) for a in acceptance)):
        cost = StepCost(profile, len(ks))
        for k in ks:
            for position in range(k):
                cost.add(position)
        expected = [sum(p[:k]) for p, k in zip(probs, ks, strict=True)]
        if all(
            d * (1 + e) >= cost.total()
            for d, e in zip(deadlines, expected, strict=True) if d is not None
        ):
            goodput = (len(ks) + sum(expected)) / cost.total()
            best = goodput if best is None else max(best, goodput)
    return best


def test_a_feasible_k_vector_is_found_whenever_one_exists():
    rng = random.Random(0)
    profiles = [roofline(), roofline(knee=4), COMPUTE_BOUND, linear(0.01, 0.0005, 0.0001)]
    num_feasible, gaps = 0, []
    for _ in range(300):
        n, cap, profile = rng.randint(1, 4), rng.randint(1, 3), rng.choice(profiles)
        acceptance = [[rng.uniform(0.1, 0.99)] * cap for _ in range(n)]
        base = StepCost(profile, n).total()
        deadlines = [rng.choice([None, base * rng.uniform(0.4, 1.5)]) for _ in range(n)]
        best = brute_force(acceptance, profile, deadlines)
        choice = choose_k(acceptance, StepCost(profile, n), tpot_deadlines_s=deadlines)
        if best is None:
            assert not choice.meets_deadlines
            continue
        num_feasible += 1
        assert choice.meets_deadlines
        gaps.append(choice.goodput / best)
    assert num_feasible > 100
    assert sum(gaps) / len(gaps) > 0.99  # the greedy walks come close to the optimum
