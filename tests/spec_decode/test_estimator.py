"""The acceptance estimator: per-request rates from verified trials, a population prior, and the
draft's confidence calibrated per bin, prompt lookup's guesses per n-gram length."""

import random

import pytest

from faser.spec_decode.estimator import (
    BIN_PRIOR_TRIALS,
    CONFIDENCE_WEIGHT,
    DECAY,
    PRIOR_TRIALS,
    AcceptanceEstimator,
)
from faser.spec_decode.lookup import PRIOR_PRECISION
from faser.spec_decode.state import SpecState


def fresh(prior=0.5):
    return SpecState(alpha=prior, policy="faser", max_k=8)


@pytest.mark.parametrize("prior", [0.0, 1.0, -0.1, 1.5])
def test_the_prior_must_lie_strictly_between_zero_and_one(prior):
    with pytest.raises(ValueError, match="alpha_prior"):
        AcceptanceEstimator(prior)


def test_a_new_request_starts_at_the_prior():
    estimator = AcceptanceEstimator(0.3)
    assert estimator.prior == pytest.approx(0.3)
    assert estimator.alpha(fresh()) == pytest.approx(0.3)
    assert estimator.before_draft(fresh(), 3) == pytest.approx([0.3] * 3)
    assert estimator.before_draft(fresh(), 0) == []


@pytest.mark.parametrize(
    ("num_accepted", "trials"), [(0, 1), (2, 3), (3, 4), (4, 4)]
)
def test_a_step_counts_the_trials_up_to_the_first_rejection(num_accepted, trials):
    """Positions after the first rejection were never judged: 2 accepted of 4 drafted is 3
    trials (two accepted, one rejected), 4 of 4 is 4."""
    state = fresh()
    AcceptanceEstimator(0.5).observe(state, [0.5] * 4, num_accepted)
    assert (state.accepted, state.trials) == (num_accepted, trials)


def test_nothing_drafted_teaches_nothing():
    estimator, state = AcceptanceEstimator(0.5), fresh()
    estimator.observe(state, [], 0)
    assert (state.accepted, state.trials) == (0.0, 0.0)
    assert estimator.prior == pytest.approx(0.5)


def test_counting_trials_reads_the_true_rate_where_accepted_per_drafted_does_not():
    """True rate 0.8, k = 4: accepted / drafted reads about 0.59."""
    rng = random.Random(0)
    estimator, states = AcceptanceEstimator(0.5), [fresh() for _ in range(20)]
    accepted = drafted = 0
    for _ in range(100):
        for state in states:
            n = next((t for t in range(4) if rng.random() >= 0.8), 4)
            estimator.observe(state, [0.5] * 4, n)
            accepted, drafted = accepted + n, drafted + 4
    assert accepted / drafted < 0.65
    assert estimator.prior == pytest.approx(0.8, abs=0.05)
    assert sum(estimator.alpha(s) for s in states) / len(states) == pytest.approx(0.8, abs=0.05)


def test_earlier_trials_decay():
    state = fresh()
    estimator = AcceptanceEstimator(0.5)
    estimator.observe(state, [0.5] * 4, 4)
    estimator.tick()  # the next engine step
    estimator.observe(state, [0.5] * 4, 0)
    assert state.accepted == pytest.approx(DECAY * 4)
    assert state.trials == pytest.approx(DECAY * 4 + 1)


def test_a_request_that_stopped_drafting_ages_back_to_the_prior():
    """Its estimate is not measured while it does not draft: without ageing, a run of
    rejections would keep it below what pays for good."""
    estimator, unlucky = AcceptanceEstimator(0.5), fresh()
    for _ in range(5):
        estimator.observe(unlucky, [0.5], 0)
        estimator.tick()
    assert estimator.alpha(unlucky) < 0.4
    for _ in range(100):
        estimator.tick()
    assert estimator.alpha(unlucky) == pytest.approx(estimator.prior, abs=0.01)


def test_recent_steps_count_most():
    """Two requests with the same history in opposite orders: the one that is accepting now is
    the likelier."""
    estimator = AcceptanceEstimator(0.5)
    recovering, failing = fresh(), fresh()
    for good in [False] * 20 + [True] * 20:
        estimator.observe(recovering, [0.5] * 2, 2 if good else 0)
        estimator.observe(failing, [0.5] * 2, 0 if good else 2)
        estimator.tick()
    assert estimator.alpha(recovering) > estimator.alpha(failing) + 0.3


