"""SLO-aware speculation on synthetic costs and acceptances, with no model loaded."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from faser.config import SpecConfig
from faser.engine.sequence import Sequence
from faser.sampling_params import SamplingParams
from faser.slo import Slo, request_met
from faser.spec_decode.cost_model import CostModel
from faser.spec_decode.estimator import AcceptanceEstimator
from faser.spec_decode.planner import Limits, choose_k, survival
from faser.spec_decode.policy import LoadView, make_policy
from faser.spec_decode.slo import CATCH_UP_TOKENS, tpot_deadline, tpot_deadlines, ttft_step_limit
from faser.spec_decode.state import SpecState
from tests.spec_decode.spec_profiles import linear, roofline
from tests.spec_decode.test_planner import brute_force

COMPUTE_BOUND = linear(fixed_s=0.010, per_token_s=0.0004, draft_s=0.0002)


def faser(profile=COMPUTE_BOUND, k=8, frontier_size=None):
    config = SpecConfig(policy="faser", num_speculative_tokens=k, frontier_size=frontier_size)
    return make_policy(config, AcceptanceEstimator(config.alpha_prior), CostModel(profile))


def states(*alphas, max_k=8):
    """Requests with a long record at each rate, so that the estimator reads it back."""
    return [
        SpecState(alpha=a, policy="faser", max_k=max_k, accepted=1000.0 * a, trials=1000.0)
        for a in alphas
    ]


def load(n, budget=512):
    return LoadView(n, 0, 0, budget)


def tpot(*deadlines):
    return Limits(tpot_deadlines_s=deadlines)


def num_frontiers(plan) -> int:
    if not any(plan.max_k):
        return 0
    return math.ceil(max(plan.max_k) / plan.frontier_size) if plan.frontier_size else 1


def keeps(choice, limits) -> bool:
    """Whether a choice's predicted step keeps the step cap and every TPOT deadline."""
    time_s = choice.step_time_s * (1 - 1e-9)
    if limits.max_step_time_s is not None and time_s > limits.max_step_time_s:
        return False
    deadlines = limits.tpot_deadlines_s or ()
    return all(d is None or time_s <= d * (1 + e)
               for d, e in zip(deadlines, choice.expected_accepted, strict=True))


def savable(limits, acceptance, cost):
    """The limits less the TPOT deadlines past saving: ones that not even the request's own full
    speculation at the plain step's cost could meet (no k vector can)."""
    if limits.tpot_deadlines_s is None:
        return limits
    plain = cost.step_time(len(acceptance), [0] * len(acceptance))
    deadlines = tuple(
        d if d is not None and d * (1 + sum(survival(a))) >= plain else None
        for d, a in zip(limits.tpot_deadlines_s, acceptance, strict=True)
    )
    return Limits(limits.token_budget, limits.max_step_time_s, deadlines)


# -- the targets ------------------------------------------------------------------------------


def test_slo_from_the_api_in_milliseconds():
    assert Slo.parse(None) is None
    assert Slo.parse({}) is None
    assert Slo.parse({"tpot_ms": 50}) == Slo(tpot_s=0.05)
    assert Slo.parse({"tpot_ms": 20.0, "ttft_ms": 500}) == Slo(0.02, 0.5)
    assert Slo.parse({"tpot_ms": None, "ttft_ms": None}) is None
    assert Slo.parse({"tpot_ms": 20.0, "ttft_ms": None}).as_ms() == {"tpot_ms": 20.0}
    assert Slo(0.02, 0.5).as_ms() == {"tpot_ms": 20.0, "ttft_ms": 500.0}


def test_a_target_is_met_up_to_and_including_it():
    assert Slo(tpot_s=0.01).met(ttft_s=100.0, tpot_s=0.009)
    assert Slo(tpot_s=0.01).met(ttft_s=100.0, tpot_s=0.01)
    assert not Slo(tpot_s=0.01, ttft_s=0.05).met(ttft_s=0.051, tpot_s=0.001)


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


# -- the plan under limits ---------------------------------------------------------------------


