"""The step-cost profile: timings of real forwards, measured once and cached.

- The target is timed at a few flat batch sizes (num_tokens) and the draft at a few batch sizes,
  each a decode at a modest context, and the times are interpolated between them.
- A profile is measured once per model, device, dtype, weight layout and thread count, and cached
  as JSON so that a restart costs no profiling.
- The knee: the batch past which the target is compute-bound, where verifying more rows costs.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from faser.models.model_cache import cache_root
from faser.runner.batch import Chunk
from faser.runner.model_runner import ModelRunner
from faser_kernels import cpu_build

PROFILE_CONTEXT = 64  # cached tokens each profiled request attends to
# dense where one request's k decides (a CPU's step can jump between 2 and 4 tokens), then
# doubling, with a point just past the row counts where GEMM kernels change their blocking
TARGET_POINTS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64, 65, 96, 128, 256, 512)
DRAFT_POINTS = (1, 2, 4, 8, 16, 32, 64)
PROFILE_VERSION = 6  # raised whenever the points or the way of measuring them change
# the knee: the first doubling of the tokens that costs sqrt(2) times as much (the growing part of
# t = t0 + c n has caught up with the fixed part); below it the target is memory-bound
KNEE_GROWTH = math.sqrt(2.0)
PROFILE_CACHE_ENV = "FASER_PROFILE_CACHE"


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Step times in seconds: the target at `target_points` tokens, the draft at `draft_points`
    sequences. An empty draft profile means drafting is taken as free."""

    target_points: tuple[int, ...]
    target_times: tuple[float, ...]
    draft_points: tuple[int, ...] = ()
    draft_times: tuple[float, ...] = ()
    key: str = ""

    def __post_init__(self) -> None:
        _check_curve("target", self.target_points, self.target_times, allow_empty=False)
        _check_curve("draft", self.draft_points, self.draft_times, allow_empty=True)

    def target_time(self, num_tokens: float) -> float:
        if num_tokens <= 0:
            return 0.0
        return _interpolate(self.target_points, self.target_times, num_tokens)

    def draft_time(self, batch_size: float) -> float:
        if batch_size <= 0 or not self.draft_points:
            return 0.0
        return _interpolate(self.draft_points, self.draft_times, batch_size)

    def knee(self) -> float:
        """num_tokens past which the target is compute-bound (see KNEE_GROWTH); inf when the
        curve stays flat over the profile."""
        n = 1
        while 2 * n <= self.target_points[-1]:
            if self.target_time(2 * n) >= KNEE_GROWTH * self.target_time(n):
                return float(n)
            n *= 2
        return math.inf

    def to_json(self) -> dict[str, object]:
        return {
            "version": PROFILE_VERSION, "key": self.key,
            "target": {"num_tokens": list(self.target_points), "seconds": list(self.target_times)},
            "draft": {"batch_size": list(self.draft_points), "seconds": list(self.draft_times)},
        }

    @classmethod
    def from_json(cls, data: dict) -> CostProfile:
        if (got := data.get("version")) != PROFILE_VERSION:
            raise ValueError(f"profile version must be {PROFILE_VERSION}, got {got}")
        return cls(
            target_points=tuple(int(n) for n in data["target"]["num_tokens"]),
            target_times=tuple(float(t) for t in data["target"]["seconds"]),
            draft_points=tuple(int(n) for n in data["draft"]["batch_size"]),
            draft_times=tuple(float(t) for t in data["draft"]["seconds"]),
            key=str(data.get("key", "")),
        )


def decode_timer(runner: ModelRunner, block_table: list[int]) -> Callable[[int], float]:
    """seconds of one forward of n one-token requests; they share `block_table`, whose blocks
    must belong to no live request (their contents are overwritten)."""
    # within the rotary tables too: a model may be served with max_model_len < PROFILE_CONTEXT
    limit = getattr(getattr(runner.model, "rotary", None), "max_position", PROFILE_CONTEXT)
    position = min(PROFILE_CONTEXT, len(block_table) * runner.block_size, limit) - 1

    def measure(n: int) -> float:
        chunks = [Chunk([0], position, block_table, num_logits=1)] * n
        runner.synchronize()
        start = time.perf_counter()
        runner.forward(chunks)
        runner.synchronize()  # CUDA returns before the work is done
        return time.perf_counter() - start

    return measure


