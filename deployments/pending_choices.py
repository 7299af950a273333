"""Routing choices made but not yet sent, so that a burst of concurrent decisions is spread.

Ray routes a burst of requests in concurrent tasks: each asks the router for an order of
replicas, and each takes the first with room, before any of them is sent and counted. Without
this record every decision of a burst sees the same figures and picks the same replica. A
choice is recorded when the router makes it and consumed when a request is sent to that
replica; one never consumed (Ray fell back to another replica, or the caller gave up) expires.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable

CHOICE_TTL_S = 2.0  # far longer than a decision takes to be sent; short enough not to skew load


class PendingChoices:
    def __init__(self, ttl_s: float = CHOICE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        # request key -> (replica id, when chosen); insertion order is the order of choice
        self._choices: dict[Hashable, tuple[str, float]] = {}

    def choose(self, request_key: Hashable, replica_id: str) -> None:
        """Records that the request is about to go to the replica; a retry of the same
        request replaces its earlier choice instead of counting twice."""
        self._choices.pop(request_key, None)
        self._choices[request_key] = (replica_id, self.clock())

    def discard(self, request_key: Hashable) -> None:
        """Forgets the request's choice: it is being routed again."""
        self._choices.pop(request_key, None)

    def sent(self, replica_id: str) -> None:
        """A request went to the replica: its oldest pending choice there is now in flight."""
        for key, (chosen, _) in self._choices.items():
            if chosen == replica_id:
                del self._choices[key]
                return

    def counts(self) -> Counter[str]:
        """Pending choices per replica, after dropping the expired ones."""
        deadline = self.clock() - self.ttl_s
        self._choices = {k: c for k, c in self._choices.items() if c[1] >= deadline}
        return Counter(replica_id for replica_id, _ in self._choices.values())
