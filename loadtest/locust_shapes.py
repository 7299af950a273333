"""Locust `LoadTestShape`s over the pure profiles of `loadtest.shapes`.

Each class is abstract here; the locustfile makes one concrete subclass for the chosen shape, so
Locust sees exactly one shape and one user class.
"""

from __future__ import annotations

from locust import LoadTestShape

from loadtest.run_state import RunState
from loadtest.shapes import Profile, ReplayProfile, closed_loop_profile


class ProfileShape(LoadTestShape):
    abstract = True
    state: RunState  # set by the locustfile

    def __init__(self) -> None:
        super().__init__()
        self.profile = self.make_profile(self.state)

    @staticmethod
    def make_profile(state: RunState) -> Profile:
        return closed_loop_profile(state.settings)

    def tick(self) -> tuple[int, float] | None:
        target = self.profile.users_at(self.get_run_time())
        return None if target is None else (target.users, target.spawn_rate)


class ReplayShape(ProfileShape):
    abstract = True

    @staticmethod
    def make_profile(state: RunState) -> Profile:
        schedule = state.schedule
        if schedule is None:
            raise ValueError("shape: trace replay needs the arrival schedule")
        return ReplayProfile(state.settings.pool_users, state.settings.duration_s, schedule.is_done)
