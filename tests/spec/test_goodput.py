import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faser.spec.cost_model import CostProfile
from faser.spec.goodput import (
    StepCost,
    calibrate,
    choose_frontier_size,
    choose_k,
    expected_accepted,
    expected_verify_time,
    survival,
)
from tests.spec.spec_profiles import linear, roofline


def test_expected_accepted_by_hand():
    acceptance = [0.8, 0.5, 0.5]
    assert survival(acceptance) == pytest.approx([0.8, 0.4, 0.2])
    assert [expected_accepted(acceptance, k) for k in range(4)] == pytest.approx(
        [0.0, 0.8, 1.2, 1.4]
    )
    # constant alpha: the geometric sum alpha (1 - alpha^k) / (1 - alpha)
    assert expected_accepted([0.6] * 5, 5) == pytest.approx(0.6 * (1 - 0.6**5) / 0.4)


def test_calibrate_blends_and_validates():
    assert calibrate([1.0, 0.2], alpha=0.6, weight=0.5) == pytest.approx([0.8, 0.4])
    assert calibrate([0.9], alpha=0.3, weight=0.0) == pytest.approx([0.3])
    with pytest.raises(ValueError, match="weight"):
        calibrate([0.5], alpha=0.5, weight=1.5)


def test_step_cost_of_a_ragged_draft_batch():
    cost = CostProfile((1, 2, 4, 8), (1.0, 1.0, 2.0, 4.0), (1, 2, 4), (0.1, 0.15, 0.25))
    step = StepCost(cost, num_requests=2)
    assert step.total() == pytest.approx(1.0)  # two decode tokens, no draft
    for position in (0, 0, 1):  # k = (2, 1): draft steps over 2 then 1 requests
        step.add(position)
    # draft 0.15 + 0.1; target over 2 + 3 tokens
    assert step.total() == pytest.approx(0.25 + 2.5)
    overlapped = StepCost(cost, 2, overlap=True)
    overlapped.add(0)
    # half the drafting stays on the critical path, the rest hides behind the target
    assert overlapped.total() == pytest.approx(0.05 + max(0.05, 1.5))


def _goodput(ks, acceptance, cost, prefill=0, overlap=False):
    step = StepCost(cost, len(ks), prefill, overlap=overlap)
    for j in range(max(ks, default=0)):
        for k in ks:
            if k > j:
                step.add(j)
    accepted = sum(expected_accepted(a, k) for a, k in zip(acceptance, ks, strict=True))
    return (len(ks) + accepted) / step.total()


def test_no_speculation_when_the_target_is_saturated():
    steep = linear(fixed_s=0.0001, per_token_s=0.01)  # every verified token costs a full token
    choice = choose_k([[0.5] * 4] * 8, StepCost(steep, 8))
    assert choice.ks == [0] * 8 and not choice.speculates
    assert choice.goodput == pytest.approx(choice.baseline_goodput)


def test_memory_bound_target_gets_full_speculation():
    choice = choose_k([[0.7] * 4] * 4, StepCost(roofline(knee=64), 4))
    assert choice.ks == [4] * 4
    assert choice.goodput > choice.baseline_goodput


def test_higher_alpha_gets_longer_k():
    cost = linear(fixed_s=0.010, per_token_s=0.0004, draft_s=0.0002)
    acceptance = [[0.95] * 8, [0.7] * 8, [0.4] * 8]
    ks = choose_k(acceptance, StepCost(cost, 3)).ks
    assert ks[0] > ks[1] > ks[2]


def test_token_budget_goes_to_the_likeliest_tokens():
    acceptance = [[0.9] * 4, [0.3] * 4]
    choice = choose_k(acceptance, StepCost(roofline(knee=512), 2), token_budget=3)
    assert sum(choice.ks) == 3 and choice.ks == [3, 0]


