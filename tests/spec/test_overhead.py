"""The step overhead: learned from measured minus profiled step times, added to every predicted
step whatever its k, so that a draft token is priced against the step it really rides in."""

import pytest

from faser.config import SpecConfig
from faser.spec.goodput import StepCost
from faser.spec.overhead import Overhead, StepOverhead
from faser.spec.plan import LoadView
from faser.spec.policy import FaserPolicy
from faser.spec.state import SpecState
from tests.spec.spec_profiles import linear


def test_overhead_is_per_request_and_starts_at_the_first_residual():
    overhead = StepOverhead()
    assert overhead.estimate == Overhead()
    overhead.observe(predicted_s=0.060, measured_s=0.084, num_requests=16)
    assert overhead.per_request_s == pytest.approx(0.0015, rel=1e-2)
    assert overhead.estimate.per_draft_token_s == 0.0  # no draft token seen: nothing to price
    overhead.observe(predicted_s=0.0, measured_s=1.0, num_requests=0)  # nothing to divide by
    assert overhead.num_steps == 1


def test_the_fit_separates_what_grows_with_draft_tokens():
    """Steps of 8-32 requests verifying 0-3 tokens each, whose real extra time is 2 ms per request
    and 1.5 ms per draft token: the fit finds both, and later steps move it."""
    overhead = StepOverhead()
    for n, k in [(8, 0), (16, 1), (32, 0), (16, 3), (32, 2), (8, 1)] * 5:
        overhead.observe(0.0, 0.002 * n + 0.0015 * n * k, n, n * k)
    assert overhead.estimate.per_request_s == pytest.approx(0.002, rel=0.02)
    assert overhead.estimate.per_draft_token_s == pytest.approx(0.0015, rel=0.02)
    for _ in range(200):
        overhead.observe(0.0, 0.004 * 16, 16, 0)
        overhead.observe(0.0, 0.004 * 16, 16, 16)
    assert overhead.estimate.per_request_s == pytest.approx(0.004, rel=0.05)
    assert overhead.estimate.per_draft_token_s == pytest.approx(0.0, abs=2e-4)


def test_proportional_columns_split_the_residual():
    """Every step verifies one token per request: which term the time belongs to cannot be
    told, and the fit splits it rather than blowing up."""
    overhead = StepOverhead()
    for n in (4, 8, 16) * 4:
        overhead.observe(0.0, 0.003 * n, n, n)
    estimate = overhead.estimate
    assert estimate.seconds(1, 1) == pytest.approx(0.003, rel=0.01)
    assert estimate.per_request_s == pytest.approx(estimate.per_draft_token_s, rel=0.01)


def test_a_profile_that_overprices_steps_gives_no_negative_overhead():
    overhead = StepOverhead()
    overhead.observe(predicted_s=0.080, measured_s=0.060, num_requests=4)
    assert overhead.estimate == Overhead()
    overhead = StepOverhead()  # cheaper steps as k grows: the token term stays at 0
    for n, k in [(8, 0), (8, 2)] * 4:
        overhead.observe(0.0, 0.002 * n - 0.0005 * n * k, n, n * k)
    assert overhead.estimate.per_draft_token_s == 0.0
    assert overhead.estimate.per_request_s > 0


def test_per_request_overhead_adds_to_the_step_not_to_a_draft_tokens_price():
    cost = linear(fixed_s=0.010, per_token_s=0.001)
    bare, loaded = StepCost(cost, 4), StepCost(cost, 4, overhead=Overhead(0.005))
    assert loaded.total() == pytest.approx(bare.total() + 0.02)
    assert loaded.marginal(0) == pytest.approx(bare.marginal(0))
    bare.add(0), loaded.add(0)
    assert loaded.total() == pytest.approx(bare.total() + 0.02)


def test_per_draft_token_overhead_prices_every_draft_token():
    cost = linear(fixed_s=0.010, per_token_s=0.001)
    bare, loaded = StepCost(cost, 4), StepCost(cost, 4, overhead=Overhead(0.0, 0.003))
    assert loaded.total() == pytest.approx(bare.total())
    assert loaded.marginal(0) == pytest.approx(bare.marginal(0) + 0.003)
    bare.add(0), loaded.add(0), bare.add(1), loaded.add(1)
    assert loaded.total() == pytest.approx(bare.total() + 0.006)


def test_with_the_overhead_known_a_marginal_draft_token_pays():
    """Each verified token costs 2 ms on a 10 ms step: at acceptance 0.3 a draft token returns
    0.3 tokens for over 2 ms, less than the step's 0.4 tokens per ms. Add 40 ms that every step
    pays anyway and the same token beats the step's rate, 4 tokens in 50 ms."""
    cost = linear(fixed_s=0.002, per_token_s=0.002, draft_s=0.0001)
    states = [SpecState(alpha=0.3, policy="faser", max_k=1) for _ in range(4)]
    load = LoadView(4, 0, 0, 64, 0.1)

    def planned(overhead: Overhead) -> list[int]:
        policy = FaserPolicy(SpecConfig(policy="faser", num_speculative_tokens=1), cost)
        policy.set_overhead(overhead)
        return policy.plan(states, load).max_k

    assert planned(Overhead()) == [0, 0, 0, 0]
    assert planned(Overhead(0.010)) == [1, 1, 1, 1]  # 40 ms over the 4 requests
    # but not when each verified draft token also costs 5 ms more than the profile says
    assert planned(Overhead(0.010, 0.005)) == [0, 0, 0, 0]


