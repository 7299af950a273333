"""The step-cost profile (interpolation, knee, measurement, cache) on synthetic curves."""

import json
import math
from pathlib import Path

import pytest

from faser.runner.profiler import (
    KNEE_GROWTH,
    PROFILE_VERSION,
    CostProfile,
    cache_path,
    checkpoint_fingerprint,
    hardware_name,
    load_or_profile,
    load_profile,
    profile,
    profile_key,
    save_profile,
)
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
    epyc = profile_key("m", "cpu", "float32", 4, "packed", "AuthenticAMD 25 17 AMD EPYC")
    assert epyc == "m|cpu=AuthenticAMD 25 17 AMD EPYC|float32|threads=4|weights=packed"


def test_a_cpus_name_tells_its_generation_apart():
    """Under a hypervisor the model name may say only "AMD EPYC": family and model tell a Zen 3
    from a Zen 4, whose costs differ."""
    name = hardware_name("cpu")
    assert name and name == hardware_name("cpu")
    info = Path("/proc/cpuinfo")
    if info.exists() and "cpu family" in info.read_text():
        assert any(ch.isdigit() for ch in name)


def test_a_checkpoint_replaced_in_place_gets_a_new_key(tmp_path) -> None:
    """The default draft lives at one path; a new one written there must be profiled again."""
    (tmp_path / "model.safetensors").write_bytes(b"old weights")
    before = checkpoint_fingerprint(tmp_path)
    assert checkpoint_fingerprint(tmp_path) == before
    (tmp_path / "model.safetensors").write_bytes(b"new weights, longer")
    assert checkpoint_fingerprint(tmp_path) != before
    assert checkpoint_fingerprint(None) == "none"


# -- the online correction ----------------------------------------------------------------------

