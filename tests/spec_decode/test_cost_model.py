"""The cost model's online corrections, on synthetic curves."""

import pytest

from faser.spec_decode.cost_model import CostModel
from faser.spec_decode.planner import choose_k
from tests.spec_decode.spec_profiles import linear, roofline


def test_a_step_costs_its_draft_forwards_its_verification_and_the_corrections():
    curve = linear(fixed_s=0.010, per_token_s=0.001, draft_s=0.0005)
    cost = CostModel(curve)
    # draft forwards over 2, 2, 1 requests; the target verifies 3 + 5 rows and 4 prefill tokens
    drafts = 2 * curve.draft_time(2) + curve.draft_time(1)
    assert _drafts(curve, [3, 2, 0]) == pytest.approx(drafts)
    assert cost.step_time(3, [3, 2, 0], 4) == pytest.approx(drafts + curve.target_time(12))
    cost.decode_scale, cost.verify_ratio, cost.draft_scale = 0.9, 1.2 / 0.9, 1.5
    cost.first_draft_scale = 2.0  # the step's first draft forward, its weights cold
    assert cost.step_time(3, [3, 2, 0], 4) == pytest.approx(
        2.0 * curve.draft_time(2) + 1.5 * (curve.draft_time(2) + curve.draft_time(1))
        + 1.2 * curve.target_time(12)
    )
    assert cost.verify_time(3, 5, 4) == pytest.approx(1.2 * curve.target_time(12))
    assert cost.verify_time(3, 0, 4) == pytest.approx(0.9 * curve.target_time(7))
    assert cost.draft_time(2) == pytest.approx(1.5 * curve.draft_time(2))
    # a step that verifies no draft token is a plain decode
    assert cost.step_time(2, []) == pytest.approx(0.9 * curve.target_time(2))
    assert cost.step_time(2, [0, 0], 4) == pytest.approx(0.9 * curve.target_time(6))


def test_the_corrections_learn_what_served_steps_add_to_the_profile():
    """Served steps attend over long contexts and sample: verification 1.3 times, a plain decode
    1.1 times and drafting 1.5 times as slow as the profile says."""
    curve = roofline()
    cost = CostModel(curve)
    for ks in ([0, 0], [2, 1], [4, 4], [3, 0], [0, 1]):
        rows, scale = 2 + sum(ks), 1.3 if any(ks) else 1.1
        for _ in range(2):
            drafting = 1.5 * _drafts(curve, ks)
            cost.observe(2, ks, _rows(ks), drafting, scale * curve.target_time(rows))
    assert cost.target_scale == pytest.approx(1.3)
    assert cost.decode_scale == pytest.approx(1.1)
    assert cost.draft_scale == pytest.approx(1.5)


def test_a_replica_that_has_only_decoded_prices_verification_at_its_decode_scale():
    """Plain steps that measure 1.8 times the profile (long contexts at 32 requests) say the
    same of a verifying step's forward of as many rows: priced at the bare profile instead, one
    draft token looked like a gain and faser drafted, and lost, until its own steps taught it."""
    curve = linear(fixed_s=0.010, per_token_s=0.0005, draft_s=0.0004)
    cost = CostModel(curve)
    for _ in range(20):
        cost.observe(32, [0] * 32, [], 0.0, 1.8 * curve.target_time(32))
    assert cost.target_scale == pytest.approx(1.8) and cost.num_observed == 0
    acceptance = [[0.5]] + [[0.0]] * 31
    assert choose_k(acceptance, cost).ks == (0,) * 32
    drafting = cost.step_time(32, [1] + [0] * 31)
    assert drafting == pytest.approx(1.8 * curve.target_time(33) + curve.draft_time(1))


def test_steps_that_verify_drafts_do_not_price_the_steps_that_do_not():
    """Four requests at k = 1 whose verification costs 1.6 times the profile's forward: what
    that teaches says nothing of their plain decode step, which keeps the profile's price, and
    the planner keeps k = 0 where a single scale learned from those steps had it draft."""
    curve = linear(fixed_s=0.006, per_token_s=0.0005, draft_s=0.0003)
    cost = CostModel(curve)
    for _ in range(50):
        drafting = _drafts(curve, [1] * 4)
        cost.observe(4, [1] * 4, [4], drafting, 1.6 * curve.target_time(8))
    assert cost.target_scale == pytest.approx(1.6)
    assert cost.decode_scale == 1.0
    assert cost.step_time(4, [0] * 4) == pytest.approx(curve.target_time(4))
    acceptance = [[0.45]] * 4
    assert choose_k(acceptance, cost).ks == (0, 0, 0, 0)
    one_scale = CostModel(curve)
    one_scale.decode_scale = 1.6
    assert choose_k(acceptance, one_scale).ks == (1, 1, 1, 1)


