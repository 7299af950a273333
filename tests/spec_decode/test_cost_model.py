"""The cost profile (interpolation, knee, measurement, cache) and the cost model's online
corrections, on synthetic curves."""

import json
import math

import pytest

from faser.spec_decode.cost_model import (
    KNEE_GROWTH,
    PROFILE_VERSION,
    CostModel,
    CostProfile,
    cache_path,
    checkpoint_fingerprint,
    load_or_profile,
    load_profile,
    profile,
    profile_key,
    save_profile,
)
from faser.spec_decode.planner import choose_k
from tests.spec_decode.spec_profiles import linear, roofline


def test_interpolates_between_points_and_extrapolates_the_last_segment():
    cost = CostProfile((1, 4, 8), (1.0, 2.5, 4.5), (1, 2), (0.1, 0.3))
    assert cost.target_time(2) == pytest.approx(1.5)
    assert cost.target_time(6) == pytest.approx(3.5)
    assert cost.target_time(12) == pytest.approx(6.5)  # slope 0.5 past the last point
    assert cost.target_time(0.5) == pytest.approx(1.0)  # nothing beats the smallest forward
    assert cost.target_time(0) == 0.0
    assert cost.draft_time(3) == pytest.approx(0.5)
    assert cost.draft_time(0) == 0.0


def test_empty_draft_profile_means_free_drafting():
    cost = CostProfile((1, 2), (1.0, 2.0))
    assert cost.draft_time(8) == 0.0


@pytest.mark.parametrize(
    ("points", "times", "field"),
    [
        ((1, 1), (1.0, 2.0), "target_points"),
        ((1, 2), (1.0,), "target_points"),
        ((1, 2), (1.0, -1.0), "target_times"),
        ((), (), "target_points"),
        ((2, 1), (1.0, 2.0), "target_points"),
        ((0, 1), (1.0, 2.0), "target_points"),
        ((1, 2), (1.0, float("inf")), "target_times"),
    ],
)
def test_bad_profiles_name_the_field(points, times, field):
    with pytest.raises(ValueError, match=field):
        CostProfile(points, times)


@pytest.mark.parametrize(
    ("points", "times", "field"),
    [((1, 2), (0.1,), "draft_points"), ((1, 1), (0.1, 0.2), "draft_points"),
     ((1, 2), (0.1, 0.0), "draft_times")],
)
def test_bad_draft_profiles_name_the_field(points, times, field):
    with pytest.raises(ValueError, match=field):
        CostProfile((1, 2), (1.0, 2.0), points, times)


def test_knee_of_a_roofline_is_its_corner():
    assert roofline(knee=64).knee() == 64.0
    assert roofline(knee=16).knee() == 16.0


@pytest.mark.parametrize(
    ("fixed_s", "per_token_s", "knee"), [(0.010, 0.0001, 128.0), (0.010, 0.001, 8.0)]
)
def test_knee_of_a_linear_curve_is_the_first_doubling_that_costs_sqrt2_more(
    fixed_s, per_token_s, knee
):
    """t = t0 + c n grows by sqrt(2) over n -> 2n once n >= t0 / c / sqrt(2): the first such power
    of two."""
    curve = linear(fixed_s=fixed_s, per_token_s=per_token_s)
    assert curve.knee() == knee
    assert curve.target_time(2 * knee) >= KNEE_GROWTH * curve.target_time(knee)
    assert curve.target_time(knee) < KNEE_GROWTH * curve.target_time(knee / 2)


def test_knee_when_compute_bound_from_the_start():
    assert linear(fixed_s=0.001, per_token_s=0.01).knee() == 1.0


def test_knee_is_inf_on_a_flat_curve_or_a_single_point():
    assert CostProfile((1, 512), (1.0, 1.0)).knee() == math.inf
    assert CostProfile((1,), (1.0,)).knee() == math.inf


def test_knee_is_looked_for_within_the_profile_only():
    """No doubling fits in (1, 2, 4) that grows by sqrt(2), and none past 4 is tried."""
    assert CostProfile((1, 2, 4), (1.0, 1.1, 1.3)).knee() == math.inf
    assert CostProfile((1, 2, 4), (1.0, 1.1, 1.6)).knee() == 2.0


def test_profile_takes_the_least_after_warmup_and_never_decreases():
    calls = []
    # warmup (1, 2), then three rounds: (1, 2), (2, 1), (1, 2)
    noise = iter([9.0, 9.0] + [1.0, 0.9] + [0.8, 5.0] + [1.2, 5.0])

    def measure(n):
        calls.append(n)
        return next(noise)

    cost = profile(measure, None, points=(1, 2), repeats=3, warmup=1, key="k")
    assert calls == [1, 2, 1, 2, 2, 1, 1, 2]
    # the least are 1.0 and 0.8 (noise only slows a forward down; medians would be 1.2 and 0.9);
    # a bigger forward never costs less, so the lower envelope holds 0.8
    assert cost.target_times == (0.8, 0.8)
    assert cost.draft_points == () and cost.key == "k"


