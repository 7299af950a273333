"""Profiled step times of the target and the draft, the cost side of the goodput model.

The target's time is measured at a few points of the flat batch size (num_tokens), the draft's at a
few batch sizes; between points the time is interpolated linearly, beyond them extrapolated along
the last segment. When the engine has lanes (overlap), each model's step is also timed on its own
lane, whose share of the hardware is smaller: on a CPU the target's lane has half the cores, and
overlap pays only when hiding the draft wins back more than that costs. The profile is measured
once per model, device, dtype and thread count and cached as JSON, so a restart costs no profiling.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from faser.models.model_cache import cache_root

# dense where one request's k decides (a CPU's step can jump between 2 and 4 tokens, and a
# straight line across the jump overprices k = 2 at batch 1), then doubling, with a point just past
# the row counts where GEMM kernels change their blocking (a step's cost is a staircase there)
TARGET_POINTS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64, 65, 96, 128, 256, 512)
DRAFT_POINTS = (1, 2, 4, 8, 16, 32, 64)
# 2: keys name the checkpoints' files (a draft replaced in place was reused); 3, 4: denser points
PROFILE_VERSION = 4
# The knee is where the step time's elasticity d ln t / d ln n reaches one half: on t = t0 + c n
# where the growing part equals the fixed part (n = t0 / c), on a roofline max(t0, c n) its corner.
KNEE_ELASTICITY = 0.5


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Step times in seconds: the target at `target_points` tokens, the draft at `draft_points`
    sequences. An empty draft profile means drafting is taken as free."""

    target_points: tuple[int, ...]
    target_times: tuple[float, ...]
    draft_points: tuple[int, ...] = ()
    draft_times: tuple[float, ...] = ()
    key: str = ""
    # (target, draft): a step's time on its lane over its time with the whole device, measured
    # at the smallest batch (overlap is only chosen at low load); None: not measured (no lanes)
    lane_scales: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        _check_curve("target", self.target_points, self.target_times, allow_empty=False)
        _check_curve("draft", self.draft_points, self.draft_times, allow_empty=True)
        if self.lane_scales is not None and (
            len(self.lane_scales) != 2
            or not all(s > 0.0 and math.isfinite(s) for s in self.lane_scales)
        ):
            raise ValueError(f"lane_scales must be two positive numbers, got {self.lane_scales}")

    def target_time(self, num_tokens: float, *, lane: bool = False) -> float:
        """Seconds of one target forward over `num_tokens` flat tokens; 0 for no tokens.
        `lane`: on the target's lane, beside a drafting draft."""
        if num_tokens <= 0:
            return 0.0
        scale = self.lane_scales[0] if lane and self.lane_scales else 1.0
        return scale * _interpolate(self.target_points, self.target_times, num_tokens)

    def draft_time(self, batch_size: float, *, lane: bool = False) -> float:
        """Seconds of one draft step over `batch_size` sequences; 0 for none."""
        if batch_size <= 0 or not self.draft_points:
            return 0.0
        scale = self.lane_scales[1] if lane and self.lane_scales else 1.0
        return scale * _interpolate(self.draft_points, self.draft_times, batch_size)

    def knee(self, elasticity: float = KNEE_ELASTICITY) -> float:
        """num_tokens where the target turns from memory-bound to compute-bound: where doubling
        the tokens first costs 2^elasticity times as much (elasticity measured per segment, at
        its geometric middle, and interpolated in log space); inf when the curve stays flat.
        Measured on the power-of-two points alone where there are three or more: the points just
        past a padded layout's row counts make segments so short and uneven that the
        interpolated middle lands well before a roofline's corner.

        Timing noise is one-sided (contention only slows a forward down), so the curve is first
        replaced by its lower envelope from the right: a slow outlier cannot fake an early knee."""
        points, times = _doublings(self.target_points, _lower_envelope(self.target_times))
        middles, slopes = _log_slopes(points, times)
        for j, e in enumerate(slopes):
            if e >= elasticity:
                if j == 0:
                    return float(points[0])  # compute-bound from the smallest forward
                frac = (elasticity - slopes[j - 1]) / (e - slopes[j - 1])
                return math.exp(
                    math.log(middles[j - 1]) + frac * math.log(middles[j] / middles[j - 1])
                )
        return _extrapolate_knee(points, times, elasticity)

    def to_json(self) -> dict[str, object]:
        return {
            "version": PROFILE_VERSION,
            "key": self.key,
            "target": {"num_tokens": list(self.target_points), "seconds": list(self.target_times)},
            "draft": {"batch_size": list(self.draft_points), "seconds": list(self.draft_times)},
            "lane_scales": list(self.lane_scales) if self.lane_scales else None,
        }

    @classmethod
    def from_json(cls, data: dict) -> CostProfile:
        if data.get("version") != PROFILE_VERSION:
            got = data.get("version")
            raise ValueError(f"profile version must be {PROFILE_VERSION}, got {got}")
        return cls(
            target_points=tuple(int(n) for n in data["target"]["num_tokens"]),
            target_times=tuple(float(t) for t in data["target"]["seconds"]),
            draft_points=tuple(int(n) for n in data["draft"]["batch_size"]),
            draft_times=tuple(float(t) for t in data["draft"]["seconds"]),
            key=str(data.get("key", "")),
            lane_scales=_pair(data.get("lane_scales")),
        )


