"""Speculation policies on synthetic costs and acceptances, with no model loaded."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faser.config import POLICIES, SpecConfig
from faser.spec_decode.cost_model import CostModel
from faser.spec_decode.estimator import AcceptanceEstimator
from faser.spec_decode.planner import Limits, choose_frontier_size
from faser.spec_decode.policy import (
    POLICY_REGISTRY,
    LoadView,
    dsd_k,
    fit_budget,
    make_policy,
    prices_steps,
)
from faser.spec_decode.state import SpecState
from tests.spec_decode.spec_profiles import linear, roofline

FASER = ("faser", "faser-nooverlap", "faser-noprune")
COMPUTE_BOUND = linear(fixed_s=0.010, per_token_s=0.0004, draft_s=0.0002)


def states(*alphas, max_k=8, policy="faser"):
    """Requests with a long record at each rate, so that the estimator reads it back."""
    return [
        SpecState(alpha=a, policy=policy, max_k=max_k, accepted=1000.0 * a, trials=1000.0)
        for a in alphas
    ]


def load(num_running, budget=512, prefill=0, waiting=0, cluster_load=0.0):
    return LoadView(num_running, waiting, prefill, budget, cluster_load)


def static(name):
    config = SpecConfig(policy=name)
    return make_policy(config, AcceptanceEstimator(config.alpha_prior))


def faser(name="faser", profile=None, k=8, can_overlap=False, frontier_size=None):
    config = SpecConfig(policy=name, num_speculative_tokens=k, frontier_size=frontier_size)
    estimator = AcceptanceEstimator(config.alpha_prior)
    return make_policy(config, estimator, CostModel(profile or roofline()), can_overlap)


# -- the registry -------------------------------------------------------------------------------


def test_registry_names_are_exactly_the_configs():
    assert sorted(POLICY_REGISTRY) == sorted(POLICIES)
    for name in POLICIES:
        config = SpecConfig(policy=name)
        policy = make_policy(config, AcceptanceEstimator(0.5), CostModel(roofline()))
        assert policy.name == name


def test_faser_needs_a_cost_model():
    with pytest.raises(ValueError, match="cost model"):
        make_policy(SpecConfig(policy="faser"), AcceptanceEstimator(0.5))


def test_only_the_faser_family_prices_steps():
    assert {name for name in POLICIES if prices_steps(name)} == set(FASER)


# -- the static baselines -----------------------------------------------------------------------


def test_off_never_speculates():
    plan = static("off").plan(states(0.9, 0.9), load(2))
    assert plan.max_k == (0, 0) and plan.mode == "off"


def test_fixed_gives_max_k_within_the_budget():
    policy = static("fixed:4")
    assert policy.plan(states(0.5, 0.5, max_k=4), load(2)).max_k == (4, 4)
    assert policy.plan(states(0.5, 0.5, max_k=4), load(2, budget=5)).max_k == (3, 2)


def test_fit_budget_shortens_the_longest_first():
    assert fit_budget([5, 1, 3], 6) == [3, 1, 2]
    assert fit_budget([2, 2], None) == [2, 2]
    assert fit_budget([2, 2], 4) == [2, 2]
    assert fit_budget([2, 2], -3) == [0, 0]


@pytest.mark.parametrize(
    ("batch", "k"), [(1, 5), (2, 4), (4, 4), (5, 3), (16, 2), (40, 0), (99, 0)]
)
def test_dsd_table_lookup(batch, k):
    assert dsd_k(SpecConfig().dsd_table, batch) == k


def test_dsd_of_an_empty_table_is_zero():
    assert dsd_k((), 1) == 0


def test_dsd_caps_the_table_at_each_requests_max_k():
    policy = static("dsd")
    plan = policy.plan([SpecState(0.5, "dsd", 3), SpecState(0.5, "dsd", 8)], load(2))
    assert plan.max_k == (3, 4)  # the table says 4 for two requests
    assert policy.plan(states(*[0.5] * 64, policy="dsd"), load(64)).mode == "off"


def test_heuristic_plus_two_minus_one():
    policy = make_policy(
        SpecConfig(policy="heuristic", num_speculative_tokens=8), AcceptanceEstimator(0.5)
    )
    state = SpecState(0.5, "heuristic", max_k=8)
    assert policy.plan([state], load(1)).max_k == (4,)  # starts at 4
    policy.observe(state, 4, 4)
    assert policy.plan([state], load(1)).max_k == (6,)
    policy.observe(state, 6, 6)
    assert state.k == 8  # capped at max_k
    policy.observe(state, 8, 3)
    assert state.k == 7
    for _ in range(10):
        policy.observe(state, state.k, 0)
    assert state.k == 1  # never below one, as HF transformers
    policy.observe(state, 0, 0)  # nothing drafted: nothing learnt
    assert state.k == 1
    small = SpecState(0.5, "heuristic", max_k=2)
    assert policy.plan([small], load(1)).max_k == (2,)


def test_static_trim_keeps_what_was_drafted():
    policy = static("fixed:4")
    plan = policy.plan(states(0.5, 0.5, max_k=4), load(2))
    assert policy.trim(plan, states(0.5, 0.5), [[0.1] * 4, [0.9] * 2], load(2)) == [4, 2]


# -- faser ---------------------------------------------------------------------------------------


def test_faser_off_when_the_target_is_saturated():
    policy = faser(profile=linear(fixed_s=0.0001, per_token_s=0.01))
    plan = policy.plan(states(0.6, 0.6, 0.6), load(3))
    assert plan.max_k == (0, 0, 0) and plan.mode == "off"


def test_faser_gives_longer_k_to_higher_alpha():
    plan = faser(profile=COMPUTE_BOUND).plan(states(0.95, 0.7, 0.4), load(3))
    assert plan.max_k[0] > plan.max_k[1] > plan.max_k[2]
    assert plan.choice.goodput > plan.choice.baseline_goodput


def test_faser_reads_acceptance_from_the_estimator_not_the_states_alpha():
    """A request's alpha field is a cached copy; the plan follows its verified trials."""
    likely = SpecState(alpha=0.01, policy="faser", max_k=8, accepted=990.0, trials=1000.0)
    unlikely = SpecState(alpha=0.99, policy="faser", max_k=8, accepted=50.0, trials=1000.0)
    plan = faser(profile=COMPUTE_BOUND).plan([likely, unlikely], load(2))
    assert plan.max_k[0] > plan.max_k[1]