def test_a_drifting_machine_does_not_show_up_as_a_cost_of_size():
    """The machine slows by 1 ms with every call (a shared host getting busier): measured point
    by point, the larger forwards, timed later, pay for the drift and every step of the curve
    comes out 4 ms too steep. In rounds of alternating order each step is off by one call's
    drift."""
    clock = iter(range(1000))

    def measure(n):
        return 1e-3 * (n + next(clock))

    points = (1, 4, 8, 16)
    times = profile(measure, None, points=points, repeats=3, warmup=1).target_times
    for j in range(1, len(points)):
        step, true_step = times[j] - times[j - 1], 1e-3 * (points[j] - points[j - 1])
        assert abs(step - true_step) <= 1.5e-3


def test_cache_round_trip_measures_once(tmp_path):
    key = profile_key("tiny", "cpu", "float32", 2)
    measured = []

    def target(n):
        measured.append(n)
        return 0.01 + 0.001 * n

    first = load_or_profile(
        key,
        target,
        lambda b: 0.001 * b,
        points=(1, 2, 4),
        draft_points=(1, 2),
        cache_dir=tmp_path,
        repeats=1,
    )
    assert cache_path(key, tmp_path).exists()

    def refuse(n):
        raise AssertionError("a cached profile must not be measured again")

    second = load_or_profile(
        key, refuse, refuse, points=(1, 2, 4), draft_points=(1, 2), cache_dir=tmp_path, repeats=1
    )
    assert second == first
    assert json.loads(cache_path(key, tmp_path).read_text())["key"] == key
    assert cache_path(key + "x", tmp_path) != cache_path(key, tmp_path)


def test_corrupt_or_mismatched_cache_is_measured_again(tmp_path):
    key = "m|cpu|float32|threads=1"
    cache_path(key, tmp_path).parent.mkdir(parents=True, exist_ok=True)
    cache_path(key, tmp_path).write_text("{not json")
    cost = load_or_profile(
        key, lambda n: 0.01 * n, None, points=(1, 2), cache_dir=tmp_path, repeats=1
    )
    assert cost.target_times == pytest.approx((0.01, 0.02))
    wider = load_or_profile(
        key, lambda n: 0.02 * n, None, points=(1, 2, 4), cache_dir=tmp_path, repeats=1
    )
    assert wider.target_points == (1, 2, 4)


def test_a_profile_of_another_version_is_measured_again(tmp_path):
    path = tmp_path / "p.json"
    save_profile(roofline(), path)
    assert load_profile(path) == roofline()
    data = json.loads(path.read_text())
    data["version"] = PROFILE_VERSION - 1
    path.write_text(json.dumps(data))
    assert load_profile(path) is None
    assert load_profile(tmp_path / "absent.json") is None


def test_json_round_trip():
    cost = CostProfile((1, 4), (0.01, 0.02), (1, 2), (0.001, 0.0015), key="k")
    assert CostProfile.from_json(cost.to_json()) == cost
    assert CostProfile.from_json(CostProfile((1,), (0.5,)).to_json()).draft_points == ()


def test_profile_key_names_what_the_profile_was_measured_on():
    assert profile_key("m", "cuda", "bfloat16", None) == "m|cuda|bfloat16|threads=default"
    packed = profile_key("m", "cpu", "float32", 4, "packed")
    assert packed == "m|cpu|float32|threads=4|weights=packed"


def test_a_checkpoint_replaced_in_place_gets_a_new_key(tmp_path) -> None:
    """The default draft lives at one path; a new one written there must be profiled again."""
    (tmp_path / "model.safetensors").write_bytes(b"old weights")
    before = checkpoint_fingerprint(tmp_path)
    assert checkpoint_fingerprint(tmp_path) == before
    (tmp_path / "model.safetensors").write_bytes(b"new weights, longer")
    assert checkpoint_fingerprint(tmp_path) != before
    assert checkpoint_fingerprint(None) == "none"


# -- the online correction ----------------------------------------------------------------------


def _drafts(curve, ks):
    """The profiled seconds of drafting `ks`: forward j over the requests with k > j."""
    return sum(curve.draft_time(sum(k > j for k in ks)) for j in range(max(ks, default=0)))