def test_verifications_measured_before_any_plain_step_keep_their_price_after_one():
    """A replica that drafts from its first step learns what verifying costs (1.5 times the
    profile) before any plain step measures the decode scale (1.2): verification stays at 1.5,
    where carrying it up with the decode scale priced it at 1.8 and faser stopped drafting at
    one request, whose drafts were paying."""
    curve = linear(fixed_s=0.010, per_token_s=0.0005, draft_s=0.0004)
    cost = CostModel(curve)
    for _ in range(3):
        cost.observe(1, [1], [1], curve.draft_time(1), 1.5 * curve.target_time(2))
    assert cost.target_scale == pytest.approx(1.5) and cost.num_decodes == 0
    for _ in range(2):
        cost.observe(1, [0], [], 0.0, 1.2 * curve.target_time(1))
    assert cost.decode_scale == pytest.approx(1.2)
    assert cost.verify_time(1, 1) == pytest.approx(1.5 * curve.target_time(2))
    cost.decode_scale = 1.0  # the host drifts: verification moves with the plain step from now on
    assert cost.target_scale == pytest.approx(1.25)


def test_the_draft_scale_follows_a_drifting_draft():
    curve = roofline()
    cost = CostModel(curve)
    for scale in (1.5, 3.0):
        for _ in range(300):
            cost.observe(1, [2], _rows([2]), scale * _drafts(curve, [2]), curve.target_time(3))
        assert cost.draft_scale == pytest.approx(scale, rel=0.01)


def test_the_first_draft_forward_and_the_others_learn_their_own_scales():
    """A step's first draft forward reads the draft's weights cold, at 3 times the profile, and
    the others warm, at 1.1 times: each learns its own, so a second draft token is priced at
    what it adds (one scale for both priced it at about twice that)."""
    curve = roofline()
    cost = CostModel(curve)

    def measured(ks):
        rows = _rows(ks)
        return 3.0 * curve.draft_time(rows[0]) + 1.1 * sum(curve.draft_time(r) for r in rows[1:])

    for ks in ([1, 1, 1, 1], [2, 2, 2, 2], [2, 1, 2, 1]) * 40:
        cost.observe(4, ks, _rows(ks), measured(ks), curve.target_time(4 + sum(ks)))
    assert cost.first_draft_scale == pytest.approx(3.0, rel=0.01)
    assert cost.draft_scale == pytest.approx(1.1, rel=0.01)
    assert cost.step_time(4, [2] * 4) - cost.step_time(4, [1] * 4) == pytest.approx(
        1.1 * curve.draft_time(4) + curve.target_time(12) - curve.target_time(8))


def test_a_catch_up_is_priced_by_the_tokens_its_draft_forward_fed():
    """Four requests resume drafting after plain steps: the first draft forward feeds each the
    tokens it missed (12 rows, not 4), and the draft runs at 1.5 times the profile. Priced by the
    kept tokens' rows, those steps taught a draft scale of over 2 that stopped speculation for
    good; by the rows fed, the scale is the draft's own."""
    curve = roofline(draft_knee=4)
    cost = CostModel(curve)
    for _ in range(20):
        fed = [12, 4]  # a catch-up of two tokens per request, then one draft forward over four
        measured = 1.5 * sum(curve.draft_time(r) for r in fed)
        cost.observe(4, [2] * 4, fed, measured, curve.target_time(12))
    assert measured > 2 * _drafts(curve, [2] * 4)  # what pricing the kept tokens would learn
    assert cost.draft_scale == pytest.approx(1.5)