def test_tight_tpot_lowers_k_and_frontier_count():
    """Unconstrained, the likely request drafts 8 in 4 frontiers of 2 and the step takes 16 ms,
    while the unlikely one commits 1.3 tokens a step: 12.4 ms a token. With a TPOT of 11.5 ms
    the step is cut to what both can keep."""
    free = faser(frontier_size=2).plan(states(0.95, 0.3), load(2))
    assert free.max_k == (8, 1) and num_frontiers(free) == 4
    deadline = 0.0115
    limits = tpot(deadline, deadline)
    assert not keeps(free.choice, limits)
    tight = faser(frontier_size=2).plan(states(0.95, 0.3), load(2), limits)
    assert max(tight.max_k) < max(free.max_k)
    assert tight.choice.step_time_s < free.choice.step_time_s
    assert num_frontiers(tight) < num_frontiers(free)
    assert tight.choice.meets_limits and keeps(tight.choice, limits)


def test_a_lagging_request_may_get_more_tokens():
    """A request's own speculation relaxes its deadline: the one that would miss it is given
    more draft tokens rather than fewer."""
    free = faser().plan(states(0.95, 0.6), load(2))
    per_token = [free.choice.step_time_s / (1 + e) for e in free.choice.expected_accepted]
    deadline = 0.9 * max(per_token)
    plan = faser().plan(states(0.95, 0.6), load(2), tpot(deadline, deadline))
    assert plan.choice.meets_limits and keeps(plan.choice, tpot(deadline, deadline))
    assert plan.max_k[1] > free.max_k[1]


def test_tight_tpot_turns_speculation_off_when_only_plain_decoding_keeps_it():
    """The unlikely requests' deadline is the plain step itself: any draft token lengthens the
    step by more than their own few accepted tokens make up for."""
    profile = linear(fixed_s=0.010, per_token_s=0.0005, draft_s=0.0001)
    batch = states(0.95, 0.95, 0.02, 0.02)
    free = faser(profile).plan(batch, load(4))
    assert free.mode == "prune" and free.max_k[:2] == (8, 8)
    plain = CostModel(profile).step_time(4, [0] * 4)
    limits = tpot(None, None, plain, plain)
    estimator = AcceptanceEstimator(0.5)
    acceptance = [estimator.before_draft(s, 3) for s in batch]
    assert brute_force(acceptance, CostModel(profile), limits=limits)[1] == (0, 0, 0, 0)
    plan = faser(profile).plan(batch, load(4), limits)
    assert plan.max_k == (0, 0, 0, 0) and plan.mode == "off" and plan.choice.meets_limits


@settings(max_examples=60, deadline=None)
@given(
    alphas=st.lists(st.floats(0.05, 0.99), min_size=1, max_size=10),
    profile=st.sampled_from([roofline(), roofline(knee=8), COMPUTE_BOUND, linear(0.01, 0.002)]),
    budget=st.integers(0, 300),
    with_ttft=st.booleans(),
)
def test_loose_targets_change_nothing(alphas, profile, budget, with_ttft):
    free = faser(profile).plan(states(*alphas), load(len(alphas), budget))
    limits = Limits(None, 10.0 if with_ttft else None, (10.0,) * len(alphas))
    loose = faser(profile).plan(states(*alphas), load(len(alphas), budget), limits)
    assert (loose.max_k, loose.frontier_size, loose.mode, loose.overlap) == (
        free.max_k, free.frontier_size, free.mode, free.overlap,
    )
    assert loose.choice.meets_limits


def test_a_request_past_saving_holds_nobody_back():
    free = faser().plan(states(0.9, 0.9), load(2))
    plan = faser().plan(states(0.9, 0.9), load(2), tpot(1e-6, None))
    assert plan.max_k == free.max_k


def test_a_request_past_saving_is_not_helped_at_the_others_cost():
    """Its deadline stays out of the plan even where the others have deadlines of their own."""
    free = faser().plan(states(0.9, 0.5, 0.5), load(3), tpot(None, 0.05, 0.05))
    plan = faser().plan(states(0.9, 0.5, 0.5), load(3), tpot(-0.01, 0.05, 0.05))
    assert plan.max_k == free.max_k