def test_a_step_costs_its_draft_forwards_its_verification_and_the_corrections():
    curve = linear(fixed_s=0.010, per_token_s=0.001, draft_s=0.0005)
    cost = CostModel(curve)
    # draft forwards over 2, 2, 1 requests; the target verifies 3 + 5 rows and 4 prefill tokens
    drafts = 2 * curve.draft_time(2) + curve.draft_time(1)
    assert _drafts(curve, [3, 2, 0]) == pytest.approx(drafts)
    assert cost.step_time(3, [3, 2, 0], 4) == pytest.approx(drafts + curve.target_time(12))
    cost.decode_scale, cost.verify_ratio, cost.draft_scale = 0.9, 1.2 / 0.9, 1.5
    assert cost.step_time(3, [3, 2, 0], 4) == pytest.approx(
        1.5 * drafts + 1.2 * curve.target_time(12)
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
            cost.observe(2, ks, 1.5 * _drafts(curve, ks), scale * curve.target_time(rows))
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
        cost.observe(32, [0] * 32, 0.0, 1.8 * curve.target_time(32))
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
        cost.observe(4, [1] * 4, _drafts(curve, [1] * 4), 1.6 * curve.target_time(8))
    assert cost.target_scale == pytest.approx(1.6)
    assert cost.decode_scale == 1.0
    assert cost.step_time(4, [0] * 4) == pytest.approx(curve.target_time(4))
    acceptance = [[0.45]] * 4
    assert choose_k(acceptance, cost).ks == (0, 0, 0, 0)
    one_scale = CostModel(curve)
    one_scale.decode_scale = 1.6
    assert choose_k(acceptance, one_scale).ks == (1, 1, 1, 1)


def test_the_draft_scale_follows_a_drifting_draft():
    curve = roofline()
    cost = CostModel(curve)
    for scale in (1.5, 3.0):
        for _ in range(300):
            cost.observe(1, [2], scale * _drafts(curve, [2]), curve.target_time(3))
        assert cost.draft_scale == pytest.approx(scale, rel=0.01)


def test_the_first_step_of_each_shape_is_ignored():
    """A kernel's first call at a size plans and allocates: a slow step that teaches nothing."""
    curve = roofline()
    cost = CostModel(curve)
    cost.observe(2, [1, 1], 1.0, 1.0)
    assert (cost.target_scale, cost.draft_scale, cost.num_observed) == (1.0, 1.0, 0)
    cost.observe(2, [1, 1], _drafts(curve, [1, 1]), 1.1 * curve.target_time(4))
    assert cost.target_scale == pytest.approx(1.1) and cost.num_observed == 1
    cost.observe(2, [2, 0], 5.0, 5.0)  # 4 rows again, but a longest draft of 2: a new shape
    cost.observe(3, [0, 0, 0], 5.0, 5.0)  # 3 rows: new
    assert cost.target_scale == pytest.approx(1.1) and cost.num_observed == 1


def test_a_step_without_drafts_leaves_the_draft_scale_alone():
    cost = CostModel(roofline())
    for _ in range(3):
        cost.observe(2, [0, 0], 0.0, cost.profile.target_time(2))
    assert cost.draft_scale == 1.0 and cost.num_decodes == 2 and cost.num_observed == 0


def test_the_scales_follow_the_mean_step():
    """Goodput is tokens over the mean step: noisy steps (below STALL) settle each scale at their
    mean, the speculative step's two phases as the off step's one."""
    curve = roofline()
    cost = CostModel(curve)
    noise = [0.9, 1.5, 1.2] * 100  # mean 1.2
    for x in noise:
        cost.observe(1, [0], 0.0, x * curve.target_time(1))
        cost.observe(1, [2], x * _drafts(curve, [2]), x * curve.target_time(3))
    for scale in (cost.decode_scale, cost.target_scale, cost.draft_scale):
        assert scale == pytest.approx(1.2, abs=0.05)


def test_a_stalled_step_teaches_the_corrections_nothing():
    """A replica's first steps once took seconds (the host stalled): priced, they set the scales
    a hundredfold and speculation, the only thing that measures them again, never ran again."""
    curve = roofline()
    cost = CostModel(curve)
    for ks in ([0], [0], [2], [2]):
        cost.observe(1, ks, 1.6 * _drafts(curve, ks), 1.3 * curve.target_time(1 + sum(ks)))
    settled = (cost.target_scale, cost.draft_scale, cost.decode_scale)
    assert settled == pytest.approx((1.3, 1.6, 1.3))
    cost.observe(1, [2], 300 * _drafts(curve, [2]), curve.target_time(3))  # the draft stalled
    cost.observe(1, [2], _drafts(curve, [2]), 300 * curve.target_time(3))  # the target did
    cost.observe(1, [0], 0.0, 100 * curve.target_time(1))
    assert (cost.target_scale, cost.draft_scale, cost.decode_scale) == settled
    assert choose_k([[0.8, 0.8]], cost).ks == (2,)
    cost.observe(1, [2], 3 * _drafts(curve, [2]), 2 * curve.target_time(3))  # slower, not stalled
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
