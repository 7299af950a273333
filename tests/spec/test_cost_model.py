import json
import math

import pytest

from faser.spec.cost_model import (
    CostProfile,
    LaneTimers,
    cache_path,
    checkpoint_fingerprint,
    load_or_profile,
    profile,
    profile_key,
)
from tests.spec.spec_profiles import linear, roofline


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
    ],
)
def test_bad_profiles_name_the_field(points, times, field):
    with pytest.raises(ValueError, match=field):
        CostProfile(points, times)


def test_knee_of_a_linear_curve_is_where_the_variable_part_equals_the_fixed_part():
    assert linear(fixed_s=0.010, per_token_s=0.0001).knee() == pytest.approx(100.0, rel=0.01)
    assert linear(fixed_s=0.010, per_token_s=0.001).knee() == pytest.approx(10.0, rel=0.01)


def test_knee_of_a_roofline_is_its_corner():
    assert roofline(knee=64).knee() == pytest.approx(64.0)
    assert roofline(knee=16).knee() == pytest.approx(16.0)


def test_knee_when_compute_bound_from_the_start():
    assert linear(fixed_s=0.001, per_token_s=0.01).knee() == 1.0


def test_knee_ignores_a_slow_outlier_and_is_inf_on_a_flat_curve():
    clean = roofline(knee=64)
    spiked = list(clean.target_times)
    spiked[2] *= 3.0  # one contended measurement at 4 tokens
    noisy = CostProfile(clean.target_points, tuple(spiked))
    assert noisy.knee() == pytest.approx(clean.knee())
    assert CostProfile((1, 512), (1.0, 1.0)).knee() == math.inf


def test_knee_extrapolates_past_the_profile():
    # the last segment continues as t = 0.9 + 0.1 n: elasticity 1/2 where 0.1 n = 0.9
    assert CostProfile((1, 2, 4), (1.0, 1.1, 1.3)).knee() == pytest.approx(9.0)


def test_profile_takes_medians_after_warmup_and_never_decreases():
    calls = []
    # warmup (1, 2), then three rounds: (1, 2), (2, 1), (1, 2)
    noise = iter([9.0, 9.0] + [1.0, 0.9] + [0.8, 5.0] + [1.2, 5.0])

    def measure(n):
        calls.append(n)
        return next(noise)

    cost = profile(measure, None, points=(1, 2), repeats=3, warmup=1, key="k")
    assert calls == [1, 2, 1, 2, 2, 1, 1, 2]
    # medians 1.2 and 0.9; a bigger forward never costs less, so the lower envelope holds 0.9
    assert cost.target_times == (0.9, 0.9)
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


def test_lane_scales_are_measured_on_the_lanes_cached_and_applied(tmp_path):
    key = profile_key("tiny", "cpu", "float32", 2, (1, 1))
    lanes = LaneTimers(lambda n: 2 * (0.01 + 0.001 * n), lambda b: 1.5 * 0.001 * b)
    args = dict(points=(1, 2, 4), draft_points=(1, 2), cache_dir=tmp_path, repeats=1)
    without = load_or_profile(key, lambda n: 0.01 + 0.001 * n, lambda b: 0.001 * b, **args)
    assert without.lane_scales is None  # no lanes: overlap is never costed on them
    cost = load_or_profile(
        key, lambda n: 0.01 + 0.001 * n, lambda b: 0.001 * b, lanes=lanes, **args
    )
    assert cost.lane_scales == pytest.approx((2.0, 1.5))  # the lane-less cache was not reused
    assert cost.target_time(4, lane=True) == pytest.approx(2 * cost.target_time(4))
    assert cost.draft_time(2, lane=True) == pytest.approx(1.5 * cost.draft_time(2))
    assert CostProfile.from_json(cost.to_json()) == cost
    assert "lanes=(1, 1)" in key


def test_bad_lane_scales_name_the_field():
    with pytest.raises(ValueError, match="lane_scales"):
        CostProfile((1, 2), (1.0, 2.0), lane_scales=(0.0, 1.0))


def test_a_checkpoint_replaced_in_place_gets_a_new_key(tmp_path) -> None:
    """The default draft lives at one path; a new one written there must be profiled again."""
    (tmp_path / "model.safetensors").write_bytes(b"old weights")
    before = checkpoint_fingerprint(tmp_path)
    assert checkpoint_fingerprint(tmp_path) == before
    (tmp_path / "model.safetensors").write_bytes(b"new weights, longer")
    assert checkpoint_fingerprint(tmp_path) != before
    assert checkpoint_fingerprint(None) == "none"