def test_ttft_limit_caps_the_step():
    free = faser().plan(states(0.9, 0.9), load(2))
    limit = 0.9 * free.choice.step_time_s
    plan = faser().plan(states(0.9, 0.9), load(2), Limits(max_step_time_s=limit))
    assert sum(plan.max_k) < sum(free.max_k)
    assert plan.choice.step_time_s <= limit and plan.choice.meets_limits


def test_trim_keeps_the_plans_deadlines():
    policy, request = faser(), states(0.95, 0.6)
    free = faser().plan(request, load(2))
    deadline = 0.9 * max(free.choice.step_time_s / (1 + e) for e in free.choice.expected_accepted)
    limits = tpot(deadline, deadline)
    plan = policy.plan(request, load(2), limits)
    confidences = [[0.99] * k for k in plan.max_k]
    ks = policy.trim(plan, request, confidences, load(2), limits)
    assert all(0 <= k <= d for k, d in zip(ks, plan.max_k, strict=True))
    time_s = COMPUTE_BOUND.target_time(2 + sum(ks))  # drafted: only the verification counts
    for s, c, k in zip(request, confidences, ks, strict=True):
        expected = sum(survival(policy.estimator.after_draft(s, c))[:k])
        assert time_s <= deadline * (1 + expected)


# -- against the exhaustive search --------------------------------------------------------------

PROFILES = [roofline(), roofline(knee=4), COMPUTE_BOUND, linear(0.01, 0.0005, 0.0001)]


def random_limits(rng, n, cost):
    plain = cost.step_time(n, [0] * n)
    deadlines = tuple(rng.choice([None, plain * rng.uniform(0.4, 1.5)]) for _ in range(n))
    step = rng.choice([None, None, plain * rng.uniform(0.9, 1.6)])
    return Limits(None, step, deadlines)


def test_a_plan_said_to_keep_its_limits_keeps_them():
    """Over random small cases: a choice that reports its limits met keeps them, and one for
    which no k vector keeps them says so."""
    rng = random.Random(0)
    num_met = 0
    for _ in range(300):
        n, cap = rng.randint(1, 4), rng.randint(1, 3)
        acceptance = [[rng.uniform(0.1, 0.99)] * cap for _ in range(n)]
        cost = CostModel(rng.choice(PROFILES))
        limits = savable(random_limits(rng, n, cost), acceptance, cost)
        choice = choose_k(acceptance, cost, limits=limits)
        if choice.meets_limits:
            num_met += 1
            assert keeps(choice, limits)
        if brute_force(acceptance, cost, limits=limits) is None:
            assert not choice.meets_limits
    assert num_met > 100


def test_the_request_behind_its_target_is_favoured():
    """Three alike requests; the last is behind (a tighter per-token deadline). Speculation is
    kept for it and trimmed for the others: (4, 1, 2) keeps every deadline, while every prefix
    of the walk, alike for all three, misses the last one's."""
    acceptance, cost = [[0.8] * 4] * 3, CostModel(COMPUTE_BOUND)
    free = choose_k(acceptance, cost)
    assert free.ks == (4, 4, 4)
    behind = 0.9 * free.step_time_s / (1 + free.expected_accepted[2])
    limits = tpot(None, None, behind)
    assert brute_force(acceptance, cost, limits=limits) is not None
    choice = choose_k(acceptance, cost, limits=limits)
    assert choice.meets_limits
    assert choice.ks[2] > choice.ks[0] and choice.ks[2] > choice.ks[1]


def test_a_feasible_k_vector_is_found_whenever_one_exists():
    rng = random.Random(0)
    num_feasible, ratios = 0, []
    for _ in range(300):
        n, cap = rng.randint(1, 4), rng.randint(1, 3)
        acceptance = [[rng.uniform(0.1, 0.99)] * cap for _ in range(n)]
        cost = CostModel(rng.choice(PROFILES))
        limits = savable(random_limits(rng, n, cost), acceptance, cost)
        best = brute_force(acceptance, cost, limits=limits)
        if best is None:
            continue
        num_feasible += 1
        choice = choose_k(acceptance, cost, limits=limits)
        assert choice.meets_limits, (acceptance, limits, best)
        ratios.append(choice.goodput / best[0])
    assert num_feasible > 100
    assert sum(ratios) / len(ratios) > 0.99  # the greedy walk comes close to the optimum