def test_faser_overlaps_with_one_frontier_at_low_load():
    plan = faser(can_overlap=True).plan(states(0.8, 0.8), load(2))
    assert plan.mode == "overlap" and plan.overlap
    assert plan.frontier_size is None and all(k > 0 for k in plan.max_k)


def test_faser_without_lanes_never_overlaps():
    plan = faser(can_overlap=False).plan(states(0.8, 0.8), load(2))
    assert plan.mode == "prune" and not plan.overlap
    assert plan.frontier_size is None  # below the knee: one frontier


def test_faser_prunes_past_the_knee_with_the_cheapest_frontier():
    """Four likely requests, four unlikely ones and a prefill chunk: far past the knee of 16,
    and verifying the likely requests' long tails in frontiers of 4 saves work."""
    profile = roofline(knee=16, draft_s=0.0002)
    batch = states(*[0.98] * 4, *[0.35] * 4)
    plan = faser(profile=profile, can_overlap=True).plan(batch, load(8, prefill=32))
    assert plan.mode == "prune" and not plan.overlap
    assert plan.frontier_size is not None and 1 <= plan.frontier_size < max(plan.max_k)
    estimator = AcceptanceEstimator(0.5)
    acceptance = [estimator.before_draft(s, 8) for s in batch]
    assert plan.frontier_size == choose_frontier_size(
        plan.max_k, acceptance, CostModel(profile), 32
    )


def test_a_busy_fleet_halves_k_and_stops_overlap():
    policy = faser(can_overlap=True)
    plan = policy.plan(states(0.95, 0.95), load(2, cluster_load=1.0))
    assert plan.mode == "prune" and 0 < max(plan.max_k) <= 4