def _stuck_high(per_request_s: float, per_token_s: float, n: int = 4) -> StepOverhead:
    """A fit whose few speculative steps (one draft token per request, among plain ones) made a
    draft token look `per_token_s` dearer than the profile: what a policy then stops paying for."""
    overhead = StepOverhead()
    for k in (0, 1, 0, 1, 1, 0, 1, 0) * 3:
        overhead.observe(0.0, per_request_s * n + per_token_s * n * k, n, n * k)
    return overhead


def test_a_draft_token_price_without_fresh_evidence_relaxes_toward_a_requests():
    """Plain steps say nothing about draft tokens: as the speculative steps' evidence ages, the
    prior (a draft token costs what a request does, which plain steps keep measuring) takes
    over; while speculative steps keep coming it counts for nothing."""
    overhead = _stuck_high(0.002, 0.008)
    assert overhead.estimate.per_draft_token_s == pytest.approx(0.008, rel=0.05)
    assert overhead.estimate.per_request_s == pytest.approx(0.002, rel=0.15)
    relaxed = []
    for _ in range(100):
        overhead.observe(0.0, 0.002 * 4, 4, 0)
        relaxed.append(overhead.estimate.per_draft_token_s)
    assert relaxed == sorted(relaxed, reverse=True)
    assert 0.006 < relaxed[9] < 0.008  # not at once: a short quiet stretch is no evidence
    assert relaxed[39] < 0.005  # past halfway within 40 steps
    assert 0.002 <= relaxed[-1] < 0.0025
    assert overhead.estimate.per_request_s == pytest.approx(0.002, rel=0.05)
    overhead.observe(0.0, 0.002 * 4 + 0.008 * 4, 4, 4)  # the same price measured again
    assert overhead.estimate.per_draft_token_s > 0.004


def test_fresh_evidence_outweighs_the_prior():
    """Steps that keep speculating are priced by what they measure, not by the prior."""
    overhead = StepOverhead()
    for n, k in [(4, 1), (8, 2), (4, 0), (16, 1)] * 20:
        overhead.observe(0.0, 0.001 * n + 0.006 * n * k, n, n * k)
    assert overhead.estimate.per_draft_token_s == pytest.approx(0.006, rel=0.02)
    assert overhead.estimate.per_request_s == pytest.approx(0.001, rel=0.1)


def test_a_relaxed_price_lets_the_policy_try_speculation_again():
    """The decision the prior exists for. A target forward of 40 ms, 2 ms more per token, each
    request 1 ms beyond it: at acceptance 0.3 a draft token pays if it costs under about 1.6 ms
    beyond the profile. Priced at 10 ms by a few steps, faser stops speculating; the plain steps
    that follow bring the price back toward a request's 1 ms, and faser tries again."""
    cost = linear(fixed_s=0.040, per_token_s=0.002, draft_s=0.0001)
    states = [SpecState(alpha=0.3, policy="faser", max_k=1) for _ in range(4)]
    load = LoadView(4, 0, 0, 64, 0.1)
    policy = FaserPolicy(SpecConfig(policy="faser", num_speculative_tokens=1), cost)
    overhead = _stuck_high(0.001, 0.010)
    policy.set_overhead(overhead.estimate)
    plans = []
    for _ in range(200):  # as in the engine: plan a step, run it plain, learn from it
        plans.append(policy.plan(states, load).max_k)
        overhead.observe(0.0, 0.001 * 4, 4, 0)
        policy.set_overhead(overhead.estimate)
    first = plans.index([1, 1, 1, 1])
    assert plans[:20] == [[0, 0, 0, 0]] * 20
    assert first < 200


def test_the_first_step_of_a_shape_teaches_nothing_when_asked():
    """A shape's first step also warms its kernels up (it can take several times as long as the
    next): the engine's fit skips it, so that one cold step does not price draft tokens
    for the rest of the run; later steps of that shape are learned from."""
    cold, plain = StepOverhead(skip_cold_shapes=True), StepOverhead()
    for overhead in (cold, plain):
        overhead.observe(0.012, 0.047, 4, 4)  # first of 8 rows: cold
        overhead.observe(0.010, 0.011, 4, 0)  # first of 4 rows
        for _ in range(3):
            overhead.observe(0.012, 0.013, 4, 4)
            overhead.observe(0.010, 0.011, 4, 0)
    assert cold.num_steps == 6 and plain.num_steps == 8
    assert cold.estimate.seconds(4, 4) == pytest.approx(0.001, rel=0.05)
    assert plain.estimate.seconds(4, 4) > 0.005  # the cold step still weighs in
    cold.observe(0.020, 0.090, 4, 12)  # a new shape's first step is skipped again
    assert cold.num_steps == 6