def test_step_time_target_trims_the_least_gainful_first():
    cost = linear(fixed_s=0.010, per_token_s=0.0001, draft_s=0.0001)
    acceptance = [[0.9] * 4, [0.5] * 4]
    free = choose_k(acceptance, StepCost(cost, 2))
    assert free.ks == [4, 4]
    tight = choose_k(acceptance, StepCost(cost, 2), max_step_time_s=free.step_time_s - 0.0003)
    assert tight.step_time_s <= free.step_time_s - 0.0003
    assert tight.ks[0] == 4 and tight.ks[1] < 4
    assert choose_k(acceptance, StepCost(cost, 2), max_step_time_s=0.001).ks == [0, 0]


def test_min_gain_demands_a_margin_over_no_speculation():
    cost = linear(fixed_s=0.010, per_token_s=0.002, draft_s=0.0005)
    acceptance = [[0.6] * 2]
    choice = choose_k(acceptance, StepCost(cost, 1))
    assert choice.speculates
    gain = choice.goodput / choice.baseline_goodput - 1.0
    assert not choose_k(acceptance, StepCost(cost, 1), min_gain=gain * 1.01).speculates


PROFILES = [roofline(knee=4), roofline(knee=16), linear(0.01, 0.001, 0.001), linear(0.01, 1e-4)]


@settings(max_examples=60, deadline=None)
@given(
    acceptance=st.lists(
        st.lists(st.floats(0.01, 0.99), min_size=0, max_size=3), min_size=1, max_size=3
    ),
    profile=st.sampled_from(PROFILES),
    prefill=st.sampled_from([0, 20]),
    overlap=st.booleans(),
)
def test_greedy_matches_brute_force_on_small_batches(acceptance, profile, prefill, overlap):
    step = StepCost(profile, len(acceptance), prefill, overlap=overlap)
    choice = choose_k(acceptance, step)
    assert all(0 <= k <= len(a) for k, a in zip(choice.ks, acceptance, strict=True))
    assert choice.goodput == pytest.approx(
        _goodput(choice.ks, acceptance, profile, prefill, overlap)
    )
    grid = itertools.product(*(range(len(a) + 1) for a in acceptance))
    best = max(_goodput(list(ks), acceptance, profile, prefill, overlap) for ks in grid)
    assert choice.goodput >= 0.97 * best
    assert choice.goodput >= choice.baseline_goodput


def test_one_frontier_verify_time_is_one_forward():
    cost = linear(fixed_s=0.010, per_token_s=0.001)
    ks, acceptance = [3, 1], [[0.5] * 3, [0.5]]
    assert expected_verify_time(ks, acceptance, 3, cost) == pytest.approx(cost.target_time(6))


def test_frontier_verify_time_by_hand():
    cost = linear(fixed_s=0.010, per_token_s=0.001)
    # one request, k = 2, f = 1: frontier 0 always runs on one input; frontier 1 runs when the
    # first draft is accepted (p = 0.5) on position 1 plus the bonus input
    time_s = expected_verify_time([2], [[0.5, 0.5]], 1, cost)
    assert time_s == pytest.approx(cost.target_time(1) + 0.5 * cost.target_time(2))


def test_one_frontier_when_memory_bound():
    ks, acceptance = [8] * 4, [[0.6] * 8] * 4
    assert choose_frontier_size(ks, acceptance, roofline(knee=256)) is None


def test_smaller_frontiers_when_compute_bound():
    cost = linear(fixed_s=0.001, per_token_s=0.0001)  # knee about 12 tokens
    ks, acceptance = [8] * 32, [[0.6] * 8] * 32
    f = choose_frontier_size(ks, acceptance, cost)
    assert f == 2  # hand-computed: about 14 ms against 30 ms for one frontier
    one = expected_verify_time(ks, acceptance, 8, cost)
    assert expected_verify_time(ks, acceptance, f, cost) < 0.6 * one


def test_high_acceptance_keeps_one_frontier_even_past_the_knee():
    cost = linear(fixed_s=0.001, per_token_s=0.0001)
    ks, acceptance = [4] * 32, [[0.999] * 4] * 32  # nothing to prune
    assert choose_frontier_size(ks, acceptance, cost) is None