def test_faser_switches_off_and_skips_planning_while_the_batch_does_not_shrink():
    policy = faser(profile=linear(fixed_s=0.0001, per_token_s=0.01))
    assert policy.plan(states(*[0.9] * 8), load(8)).choice is not None  # planned: off
    skipped = policy.plan(states(*[0.9] * 10), load(10))
    assert skipped.mode == "off" and skipped.max_k == (0,) * 10 and skipped.choice is None
    assert policy.plan(states(*[0.9] * 7), load(7)).choice is not None  # smaller: planned again


def test_faser_does_not_speculate_while_requests_wait():
    policy = faser()
    assert any(policy.plan(states(0.95, 0.95), load(2)).max_k)
    queued = policy.plan(states(0.95, 0.95), load(2, waiting=3))
    assert queued.max_k == (0, 0) and queued.mode == "off"
    assert any(policy.plan(states(0.95), load(1)).max_k)  # the queue gone, a smaller batch


def test_faser_with_an_empty_batch():
    plan = faser().plan([], load(0))
    assert plan.max_k == () and plan.mode == "off"


def test_ablations():
    noprune = faser("faser-noprune", frontier_size=2).plan(states(0.8), load(1))
    assert noprune.mode == "prune" and noprune.frontier_size is None  # one frontier, always
    nooverlap = faser("faser-nooverlap", can_overlap=True).plan(states(0.8, 0.8), load(2))
    assert nooverlap.mode == "prune" and not nooverlap.overlap
    assert faser(can_overlap=True).plan(states(0.8, 0.8), load(2)).overlap  # the full policy


def test_explicit_frontier_size_is_honoured():
    plan = faser(frontier_size=2).plan(states(0.8), load(1))
    assert plan.mode == "prune" and plan.frontier_size == 2


def test_faser_respects_the_token_budget():
    policy = faser()
    assert sum(policy.plan(states(0.9, 0.9, 0.9), load(3, budget=5)).max_k) == 5
    assert sum(policy.plan(states(0.9, 0.9, 0.9), load(3), Limits(token_budget=2)).max_k) == 2


def test_faser_respects_the_step_time():
    slow = faser(profile=linear(fixed_s=0.010, per_token_s=0.0001, draft_s=0.001))
    free = slow.plan(states(0.9, 0.5), load(2))
    limit = free.choice.step_time_s * 0.9
    tight = slow.plan(states(0.9, 0.5), load(2), Limits(max_step_time_s=limit))
    assert sum(tight.max_k) < sum(free.max_k)
    assert tight.choice.step_time_s <= limit and tight.choice.meets_limits


# -- trim ----------------------------------------------------------------------------------------


def test_trim_cuts_low_confidence_tails():
    policy = faser(profile=linear(fixed_s=0.010, per_token_s=0.001, draft_s=0.0002))
    request = states(0.8, 0.8)
    plan = policy.plan(request, load(2))
    assert min(plan.max_k) >= 3
    confident = [0.95] * plan.max_k[0]
    shaky = ([0.9, 0.9, 0.02] + [0.9] * 8)[: plan.max_k[1]]
    ks = policy.trim(plan, request, [confident, shaky], load(2))
    assert ks[0] == plan.max_k[0]
    assert ks[1] == 2  # the third token is likely rejected, and all after it with it


def test_trim_drops_tokens_that_do_not_pay_their_verification():
    # compute-bound: each verified token costs as much as 40 % of a whole step
    policy = faser(profile=linear(fixed_s=0.010, per_token_s=0.004, draft_s=0.0001))
    request = states(0.9)
    plan = policy.plan(request, load(1))
    assert plan.max_k[0] >= 3
    middling = [0.5] * plan.max_k[0]
    assert 0 < policy.trim(plan, request, [middling], load(1))[0] < plan.max_k[0]