def test_observe_stores_the_new_estimate_on_the_state():
    estimator, state = AcceptanceEstimator(0.5), fresh()
    estimator.observe(state, [0.5] * 4, 0)
    assert state.alpha == pytest.approx(estimator.alpha(state))
    assert state.alpha < 0.5


def test_a_new_requests_prior_moves_with_every_requests_observations():
    estimator = AcceptanceEstimator(0.5)
    for _ in range(50):
        estimator.observe(fresh(), [0.5] * 4, 4)
    assert estimator.prior > 0.8
    assert estimator.alpha(fresh()) == pytest.approx(estimator.prior)


def test_a_population_measured_low_ages_back_to_the_configured_prior():
    """A short warm-up whose drafts were rejected must not keep every later request from
    drafting: a planner that stops drafting gathers no evidence against it."""
    estimator = AcceptanceEstimator(0.5)
    for _ in range(4):
        estimator.observe(fresh(), [0.5] * 2, 0)
        estimator.tick()
    assert estimator.prior < 0.4
    for _ in range(200):
        estimator.tick()
    assert estimator.prior == pytest.approx(0.5, abs=0.01)
    assert estimator.alpha(fresh()) == pytest.approx(estimator.prior)


def test_a_requests_own_trials_outweigh_the_prior():
    estimator = AcceptanceEstimator(0.5)
    state = fresh()
    for _ in range(10):
        estimator.observe(state, [0.5] * 4, 0)
    state.accepted = state.trials = 100.0  # its own record: everything accepted
    expected = (100.0 + PRIOR_TRIALS * estimator.prior) / (100.0 + PRIOR_TRIALS)
    assert estimator.alpha(state) == pytest.approx(expected)
    assert estimator.alpha(state) > 0.9 > estimator.prior


# -- calibration --------------------------------------------------------------------------------


@pytest.mark.parametrize("q", [0.0, 0.05, 0.37, 0.5, 0.99, 1.0])
def test_an_unseen_bin_answers_the_confidence_itself(q):
    assert AcceptanceEstimator(0.5).calibrated(q) == pytest.approx(q)


def test_calibration_learns_per_bin():
    """A draft that is unsure (q = 0.15) of tokens the target always takes."""
    estimator = AcceptanceEstimator(0.5)
    for _ in range(50):
        estimator.observe(fresh(), [0.15, 0.15], 2)
    assert estimator.calibrated(0.15) > 0.9
    assert estimator.calibrated(0.11) == pytest.approx(estimator.calibrated(0.15), rel=0.05)
    assert estimator.calibrated(0.55) == pytest.approx(0.55)  # another bin: untouched


def test_calibration_counts_only_the_judged_positions():
    """1 of 4 accepted: the first is accepted, the second rejected, the last two never judged."""
    estimator = AcceptanceEstimator(0.5)
    estimator.observe(fresh(), [0.95, 0.85, 0.15, 0.15], 1)
    assert estimator.calibrated(0.95) == pytest.approx(
        (1 + BIN_PRIOR_TRIALS * 0.95) / (1 + BIN_PRIOR_TRIALS)
    )
    assert estimator.calibrated(0.85) == pytest.approx(
        (0 + BIN_PRIOR_TRIALS * 0.85) / (1 + BIN_PRIOR_TRIALS)
    )
    assert estimator.calibrated(0.15) == pytest.approx(0.15)


def test_looked_up_tokens_count_for_the_request_and_their_length_not_the_calibration():
    estimator, state = AcceptanceEstimator(0.5), fresh()
    assert estimator.lookup_precision(3) == pytest.approx(PRIOR_PRECISION)
    estimator.observe(state, [0.95, 0.35], 0, looked_up=[3, 0])
    assert state.trials == 1.0 and state.accepted == 0.0
    assert estimator.calibrated(0.95) == pytest.approx(0.95)
    assert estimator.lookup_precision(3) == pytest.approx(
        BIN_PRIOR_TRIALS * PRIOR_PRECISION / (1 + BIN_PRIOR_TRIALS)
    )
    estimator.observe(state, [0.95, 0.35], 1, looked_up=[0, 4])
    assert estimator.calibrated(0.95) == pytest.approx(
        (1 + BIN_PRIOR_TRIALS * 0.95) / (1 + BIN_PRIOR_TRIALS)
    )
    assert estimator.calibrated(0.35) == pytest.approx(0.35)
    # the rejected 4-gram guess counts for its length only
    assert estimator.lookup_precision(4) == pytest.approx(
        BIN_PRIOR_TRIALS * PRIOR_PRECISION / (1 + BIN_PRIOR_TRIALS)
    )
    assert estimator.lookup_precision(2) == pytest.approx(PRIOR_PRECISION)


