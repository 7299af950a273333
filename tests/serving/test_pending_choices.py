"""Routing choices made but not yet sent: a burst of concurrent decisions, each seeing the
choices before it, is spread evenly; sent, retried and abandoned choices stop counting."""

from collections import Counter

from deployments.pending_choices import PendingChoices
from deployments.routing_policy import ReplicaLoad, order_replicas


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def route_burst(pending: PendingChoices, num_requests: int) -> Counter[str]:
    """Every decision sees the same reported figures (one long request on each replica, the
    second with higher acceptance), as concurrent decisions of a burst do, plus the choices
    made before it: what the router does before any of the burst is sent."""
    chosen: Counter[str] = Counter()
    for request in range(num_requests):
        counts = pending.counts()
        loads = [ReplicaLoad(r, capacity=4, num_inflight=1 + counts[r], alpha=alpha)
                 for r, alpha in (("a", 0.2), ("b", 0.6))]
        first = order_replicas(loads)[0]
        pending.choose(request, first)
        chosen[first] += 1
    return chosen


def test_a_burst_of_concurrent_decisions_is_spread_evenly():
    assert route_burst(PendingChoices(), 8) == Counter(a=4, b=4)


def test_without_the_record_the_burst_lands_on_one_replica():
    class Forgetful(PendingChoices):
        def choose(self, request_key, replica_id) -> None:
            pass

    assert route_burst(Forgetful(), 8) == Counter(b=8)


def test_a_sent_request_stops_counting_as_pending():
    pending = PendingChoices()
    pending.choose("r1", "a")
    pending.choose("r2", "a")
    pending.choose("r3", "b")
    pending.sent("a")
    assert pending.counts() == Counter(a=1, b=1)
    pending.sent("c")  # sent elsewhere than any choice: nothing to consume
    assert pending.counts() == Counter(a=1, b=1)


def test_a_retried_request_counts_once():
    pending = PendingChoices()
    pending.choose("r1", "a")
    pending.discard("r1")
    assert pending.counts() == Counter()
    pending.choose("r1", "a")
    pending.choose("r1", "b")
    assert pending.counts() == Counter(b=1)


def test_a_choice_never_sent_expires():
    clock = Clock()
    pending = PendingChoices(ttl_s=2.0, clock=clock)
    pending.choose("r1", "a")
    clock.now = 1.0
    pending.choose("r2", "a")
    clock.now = 2.5
    assert pending.counts() == Counter(a=1)
    clock.now = 3.5
    assert pending.counts() == Counter()
