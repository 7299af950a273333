import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faser.config import POLICIES, SpecConfig
from faser.spec.controller import ControllerConfig
from faser.spec.goodput import choose_frontier_size
from faser.spec.plan import LoadView
from faser.spec.policy import POLICY_REGISTRY, dsd_k, fit_budget, make_policy
from faser.spec.state import SpecState
from tests.spec.spec_profiles import linear, roofline

FASER = ("faser", "faser-nooverlap", "faser-noprune")
FAST = ControllerConfig(patience=1)


def states(*alphas, max_k=8, policy="faser"):
    return [SpecState(alpha=a, policy=policy, max_k=max_k) for a in alphas]


def load(num_running, budget=512, prefill=0, waiting=0, kv=0.1):
    return LoadView(num_running, waiting, prefill, budget, kv)


def faser(name="faser", profile=None, k=8, **options):
    config = SpecConfig(policy=name, num_speculative_tokens=k)
    options.setdefault("controller_config", FAST)
    return make_policy(config, cost_model=profile or roofline(), **options)


def test_registry_names_are_exactly_the_configs():
    assert sorted(POLICY_REGISTRY) == sorted(POLICIES)
    for name in POLICIES:
        policy = make_policy(SpecConfig(policy=name), cost_model=roofline())
        assert policy.name == name


def test_faser_needs_a_cost_model():
    with pytest.raises(ValueError, match="cost_model"):
        make_policy(SpecConfig(policy="faser"))


def test_fixed_gives_max_k_within_the_budget():
    policy = make_policy(SpecConfig(policy="fixed:4"))
    assert policy.plan(states(0.5, 0.5, max_k=4), load(2)).max_k == [4, 4]
    assert policy.plan(states(0.5, 0.5, max_k=4), load(2, budget=5)).max_k == [3, 2]


def test_fit_budget_shortens_the_longest_first():
    assert fit_budget([5, 1, 3], 6) == [3, 1, 2]
    assert fit_budget([2, 2], None) == [2, 2]
    assert fit_budget([2, 2], -3) == [0, 0]


@pytest.mark.parametrize(
    ("batch", "k"), [(1, 5), (2, 4), (4, 4), (5, 3), (16, 2), (40, 0), (99, 0)]
)
def test_dsd_table_lookup(batch, k):
    assert dsd_k(SpecConfig().dsd_table, batch) == k


def test_dsd_caps_the_table_at_each_requests_max_k():
    policy = make_policy(SpecConfig(policy="dsd"))
    plan = policy.plan([SpecState(0.5, "dsd", 3), SpecState(0.5, "dsd", 8)], load(1))
    assert plan.max_k == [3, 4]  # the table says 4 for two requests
    assert policy.plan(states(*[0.5] * 64, policy="dsd"), load(64)).mode == "off"


def test_heuristic_plus_two_minus_one():
    policy = make_policy(SpecConfig(policy="heuristic", num_speculative_tokens=8))
    state = SpecState(0.5, "heuristic", max_k=8)
    assert policy.plan([state], load(1)).max_k == [4]  # starts at 4
    policy.observe(state, 4, 4)
    assert policy.plan([state], load(1)).max_k == [6]
    policy.observe(state, 6, 6)
    assert state.k == 8  # capped at max_k
    policy.observe(state, 8, 3)
    assert state.k == 7
    for _ in range(10):
        policy.observe(state, state.k, 0)
    assert state.k == 1  # never below one, as HF transformers
    small = SpecState(0.5, "heuristic", max_k=2)
    assert policy.plan([small], load(1)).max_k == [2]


def test_observe_estimates_per_token_acceptance():
    policy = make_policy(SpecConfig(policy="fixed", alpha_ema=1.0, alpha_recovery=0.0))
    state = SpecState(0.5, "fixed", 4)
    policy.observe(state, 4, 2)  # two accepted, the third rejected: 2 of 3 trials
    assert state.alpha == pytest.approx(2 / 3)
    policy.observe(state, 4, 4)
    assert state.alpha == pytest.approx(1.0)
    policy.observe(state, 0, 0)  # nothing drafted: nothing learnt
    assert state.alpha == pytest.approx(1.0)
    assert (state.last_k, state.last_num_accepted) == (0, 0)