def test_lookup_precision_follows_the_verified_guesses():
    estimator, state = AcceptanceEstimator(0.5), fresh()
    for i in range(200):  # 4-grams right 4 times in 5
        estimator.observe(state, [0.9], int(i % 5 != 0), looked_up=[4])
    assert estimator.lookup_precision(4) == pytest.approx(0.8, abs=0.01)
    assert estimator.lookup_precision(2) == pytest.approx(PRIOR_PRECISION)


def test_a_sampled_request_leaves_the_bins_alone():
    estimator, state = AcceptanceEstimator(0.5), fresh()
    state.greedy = False
    estimator.observe(state, [0.95] * 4, 0)
    assert estimator.calibrated(0.95) == pytest.approx(0.95)
    assert state.trials == 1.0  # the request's own rate still learns


def test_after_drafting_the_calibrated_confidence_blends_with_alpha():
    estimator, state = AcceptanceEstimator(0.5), fresh()
    w = CONFIDENCE_WEIGHT
    assert estimator.after_draft(state, [0.9, 0.1]) == pytest.approx(
        [w * 0.9 + (1 - w) * 0.5, w * 0.1 + (1 - w) * 0.5]
    )
    assert estimator.after_draft(state, []) == []


def test_a_sampled_requests_drafts_keep_its_own_rate():
    # its confidences are the chances of tokens drawn at its temperature, not the calibration's
    estimator, state = AcceptanceEstimator(0.5), fresh()
    state.greedy = False
    assert estimator.after_draft(state, [0.9, 0.01]) == [0.5, 0.5]


def test_trimmed_drafts_count_as_their_calibrated_chances():
    """Unverified, they count as verifying them would likely have gone: with nothing calibrated
    yet a confidence q is its own chance, so [0.2, 0.5] trimmed whole is 0.2 + 0.2 * 0.5
    accepted of 1 + 0.2 trials; after a rejection among the verified ones they count nothing."""
    estimator, state = AcceptanceEstimator(0.5), fresh()
    estimator.observe(state, [], 0, trimmed=[0.2, 0.5])
    assert (state.accepted, state.trials) == pytest.approx((0.3, 1.2))
    state = fresh()
    estimator.observe(state, [0.9], 1, trimmed=[0.3])
    assert (state.accepted, state.trials) == pytest.approx((1.3, 2.0))
    state = fresh()
    estimator.observe(state, [0.9, 0.9], 1, trimmed=[0.3])
    assert (state.accepted, state.trials) == pytest.approx((1.0, 2.0))


@pytest.mark.parametrize("count_trimmed", [True, False])
def test_a_rate_learned_behind_trimming_is_the_rate_of_what_is_drafted(count_trimmed):
    """Each draft is accepted with its confidence q ~ U(0, 1) and trimmed below 0.5: the drafts
    go 0.5 on average, the verified ones 0.75. Counting the trimmed ones reads the former."""
    rng = random.Random(0)
    estimator, state = AcceptanceEstimator(0.5), fresh()
    for _ in range(4000):
        q = rng.random()
        if q < 0.5:
            estimator.observe(state, [], 0, trimmed=[q] if count_trimmed else ())
        else:
            estimator.observe(state, [q], int(rng.random() < q))
    assert estimator.prior == pytest.approx(0.5 if count_trimmed else 0.75, abs=0.03)


def test_a_sampled_requests_trimmed_drafts_count_nothing():
    # its own rate, not their confidences, trimmed them: there is no selection to correct
    estimator, state = AcceptanceEstimator(0.5), fresh()
    state.greedy = False
    estimator.observe(state, [], 0, trimmed=[0.2, 0.5])
    assert (state.accepted, state.trials) == (0.0, 0.0)
