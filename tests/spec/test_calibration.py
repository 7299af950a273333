"""Draft confidence -> acceptance, learned from runs of trials that stop at the first rejection."""

import pytest

from faser.config import SpecConfig
from faser.spec.calibration import PRIOR_TRIALS, ConfidenceCalibration
from faser.spec.plan import LoadView
from faser.spec.policy import FaserPolicy
from faser.spec.state import SpecState
from tests.spec.spec_profiles import linear


def test_an_unseen_confidence_is_taken_at_its_word():
    assert ConfidenceCalibration()(0.37) == pytest.approx(0.37)


def test_only_judged_positions_count():
    calibration = ConfidenceCalibration()
    # accepted, rejected, never judged
    calibration.observe([0.15, 0.25, 0.95], num_accepted=1)
    assert sum(calibration.trials) == 2
    assert calibration(0.95) == pytest.approx(0.95)
    assert calibration(0.15) == pytest.approx((1 + PRIOR_TRIALS * 0.15) / (1 + PRIOR_TRIALS))
    assert calibration(0.25) == pytest.approx(PRIOR_TRIALS * 0.25 / (1 + PRIOR_TRIALS))


def test_positions_from_another_source_are_left_out():
    calibration = ConfidenceCalibration()
    calibration.observe([0.15, 0.65, 0.25], num_accepted=3, skip=[False, True, False])
    assert sum(calibration.trials) == 2 and calibration.trials[6] == 0


def test_an_underconfident_draft_is_learned():
    calibration = ConfidenceCalibration()
    for i in range(300):  # tokens drafted at q = 0.1 are accepted 40 % of the time
        calibration.observe([0.1], num_accepted=int(i % 5 < 2))
    assert calibration(0.12) == pytest.approx(0.4, abs=0.02)


def test_faser_learns_from_what_it_verified_and_trims_less_once_it_knows():
    """A verified token costs 4 ms on a 14 ms step: it pays above acceptance 0.29. At alpha 0.5
    the plan drafts one; the draft then says q = 0.06, which blends to 0.28 and is cut, until
    tokens at that confidence have been seen accepted."""
    cost = linear(fixed_s=0.010, per_token_s=0.004)
    policy = FaserPolicy(SpecConfig(policy="faser", num_speculative_tokens=1), cost)
    state = SpecState(alpha=0.5, policy="faser", max_k=1)
    plan = policy.plan([state], LoadView(1, 0, 0, 64, 0.1))
    assert plan.max_k == [1]
    assert policy.trim(plan, [state], [[0.06]]) == [0]
    for _ in range(200):
        policy.observe(SpecState(alpha=0.5, policy="faser", max_k=1), 1, 1, [0.06])
    assert policy.calibration(0.06) > 0.9
    assert policy.trim(plan, [state], [[0.06]]) == [1]
