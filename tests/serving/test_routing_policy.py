"""The load-aware routing policy and the autoscaling arithmetic, as pure functions."""

import pytest

from deployments.autoscaling import desired_replicas
from deployments.routing_policy import (
    ReplicaLoad,
    cluster_load,
    load_from_stats,
    order_replicas,
    prefix_key,
    replica_score,
)


def load(replica_id: str, **figures) -> ReplicaLoad:
    return ReplicaLoad(replica_id=replica_id, capacity=figures.pop("capacity", 8), **figures)


def test_least_loaded_replica_goes_first():
    loads = [load("a", num_running=6), load("b", num_running=1), load("c", num_running=3)]
    assert order_replicas(loads) == ["b", "c", "a"]


def test_own_inflight_count_beats_a_stale_report():
    # "a" reported idle a moment ago, but this router has just sent it 5 requests
    loads = [load("a", num_inflight=5), load("b", num_running=2)]
    assert order_replicas(loads)[0] == "b"


def test_full_kv_cache_counts_as_load():
    # as many requests, but "a" holds long sequences: its cache is nearly full
    loads = [load("a", num_running=2, kv_usage=0.9), load("b", num_running=2, kv_usage=0.1)]
    assert order_replicas(loads) == ["b", "a"]


def test_nearly_equal_replicas_go_in_order_of_acceptance():
    loads = [load("a", num_running=2, kv_usage=0.05, alpha=0.3),
             load("b", num_running=2, alpha=0.8), load("c", num_running=7, alpha=0.9)]
    assert order_replicas(loads) == ["b", "a", "c"]
    assert order_replicas(loads, tolerance=0.0) == ["b", "a", "c"]
    equal = [load("a", num_running=2, alpha=0.3), load("b", num_running=2, kv_usage=0.05)]
    assert order_replicas(equal, tolerance=0.0) == ["a", "b"]
    assert order_replicas(equal) == ["a", "b"]


def test_the_replica_that_holds_the_prefix_goes_first_among_equals_only():
    loads = [load("a", num_running=2, alpha=0.8), load("b", num_running=2, alpha=0.3),
             load("c", num_running=6)]
    assert order_replicas(loads, preferred="b") == ["b", "a", "c"]
    assert order_replicas(loads, preferred="c") == ["a", "b", "c"]  # too busy to be preferred
    assert order_replicas(loads, preferred="gone") == order_replicas(loads) == ["a", "b", "c"]


def test_a_conversations_turns_share_their_prefix_key():
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    later = first + [{"role": "assistant", "content": "Hello!"},
                     {"role": "user", "content": "Why?"}]
    other = [first[0], {"role": "user", "content": "Bye"}]
    assert prefix_key("chat", None, later) == prefix_key("chat", None, first)
    assert prefix_key("chat", None, other) != prefix_key("chat", None, first)
    text = "Translate to French, sentence by sentence, keeping names as they are: the cat sat."
    assert prefix_key("completion", text + " Le chat", ()) == prefix_key("completion", text, ())
    assert prefix_key("completion", "Hello", ()) != prefix_key("completion", "Help", ())
    ids = list(range(40))
    assert prefix_key("completion", ids + [7], ()) == prefix_key("completion", ids, ())
    assert prefix_key("completion", "", ()) is None


def test_score_is_relative_to_capacity():
    small = load("small", capacity=2, num_running=2)
    large = load("large", capacity=16, num_running=4)
    assert replica_score(small) > replica_score(large)
    assert order_replicas([small, large])[0] == "large"


def test_cluster_load_is_the_fleets_busy_fraction():
    assert cluster_load([]) == 0.0
    idle = [load("a"), load("b")]
    assert cluster_load(idle) == 0.0
    busy = [load("a", num_running=8, num_waiting=4), load("b", num_running=4)]
    assert cluster_load(busy) == pytest.approx(16 / 16)


def test_stats_from_a_replica_with_missing_figures_count_as_idle():
    replica = load_from_stats("r", capacity=4, num_inflight=1, stats={})
    assert (replica.num_running, replica.kv_usage, replica.num_requests) == (0, 0.0, 1)
    reported = load_from_stats("r", 32, 0, {"num_running": 3, "num_waiting": 2, "capacity": 8})
    assert reported.capacity == 8 and reported.num_requests == 5


def test_desired_replicas_keeps_mean_load_at_target():
    assert desired_replicas([0.9, 0.9], target_load=0.6) == pytest.approx(3.0)
    assert desired_replicas([0.0, 0.1], target_load=0.5) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="target_load"):
        desired_replicas([1.0], target_load=0.0)