def test_the_first_step_of_each_shape_is_ignored():
    """A kernel's first call at a size plans and allocates: a slow step that teaches nothing."""
    curve = roofline()
    cost = CostModel(curve)
    cost.observe(2, [1, 1], _rows([1, 1]), 1.0, 1.0)
    assert (cost.target_scale, cost.draft_scale, cost.num_observed) == (1.0, 1.0, 0)
    cost.observe(2, [1, 1], _rows([1, 1]), _drafts(curve, [1, 1]), 1.1 * curve.target_time(4))
    assert cost.target_scale == pytest.approx(1.1) and cost.num_observed == 1
    cost.observe(2, [2, 0], [1, 1], 5.0, 5.0)  # 4 rows again, but a longest draft of 2: new
    cost.observe(3, [0, 0, 0], [], 5.0, 5.0)  # 3 rows: new
    assert cost.target_scale == pytest.approx(1.1) and cost.num_observed == 1


def test_a_step_without_drafts_leaves_the_draft_scale_alone():
    cost = CostModel(roofline())
    for _ in range(3):
        cost.observe(2, [0, 0], [], 0.0, cost.profile.target_time(2))
    assert cost.draft_scale == 1.0 and cost.num_decodes == 2 and cost.num_observed == 0


def test_the_scales_follow_the_mean_step():
    """Goodput is tokens over the mean step: noisy steps (below STALL) settle each scale at their
    mean, the speculative step's two phases as the off step's one."""
    curve = roofline()
    cost = CostModel(curve)
    noise = [0.9, 1.5, 1.2] * 100  # mean 1.2
    for x in noise:
        cost.observe(1, [0], [], 0.0, x * curve.target_time(1))
        cost.observe(1, [2], _rows([2]), x * _drafts(curve, [2]), x * curve.target_time(3))
    for scale in (cost.decode_scale, cost.target_scale, cost.draft_scale):
        assert scale == pytest.approx(1.2, abs=0.05)


def test_a_stalled_step_teaches_the_corrections_nothing():
    """A replica's first steps once took seconds (the host stalled): priced, they set the scales
    a hundredfold and speculation, the only thing that measures them again, never ran again."""
    curve = roofline()
    cost = CostModel(curve)
    for ks in ([0], [0], [2], [2]):
        drafting, verifying = 1.6 * _drafts(curve, ks), 1.3 * curve.target_time(1 + sum(ks))
        cost.observe(1, ks, _rows(ks), drafting, verifying)
    settled = (cost.target_scale, cost.draft_scale, cost.decode_scale)
    assert settled == pytest.approx((1.3, 1.6, 1.3))
    stalled = 300 * _drafts(curve, [2])
    cost.observe(1, [2], [1, 1], stalled, curve.target_time(3))  # the draft stalled
    cost.observe(1, [2], [1, 1], _drafts(curve, [2]), 300 * curve.target_time(3))  # the target did
    cost.observe(1, [0], [], 0.0, 100 * curve.target_time(1))
    assert (cost.target_scale, cost.draft_scale, cost.decode_scale) == settled
    assert choose_k([[0.8, 0.8]], cost).ks == (2,)
    slower = 3 * _drafts(curve, [2])
    cost.observe(1, [2], [1, 1], slower, 2 * curve.target_time(3))  # slower, not stalled
    assert cost.target_scale > settled[0] and cost.draft_scale > settled[1]


def test_verifying_drafts_is_never_priced_below_a_plain_step_of_as_many_rows():
    """Scales learned from other shapes: plain steps of 16 requests at 1.36 times the profile,
    wide verifying steps at 0.98 times. One draft token on top of the 16 rows costs what a
    17-row plain step would, never less than the 16-row step it contains."""
    curve = linear(fixed_s=0.010, per_token_s=0.0005, draft_s=0.0004)
    cost = CostModel(curve)
    cost.decode_scale, cost.verify_ratio = 1.36, 0.72
    assert cost.target_scale == pytest.approx(1.36)
    assert cost.verify_time(16, 1) == pytest.approx(1.36 * curve.target_time(17))
    assert cost.verify_time(16, 1) > cost.verify_time(16)
    assert choose_k([[0.2]] + [[0.0]] * 15, cost).ks == (0,) * 16


def _rows(ks):
    """The tokens each draft forward feeds when no draft lags: forward j, one per request with
    k > j."""
    return [sum(k > j for k in ks) for j in range(max(ks, default=0))]


def _drafts(curve, ks):
    """The profiled seconds of drafting `ks`."""
    return sum(curve.draft_time(r) for r in _rows(ks))