class LaneTimers(NamedTuple):
    """The same measurements as `profile` takes, run on the target's and the draft's lanes."""

    target: Callable[[int], float]
    draft: Callable[[int], float]


def profile(
    measure_target: Callable[[int], float],
    measure_draft: Callable[[int], float] | None = None,
    points: Sequence[int] = TARGET_POINTS,
    draft_points: Sequence[int] = DRAFT_POINTS,
    *,
    repeats: int = 3,
    warmup: int = 1,
    key: str = "",
    lanes: LaneTimers | None = None,
) -> CostProfile:
    """Builds a profile by calling `measure_*(n)`, each returning the seconds of one real forward
    at size n. The median of `repeats` calls per point, taken in rounds over all the points
    (`_measure_curve`) after `warmup` discarded rounds, then the lower envelope from the right
    (each time the least measured at that size or beyond): a forward over more tokens never costs
    less, and timing noise, which only ever slows a forward down, is cut away."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    target_times = _measure_curve(measure_target, points, repeats, warmup)
    draft_times: tuple[float, ...] = ()
    if measure_draft is not None:
        draft_times = _measure_curve(measure_draft, draft_points, repeats, warmup)
    lane_scales = None
    if lanes is not None and measure_draft is not None:
        lane_target = _measure_curve(lanes.target, points[:1], repeats, warmup)[0]
        lane_draft = _measure_curve(lanes.draft, draft_points[:1], repeats, warmup)[0]
        lane_scales = (lane_target / target_times[0], lane_draft / draft_times[0])
    return CostProfile(
        target_points=tuple(points),
        target_times=target_times,
        draft_points=tuple(draft_points) if measure_draft is not None else (),
        draft_times=draft_times,
        key=key,
        lane_scales=lane_scales,
    )


PROFILE_CACHE_ENV = "FASER_PROFILE_CACHE"


def profile_key(
    model: str,
    device: str,
    dtype: str,
    num_threads: int | None,
    lane_threads: object = None,
    weight_format: str = "dense",
) -> str:
    """The cache key: a profile is only valid for the hardware, precision, weight layout and
    thread split it was measured on."""
    key = f"{model}|{device}|{dtype}|threads={num_threads if num_threads else 'default'}"
    if weight_format != "dense":
        key = f"{key}|weights={weight_format}"
    return key if lane_threads is None else f"{key}|lanes={lane_threads}"


def checkpoint_fingerprint(path: str | os.PathLike | None) -> str:
    """A checkpoint directory and the size and modification time of its files: a profile keyed by
    it is measured again when the weights are replaced in place (a new default draft)."""
    if path is None:
        return "none"
    directory = Path(path)
    files = sorted(f for f in directory.iterdir() if f.is_file()) if directory.is_dir() else []
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    digest = hashlib.sha256(repr(stats).encode()).hexdigest()[:8]
    return f"{directory}@{digest}"


def default_cache_dir() -> Path:
    """$FASER_PROFILE_CACHE, else `profiles` in the model cache ($FASER_CACHE, ~/.cache/faser)."""
    configured = os.environ.get(PROFILE_CACHE_ENV)
    return Path(configured).expanduser() if configured else cache_root() / "profiles"


def cache_path(key: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """A readable, filesystem-safe name plus a hash, so distinct keys never share a file."""
    readable = re.sub(r"[^A-Za-z0-9._=-]+", "_", key)[:80]
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return directory / f"{readable}-{digest}.json"


def save_profile(cost: CostProfile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cost.to_json(), indent=1))
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file


def load_profile(path: Path) -> CostProfile | None:
    """The cached profile, or None when absent or unreadable (then it is measured again)."""
    try:
        return CostProfile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_or_profile(
    key: str,
    measure_target: Callable[[int], float],
    measure_draft: Callable[[int], float] | None = None,
    points: Sequence[int] = TARGET_POINTS,
    draft_points: Sequence[int] = DRAFT_POINTS,
    *,
    cache_dir: str | os.PathLike | None = None,
    repeats: int = 3,
    lanes: LaneTimers | None = None,
) -> CostProfile:
    """The cached profile for `key` when it covers the requested points (and lanes), else a
    fresh one."""
    path = cache_path(key, cache_dir)
    cached = load_profile(path)
    wanted_draft = tuple(draft_points) if measure_draft is not None else ()
    wants_lanes = lanes is not None and measure_draft is not None
    if (
        cached is not None
        and cached.key == key
        and cached.target_points == tuple(points)
        and cached.draft_points == wanted_draft
        and (cached.lane_scales is not None) == wants_lanes
    ):
        return cached
    cost = profile(
        measure_target, measure_draft, points, draft_points, repeats=repeats, key=key, lanes=lanes
    )
    save_profile(cost, path)
    return cost


def _measure_curve(
    measure: Callable[[int], float], points: Sequence[int], repeats: int, warmup: int
) -> tuple[float, ...]:
    """The median per point of `repeats` rounds over all points, each round in the opposite
    order to the last. Measured point by point, load on a shared machine that changes while the
    profile runs shows up as a cost of size (a point timed while a neighbour was busy
    prices every step of that size too high for as long as the profile is cached); interleaved,
    each point sees the same stretch of the machine's time, as the benchmarks' variants do."""
    for _ in range(warmup):
        for n in points:
            measure(n)
    samples: dict[int, list[float]] = {n: [] for n in points}
    for round_ in range(repeats):
        for n in points if round_ % 2 == 0 else reversed(points):
            samples[n].append(float(measure(n)))
    return tuple(_lower_envelope([statistics.median(samples[n]) for n in points]))


def _pair(value: object) -> tuple[float, float] | None:
    if value is None:
        return None
    first, second = value  # type: ignore[misc]
    return float(first), float(second)


def _check_curve(
    name: str, points: Sequence[int], times: Sequence[float], *, allow_empty: bool
) -> None:
    if len(points) != len(times):
        raise ValueError(f"{name}_points and {name}_times must have the same length")
    if not points and not allow_empty:
        raise ValueError(f"{name}_points must not be empty")
    if any(p < 1 for p in points) or any(b <= a for a, b in zip(points, points[1:], strict=False)):
        raise ValueError(f"{name}_points must be >= 1 and strictly increasing, got {points}")
    if any(not (t > 0.0 and math.isfinite(t)) for t in times):
        raise ValueError(f"{name}_times must be positive and finite, got {times}")


def _interpolate(points: Sequence[int], times: Sequence[float], x: float) -> float:
    """Piecewise linear; below the first point the first time (nothing is cheaper than the
    smallest forward), above the last the last segment's slope (never decreasing; a single point
    is taken as flat)."""
    if x <= points[0] or len(points) == 1:
        return times[0]
    j = min(bisect.bisect_right(points, x), len(points) - 1)
    x0, x1, t0, t1 = points[j - 1], points[j], times[j - 1], times[j]
    slope = (t1 - t0) / (x1 - x0)
    if x > x1:
        slope = max(slope, 0.0)
    return t0 + slope * (x - x0)


def _log_slopes(points: Sequence[int], times: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per segment: its geometric middle and d ln t / d ln n."""
    middles, slopes = [], []
    for (n0, t0), (n1, t1) in zip(
        zip(points, times, strict=True), zip(points[1:], times[1:], strict=True), strict=False
    ):
        middles.append(math.sqrt(n0 * n1))
        slopes.append(math.log(t1 / t0) / math.log(n1 / n0))
    return middles, slopes


def _extrapolate_knee(points: Sequence[int], times: Sequence[float], elasticity: float) -> float:
    """Past the profile, along the last segment t = a + s n: elasticity s n / (a + s n)."""
    if len(points) < 2:
        return math.inf
    slope = (times[-1] - times[-2]) / (points[-1] - points[-2])
    if slope <= 0:
        return math.inf
    intercept = times[-1] - slope * points[-1]
    return max(float(points[-1]), elasticity * intercept / ((1.0 - elasticity) * slope))


def _doublings(points: Sequence[int], times: Sequence[float]) -> tuple[list[int], list[float]]:
    kept = [(n, t) for n, t in zip(points, times, strict=True) if n & (n - 1) == 0]
    if len(kept) < 3:
        return list(points), list(times)
    return [n for n, _ in kept], [t for _, t in kept]


def _lower_envelope(times: Sequence[float]) -> list[float]:
    out = list(times)
    for j in range(len(out) - 2, -1, -1):
        out[j] = min(out[j], out[j + 1])
    return out
