"""The load-aware routing policy, as pure functions over replica load figures (no Ray here).

Each replica reports its engine's load (`record_routing_stats`) every fraction of a second; the
router also counts the requests it chose or sent that have not completed, which is exact for its
own traffic and fresher than any report. A replica's load is the larger of the two, over its
capacity, plus a KV term so that a replica whose cache is nearly full (long sequences) looks
busier than one with as many short requests. Among replicas about equally loaded, the one that
last served a request beginning the same way goes first (its prefix cache holds the blocks),
then the one with the higher acceptance.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KV_WEIGHT = 0.5  # a full KV cache counts as half a replica's worth of requests
ORDER_TOLERANCE = 0.1  # scores this close (a tenth of a replica) count as equally loaded
# a completion prompt's leading characters that key its prefix: short, so that a prompt that grows
# turn by turn (a conversation sent as one text) keeps its key
PREFIX_CHARS = 64


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    replica_id: str
    capacity: int  # requests the replica takes at once (max_ongoing_requests)
    num_inflight: int = 0  # chosen or sent by this router and not completed
    num_running: int = 0  # reported by the engine
    num_waiting: int = 0  # reported by the engine
    kv_usage: float = 0.0  # reported, in [0, 1]
    alpha: float = 0.0  # reported mean acceptance estimate
    mode: str = ""

    @property
    def num_requests(self) -> int:
        return max(self.num_inflight, self.num_running + self.num_waiting)


def load_from_stats(
    replica_id: str, capacity: int, num_inflight: int, stats: Mapping[str, Any]
) -> ReplicaLoad:
    """Builds a ReplicaLoad from a replica's routing stats; missing figures count as idle and
    the engine's own capacity (max_num_seqs) wins over the deployment's."""
    return ReplicaLoad(
        replica_id=replica_id,
        capacity=max(1, int(stats.get("capacity", capacity))),
        num_inflight=num_inflight,
        num_running=int(stats.get("num_running", 0)),
        num_waiting=int(stats.get("num_waiting", 0)),
        kv_usage=float(stats.get("kv_usage", 0.0)),
        alpha=float(stats.get("alpha", 0.0)),
        mode=str(stats.get("mode", "")),
    )


def replica_score(load: ReplicaLoad) -> float:
    """Lower is better: the busy fraction of the replica plus its KV pressure."""
    return load.num_requests / load.capacity + KV_WEIGHT * min(max(load.kv_usage, 0.0), 1.0)


def order_replicas(
    loads: Sequence[ReplicaLoad], tolerance: float = ORDER_TOLERANCE,
    preferred: str | None = None,
) -> list[str]:
    """Replica ids, the one to route to first. Replicas within `tolerance` of the least loaded
    one left count as equally loaded: `preferred` (the replica whose prefix cache likely holds
    the request's beginning) first, then in order of acceptance, higher first: a request there
    needs fewer target steps per token."""
    remaining = sorted(loads, key=lambda r: (replica_score(r), r.replica_id))
    order: list[str] = []
    while remaining:
        best = replica_score(remaining[0])
        near = [r for r in remaining if replica_score(r) - best <= tolerance]
        # stable: equal acceptance keeps the score order
        near.sort(key=lambda r: (r.replica_id != preferred, -r.alpha))
        order += [r.replica_id for r in near]
        remaining = [r for r in remaining if r not in near]
    return order


def cluster_load(loads: Sequence[ReplicaLoad]) -> float:
    """The fleet's busy fraction, 0 (idle) to 1 (every replica full) and past 1 when requests
    queue: the signal each replica's mode controller gets with every request."""
    capacity = sum(load.capacity for load in loads)
    if capacity == 0:
        return 0.0
    return sum(load.num_requests for load in loads) / capacity


def prefix_key(
    kind: str, prompt: str | Sequence[int] | None, messages: Sequence[Mapping[str, Any]]
) -> str | None:
    """What a request begins with, as a key that a conversation's later turns share: a chat's
    messages through its first user message, a completion prompt's first PREFIX_CHARS
    characters (or a quarter as many token ids); None for an empty request."""
    if kind == "chat":
        head: list[str] = []
        for message in messages:
            head.append(f"{message.get('role')}:{message.get('content')}")
            if message.get("role") == "user":
                break
        text = "\n".join(head)
    elif isinstance(prompt, str):
        text = prompt[:PREFIX_CHARS]
    else:
        text = ",".join(map(str, list(prompt or ())[: PREFIX_CHARS // 4]))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest() if text else None
