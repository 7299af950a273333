"""Load profiles: how many closed-loop users run at each second of a test.

Pure functions of elapsed time, so they are tested without Locust; `loadtest.locust_shapes` wraps
each in a Locust `LoadTestShape` whose `tick()` is `profile.users_at(run_time)`. Every profile
ends (returns None) once `duration_s` has passed, so a test always stops by itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from loadtest.settings import LoadSettings


class UserTarget(NamedTuple):
    users: int
    spawn_rate: float  # users started or stopped per second on the way to `users`


class Profile(Protocol):
    def users_at(self, t_s: float) -> UserTarget | None: ...


@dataclass(frozen=True, slots=True)
class StepProfile:
    """`start_users`, plus `step_users` more every `step_s`, up to `max_users`."""

    start_users: int
    step_users: int
    step_s: float
    max_users: int
    duration_s: float

    def users_at(self, t_s: float) -> UserTarget | None:
        if t_s >= self.duration_s:
            return None
        users = min(self.max_users, self.start_users + self.step_users * int(t_s // self.step_s))
        return UserTarget(max(users, 1), float(max(self.step_users, 1)))


@dataclass(frozen=True, slots=True)
class SpikeProfile:
    """`base_users`, jumping to `peak_users` for `spike_len_s` from `spike_at_s`."""

    base_users: int
    peak_users: int
    spike_at_s: float
    spike_len_s: float
    duration_s: float

    def users_at(self, t_s: float) -> UserTarget | None:
        if t_s >= self.duration_s:
            return None
        in_spike = self.spike_at_s <= t_s < self.spike_at_s + self.spike_len_s
        # A spike is sudden: every user starts within a second.
        return UserTarget(self.peak_users if in_spike else self.base_users, float(self.peak_users))


@dataclass(frozen=True, slots=True)
class DiurnalProfile:
    """A day compressed into `period_s`: a cosine from `min_users` up to `max_users` and back."""

    min_users: int
    max_users: int
    period_s: float
    duration_s: float

    def users_at(self, t_s: float) -> UserTarget | None:
        if t_s >= self.duration_s:
            return None
        level = (1.0 - math.cos(2.0 * math.pi * t_s / self.period_s)) / 2.0
        users = round(self.min_users + (self.max_users - self.min_users) * level)
        return UserTarget(users, float(max(self.max_users, 1)))


@dataclass(frozen=True, slots=True)
class ReplayProfile:
    """A pool of replay users that pull timed arrivals; ends when the replay is done or late."""

    pool_users: int
    duration_s: float
    is_done: Callable[[], bool]

    def users_at(self, t_s: float) -> UserTarget | None:
        if t_s >= self.duration_s or self.is_done():
            return None
        return UserTarget(self.pool_users, float(self.pool_users))


def closed_loop_profile(settings: LoadSettings) -> Profile:
    """The step, spike or diurnal profile the settings describe."""
    d = settings.duration_s
    if settings.shape == "step":
        return StepProfile(
            max(settings.base_users, 1), settings.step_users, settings.step_s, settings.users, d
        )
    if settings.shape == "spike":
        at = d / 3.0 if settings.spike_at_s is None else settings.spike_at_s
        length = d / 6.0 if settings.spike_len_s is None else settings.spike_len_s
        return SpikeProfile(settings.base_users, settings.users, at, length, d)
    if settings.shape == "diurnal":
        period = d if settings.period_s is None else settings.period_s
        return DiurnalProfile(settings.base_users, settings.users, period, d)
    raise ValueError(f"shape: {settings.shape!r} is not a closed-loop shape (step|spike|diurnal)")