def test_trim_keeps_tokens_whose_confidence_proved_reliable():
    """A draft whose low-confidence tokens the target keeps accepting: once calibrated, trim
    keeps them."""
    policy = faser(profile=linear(fixed_s=0.010, per_token_s=0.001, draft_s=0.0002))
    request = states(0.8)
    plan = policy.plan(request, load(1))
    unsure = [0.25] * plan.max_k[0]
    before = policy.trim(plan, request, [unsure], load(1))[0]
    for _ in range(200):
        policy.estimator.observe(states(0.8)[0], [0.25] * 4, 4)
    after = policy.trim(plan, request, [unsure], load(1))[0]
    assert before < after == plan.max_k[0]


def test_trim_never_extends_a_draft():
    policy = faser()
    plan = policy.plan(states(0.99, 0.99), load(2))
    assert policy.trim(plan, states(0.99, 0.99), [[0.99] * 2, []], load(2)) == [2, 0]


# -- whatever happens, k stays in [0, max_k] and within the budget -------------------------------

# the engine flushes denormals to zero in this process: hypothesis must not draw them
UNIT = st.floats(0.0, 1.0, allow_subnormal=False)


@st.composite
def spec_states(draw):
    trials = draw(st.floats(0.0, 200.0, allow_subnormal=False))
    return SpecState(
        alpha=draw(UNIT), policy="x", max_k=draw(st.integers(0, 16)),
        accepted=trials * draw(UNIT), trials=trials, k=draw(st.integers(0, 16)),
    )


loads = st.builds(
    LoadView,
    num_running=st.integers(0, 80),
    num_waiting=st.integers(0, 50),
    num_prefill_tokens=st.integers(0, 600),
    token_budget=st.integers(-5, 600),
)
profiles = st.sampled_from([roofline(), roofline(knee=4), linear(0.01, 0.001), linear(0.001, 0.01)])
SECONDS = st.floats(-0.01, 0.2, allow_subnormal=False)


@st.composite
def limits_for(draw, n):
    deadlines = st.none() | st.tuples(*[st.none() | SECONDS] * n)
    return Limits(None, draw(st.none() | st.floats(1e-4, 0.5)), draw(deadlines))


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(POLICIES),
    k=st.integers(0, 16),
    batch=st.lists(spec_states(), max_size=12),
    view=loads,
    profile=profiles,
    cluster_load=st.floats(0.0, 3.0, allow_subnormal=False),
    can_overlap=st.booleans(),
    data=st.data(),
)
def test_every_plan_and_trim_stays_within_zero_and_max_k(
    name, k, batch, view, profile, cluster_load, can_overlap, data
):
    config = SpecConfig(policy=name, num_speculative_tokens=k)
    estimator = AcceptanceEstimator(config.alpha_prior)
    policy = make_policy(config, estimator, CostModel(profile), can_overlap)
    view = replace(view, cluster_load=cluster_load)
    # an empty batch with a step-time limit divides by zero in the planner (see the report)
    limits = data.draw(limits_for(len(batch))) if batch else Limits()
    for _ in range(2):  # the second plan may be skipped by a controller that went off
        plan = policy.plan(batch, view, limits)
        assert len(plan.max_k) == len(batch)
        assert all(0 <= pk <= max(0, s.max_k) for pk, s in zip(plan.max_k, batch, strict=True))
        assert sum(plan.max_k) <= max(0, view.token_budget)
        assert plan.frontier_size is None or 1 <= plan.frontier_size < max(plan.max_k)
        assert plan.mode in ("off", "overlap", "prune")
        drafted = [data.draw(st.integers(0, pk)) for pk in plan.max_k]
        confidences = [data.draw(st.lists(UNIT, min_size=d, max_size=d)) for d in drafted]
        final = policy.trim(plan, batch, confidences, view, limits)
        assert all(0 <= f <= d for f, d in zip(final, drafted, strict=True))
        for s, f, c in zip(batch, final, confidences, strict=True):
            accepted = data.draw(st.integers(0, f))
            estimator.observe(s, c[:f], accepted)
            policy.observe(s, f, accepted)
            assert 0.0 <= s.alpha <= 1.0
            if name == "heuristic" and f > 0:
                assert 1 <= s.k <= s.max_k