def profile(
    measure_target: Callable[[int], float], measure_draft: Callable[[int], float] | None = None,
    points: Sequence[int] = TARGET_POINTS, draft_points: Sequence[int] = DRAFT_POINTS, *,
    repeats: int = 5, warmup: int = 1, key: str = "",
) -> CostProfile:
    """A profile from `measure_*(n)`, each the seconds of one real forward at size n (see
    `_measure_curve`)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    target_times = _measure_curve(measure_target, points, repeats, warmup)
    draft_points = tuple(draft_points) if measure_draft is not None else ()
    draft_times: tuple[float, ...] = ()
    if measure_draft is not None:
        draft_times = _measure_curve(measure_draft, draft_points, repeats, warmup)
    return CostProfile(tuple(points), target_times, draft_points, draft_times, key)


def profile_key(
    model: str, device: str, dtype: str, num_threads: int | None, weight_format: str = "dense",
    hardware: str = "",
) -> str:
    """A profile holds only for the hardware, precision, weight layout and threads it ran on;
    `hardware` names the device's model (`hardware_name`), so that a cache shared by hosts of
    different CPUs or GPUs gives each its own."""
    where = f"{device}={hardware}" if hardware else device
    key = f"{model}|{where}|{dtype}|threads={num_threads if num_threads else 'default'}"
    return key if weight_format == "dense" else f"{key}|weights={weight_format}"


def hardware_name(device: str) -> str:
    """A CUDA device's name; a CPU's vendor, family, model and name, as /proc/cpuinfo gives them
    (the name alone can be as vague as "AMD EPYC" under a hypervisor)."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    info = cpu_build.cpu_info()
    parts = [info.get(f, "") for f in ("vendor_id", "cpu family", "model", "model name")]
    return " ".join(p for p in parts if p) or "unknown cpu"


def checkpoint_fingerprint(path: str | os.PathLike | None) -> str:
    """A checkpoint directory and its files' sizes and times, so that weights replaced in place
    are profiled again."""
    if path is None:
        return "none"
    directory = Path(path)
    files = sorted(f for f in directory.iterdir() if f.is_file()) if directory.is_dir() else []
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return f"{directory}@{hashlib.sha256(repr(stats).encode()).hexdigest()[:8]}"


def cache_path(key: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """A readable, filesystem-safe name plus a hash, so distinct keys never share a file; the
    directory defaults to $FASER_PROFILE_CACHE, else `profiles` in the model cache."""
    readable = re.sub(r"[^A-Za-z0-9._=-]+", "_", key)[:80]
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    if cache_dir is None:
        configured = os.environ.get(PROFILE_CACHE_ENV)
        cache_dir = Path(configured).expanduser() if configured else cache_root() / "profiles"
    return Path(cache_dir) / f"{readable}-{digest}.json"


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
    key: str, measure_target: Callable[[int], float],
    measure_draft: Callable[[int], float] | None = None, points: Sequence[int] = TARGET_POINTS,
    draft_points: Sequence[int] = DRAFT_POINTS, *, cache_dir: str | os.PathLike | None = None,
    repeats: int = 5,
) -> CostProfile:
    """The cached profile for `key` when it covers the requested points, else a fresh one."""
    path = cache_path(key, cache_dir)
    cached = load_profile(path)
    wanted = (key, tuple(points), tuple(draft_points) if measure_draft is not None else ())
    if cached is not None and (cached.key, cached.target_points, cached.draft_points) == wanted:
        return cached
    cost = profile(measure_target, measure_draft, points, draft_points, repeats=repeats, key=key)
    save_profile(cost, path)
    return cost


def _measure_curve(
    measure: Callable[[int], float], points: Sequence[int], repeats: int, warmup: int
) -> tuple[float, ...]:
    """The least per point of `repeats` interleaved rounds, after `warmup` discarded ones, then
    the lower envelope from the right, since a bigger forward never costs less. Interleaved, so
    that a neighbour's load does not show up as a cost of size; the least, since noise only slows
    a forward down (a median made drafting look nearly free)."""
    for _ in range(warmup):
        for n in points:
            measure(n)
    samples: dict[int, list[float]] = {n: [] for n in points}
    for round_ in range(repeats):
        for n in points if round_ % 2 == 0 else reversed(points):
            samples[n].append(float(measure(n)))
    out = [min(samples[n]) for n in points]
    for j in range(len(out) - 2, -1, -1):
        out[j] = min(out[j], out[j + 1])
    return tuple(out)


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
    smallest forward), above the last the last segment's slope, never decreasing."""
    if x <= points[0] or len(points) == 1:
        return times[0]
    j = min(bisect.bisect_right(points, x), len(points) - 1)
    x0, x1, t0, t1 = points[j - 1], points[j], times[j - 1], times[j]
    slope = (t1 - t0) / (x1 - x0)
    if x > x1:
        slope = max(slope, 0.0)
    return t0 + slope * (x - x0)
