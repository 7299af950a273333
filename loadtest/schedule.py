"""The open-loop replay queue: arrivals handed out in order, each with the time it is due.

Replay users each take the next arrival, sleep until it is due and send it, so a request goes out
at its scaled trace time whether or not earlier ones have finished (open loop) as long as a pool
user is free; when none is, the request goes out late and its lateness is recorded. Runs inside
one gevent loop, so no locks are needed. The clock starts at the first `take()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loadtest.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class Slot:
    request: TraceRequest
    due: float  # on the schedule's clock
    index: int


class ArrivalSchedule:
    def __init__(
        self, requests: Sequence[TraceRequest], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._requests = list(requests)
        self._clock = clock
        self._t0: float | None = None
        self.num_taken = 0
        self.num_finished = 0

    @property
    def num_total(self) -> int:
        return len(self._requests)

    def take(self) -> Slot | None:
        """The next arrival and when it is due; None once every arrival has been taken."""
        if self.num_taken >= len(self._requests):
            return None
        if self._t0 is None:
            self._t0 = self._clock()
        request = self._requests[self.num_taken]
        self.num_taken += 1
        return Slot(request, self._t0 + request.offset_s, self.num_taken - 1)

    def wait_s(self, slot: Slot) -> float:
        return max(0.0, slot.due - self._clock())

    def lateness_s(self, slot: Slot) -> float:
        return max(0.0, self._clock() - slot.due)

    def finish(self) -> None:
        self.num_finished += 1

    def is_done(self) -> bool:
        return self.num_finished >= len(self._requests)