def test_a_request_without_drafts_drifts_back_to_the_population():
    """A run of rejections drives a request's estimate below what pays; with no drafts it would
    never be measured again, so steps without speculation move it toward the policy's estimate
    over every request (which the rejections moved only a little)."""
    policy = make_policy(SpecConfig(policy="fixed", alpha_prior=0.4, alpha_ema=0.3,
                                    alpha_recovery=0.1))
    unlucky, typical = SpecState(0.4, "fixed", 1), SpecState(0.4, "fixed", 1)
    for _ in range(5):
        policy.observe(unlucky, 1, 0)
    assert unlucky.alpha < 0.08
    assert 0.3 < policy.population_alpha < 0.4
    for _ in range(40):
        policy.observe(unlucky, 0, 0)
        policy.observe(typical, 0, 0)
    assert unlucky.alpha == pytest.approx(policy.population_alpha, abs=0.01)
    assert typical.alpha == pytest.approx(policy.population_alpha, abs=0.01)


def test_faser_off_when_the_target_is_saturated():
    policy = faser(profile=linear(fixed_s=0.0001, per_token_s=0.01))
    plan = policy.plan(states(0.6, 0.6, 0.6), load(3))
    assert plan.max_k == [0, 0, 0] and plan.mode == "off"


def test_faser_gives_longer_k_to_higher_alpha():
    policy = faser(profile=linear(fixed_s=0.010, per_token_s=0.0004, draft_s=0.0002))
    plan = policy.plan(states(0.95, 0.7, 0.4), load(3))
    assert plan.max_k[0] > plan.max_k[1] > plan.max_k[2]
    assert plan.notes["predicted_goodput"] > plan.notes["baseline_goodput"]


def test_faser_overlaps_with_one_frontier_at_low_load():
    plan = faser().plan(states(0.8, 0.8), load(2))
    assert plan.mode == "overlap" and plan.overlap
    assert plan.frontier_size is None and plan.max_k == [8, 8]


def test_faser_prunes_with_shorter_k_at_high_load():
    profile = linear(fixed_s=0.010, per_token_s=0.0005, draft_s=0.0001)  # knee about 20 tokens
    plan = faser(profile=profile).plan(states(*[0.9] * 12), load(12))
    assert plan.mode == "prune" and not plan.overlap
    assert 0 < max(plan.max_k) <= 4  # half the cap
    # the frontier size is the verify-cost model's choice for these k
    acceptance = [[0.9] * 4] * 12
    assert plan.frontier_size == choose_frontier_size(plan.max_k, acceptance, profile)


def test_faser_switches_off_past_saturation():
    profile = linear(fixed_s=0.010, per_token_s=0.0005, draft_s=0.0001)
    plan = faser(profile=profile).plan(states(*[0.9] * 40), load(40))
    assert plan.mode == "off" and plan.max_k == [0] * 40


def test_ablations():
    config = SpecConfig(policy="faser-noprune", num_speculative_tokens=8, frontier_size=2)
    noprune = make_policy(config, cost_model=roofline()).plan(states(0.8), load(1))
    assert noprune.max_k == [8] and noprune.frontier_size is None  # one frontier, always
    nooverlap = faser("faser-nooverlap").plan(states(0.8, 0.8), load(2))
    assert nooverlap.mode == "prune" and not nooverlap.overlap
    assert nooverlap.max_k == [4, 4]


def test_explicit_frontier_size_is_honoured():
    config = SpecConfig(policy="faser", num_speculative_tokens=8, frontier_size=2)
    plan = make_policy(config, cost_model=roofline()).plan(states(0.8), load(1))
    assert plan.frontier_size == 2


