"""The step overhead: learned from measured minus profiled step times, added to every predicted
step whatever its k, so that a draft token is priced against the step it really rides in."""

import pytest

from faser.config import SpecConfig
from faser.spec.goodput import StepCost
from faser.spec.overhead import OVERHEAD_EMA, StepOverhead
from faser.spec.plan import LoadView
from faser.spec.policy import FaserPolicy
from faser.spec.state import SpecState
from tests.spec.spec_profiles import linear


def test_overhead_is_per_request_and_starts_at_the_first_residual():
    overhead = StepOverhead()
    assert overhead.per_request_s == 0.0
    overhead.observe(predicted_s=0.060, measured_s=0.084, num_requests=16)
    assert overhead.per_request_s == pytest.approx(0.0015)
    overhead.observe(predicted_s=0.060, measured_s=0.060, num_requests=16)
    assert overhead.per_request_s == pytest.approx(0.0015 * (1 - OVERHEAD_EMA))
    overhead.observe(predicted_s=0.0, measured_s=1.0, num_requests=0)  # nothing to divide by
    assert overhead.num_steps == 2


def test_a_profile_that_overprices_steps_gives_no_negative_overhead():
    overhead = StepOverhead()
    overhead.observe(predicted_s=0.080, measured_s=0.060, num_requests=4)
    assert overhead.per_request_s == 0.0


def test_overhead_adds_to_the_step_not_to_a_draft_tokens_price():
    cost = linear(fixed_s=0.010, per_token_s=0.001)
    bare, loaded = StepCost(cost, 4), StepCost(cost, 4, overhead_per_request_s=0.005)
    assert loaded.total() == pytest.approx(bare.total() + 0.02)
    assert loaded.marginal(0) == pytest.approx(bare.marginal(0))
    bare.add(0), loaded.add(0)
    assert loaded.total() == pytest.approx(bare.total() + 0.02)


def test_with_the_overhead_known_a_marginal_draft_token_pays():
    """Each verified token costs 2 ms on a 10 ms step: at acceptance 0.3 a draft token returns
    0.3 tokens for over 2 ms, less than the step's 0.4 tokens per ms. Add 40 ms that every step
    pays anyway and the same token beats the step's rate, 4 tokens in 50 ms."""
    cost = linear(fixed_s=0.002, per_token_s=0.002, draft_s=0.0001)
    states = [SpecState(alpha=0.3, policy="faser", max_k=1) for _ in range(4)]
    load = LoadView(4, 0, 0, 64, 0.1)

    def planned(overhead_s: float) -> list[int]:
        policy = FaserPolicy(SpecConfig(policy="faser", num_speculative_tokens=1), cost)
        policy.set_overhead_per_request(overhead_s)
        return policy.plan(states, load).max_k

    assert planned(0.0) == [0, 0, 0, 0]
    assert planned(0.010) == [1, 1, 1, 1]  # 40 ms over the 4 requests