def test_faser_respects_budget_and_step_time():
    policy = faser()
    assert sum(policy.plan(states(0.9, 0.9, 0.9), load(3, budget=5)).max_k) == 5
    slow = faser(profile=linear(fixed_s=0.010, per_token_s=0.0001, draft_s=0.001))
    free = slow.plan(states(0.9, 0.5), load(2))
    tight = slow.plan(
        states(0.9, 0.5), load(2), max_step_time_s=free.notes["predicted_time_s"] * 0.9
    )
    assert sum(tight.max_k) < sum(free.max_k)


def test_trim_cuts_low_confidence_tails():
    policy = faser(profile=linear(fixed_s=0.010, per_token_s=0.0005, draft_s=0.0002))
    request = states(0.8, 0.8)
    plan = policy.plan(request, load(2))
    assert plan.max_k == [8, 8] or min(plan.max_k) >= 3
    confident = [0.95] * plan.max_k[0]
    shaky = [0.9, 0.9, 0.02, 0.9, 0.9, 0.9, 0.9, 0.9][: plan.max_k[1]]
    ks = policy.trim(plan, request, [confident, shaky])
    assert ks[0] == plan.max_k[0]
    assert ks[1] == 2  # cumulative confidence 0.016 at the third token: below the stop rule


def test_trim_drops_tokens_that_do_not_pay_their_verification():
    # compute-bound: each verified token costs as much as 40 % of a whole step
    policy = faser(profile=linear(fixed_s=0.010, per_token_s=0.004, draft_s=0.0001))
    request = states(0.9)
    plan = policy.plan(request, load(1))
    assert plan.max_k[0] >= 3
    middling = [0.5] * plan.max_k[0]  # a_t = 0.7: survival 0.7, 0.49, 0.34 ...
    assert 0 < policy.trim(plan, request, [middling])[0] < plan.max_k[0]


def test_static_trim_keeps_what_was_drafted_within_the_plan():
    policy = make_policy(SpecConfig(policy="fixed:4"))
    plan = policy.plan(states(0.5, 0.5, max_k=4), load(2))
    assert policy.trim(plan, states(0.5, 0.5), [[0.1] * 4, [0.9] * 2]) == [4, 2]


# the engine flushes denormals to zero in this process: hypothesis must not draw them
UNIT = st.floats(0.0, 1.0, allow_subnormal=False)
state_lists = st.lists(
    st.builds(SpecState, alpha=UNIT, policy=st.just("x"), max_k=st.integers(0, 16)),
    min_size=0,
    max_size=12,
)
loads = st.builds(
    LoadView,
    num_running=st.integers(0, 80),
    num_waiting=st.integers(0, 50),
    num_prefill_tokens=st.integers(0, 600),
    token_budget=st.integers(-5, 600),
    kv_usage=UNIT,
    cluster_load=st.none() | st.floats(0.0, 3.0, allow_subnormal=False),
)
profiles = st.sampled_from([roofline(), roofline(knee=4), linear(0.01, 0.001), linear(0.001, 0.01)])


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(POLICIES),
    k=st.integers(0, 16),
    batch=state_lists,
    view=loads,
    profile=profiles,
    data=st.data(),
)
def test_every_plan_and_trim_stays_within_zero_and_max_k(name, k, batch, view, profile, data):
    config = SpecConfig(policy=name, num_speculative_tokens=k)
    policy = make_policy(config, cost_model=profile)
    plan = policy.plan(batch, view)
    assert len(plan.max_k) == len(batch)
    assert all(0 <= pk <= max(0, s.max_k) for pk, s in zip(plan.max_k, batch, strict=True))
    assert sum(plan.max_k) <= max(0, view.token_budget)
    assert plan.frontier_size is None or 1 <= plan.frontier_size < max(plan.max_k)
    drafted = [data.draw(st.integers(0, pk)) for pk in plan.max_k]
    confidences = [
        data.draw(st.lists(UNIT, min_size=d, max_size=d)) for d in drafted
    ]
    final = policy.trim(plan, batch, confidences)
    assert all(0 <= f <= d for f, d in zip(final, drafted, strict=True))
    for s, f in zip(batch, final, strict=True):
        policy.observe(s, f, data.draw(st.integers(0, f)))
        assert 0.0 <= s.alpha <= 1.0
