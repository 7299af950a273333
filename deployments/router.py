"""A Ray Serve RequestRouter that sends each request to the least loaded engine replica and
tells that replica how loaded the whole fleet is.

The policy itself lives in routing_policy (pure functions); this class only gathers the figures:
each replica's `record_routing_stats` (engine load, KV use, mode, acceptance) and this router's
own count of requests in flight per replica. The fleet's load rides along with the request in the
`cluster_load` keyword argument (when the call has one), so every replica's mode controller
switches between overlap and prune as the load on the fleet, not only its own, changes. The router
remembers which replica it last sent each request prefix to (routing_policy.prefix_key), so that
among about equally loaded replicas a conversation's next turn goes where its blocks are cached.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from deployments.pending_choices import PendingChoices
from deployments.routing_policy import (
    ReplicaLoad,
    cluster_load,
    load_from_stats,
    order_replicas,
    prefix_key,
)
from deployments.serving import GenerateRequest

CLUSTER_LOAD_KWARG = "cluster_load"
MAX_PREFIXES = 1 << 14  # prefixes remembered, least recently routed forgotten first


class LoadAwareRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._inflight: dict[ReplicaID, int] = defaultdict(int)
        self._pending = PendingChoices()
        self._prefixes: OrderedDict[str, str] = OrderedDict()  # prefix key -> replica id

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if pending_request is not None:  # a retry: its earlier choice no longer stands
            self._pending.discard(_request_key(pending_request))
        pending = self._pending.counts()
        loads = [self._load(r, pending) for r in candidate_replicas]
        key = _prefix_key(pending_request)
        order = order_replicas(loads, preferred=self._prefixes.get(key) if key else None)
        if key is not None:
            self._prefixes[key] = order[0]
            self._prefixes.move_to_end(key)
            if len(self._prefixes) > MAX_PREFIXES:
                self._prefixes.popitem(last=False)
        if pending_request is not None:
            # past the first round Ray backs off instead of spinning on full replicas
            pending_request.routing_context.should_backoff = True
            if CLUSTER_LOAD_KWARG in pending_request.kwargs:
                pending_request.kwargs[CLUSTER_LOAD_KWARG] = cluster_load(
                    self._all_loads(loads, pending))
            # Ray takes the first replica with room: count it now, before it is sent, so the
            # next decision of a burst sees it
            self._pending.choose(_request_key(pending_request), order[0])
        # one replica per rank: Ray follows this order instead of breaking ties itself
        return [[by_id[i]] for i in order]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._inflight[replica_id] += 1
        self._pending.sent(replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # called once per sent request (also when the replica rejected it)
        self._inflight[replica_id] = max(0, self._inflight[replica_id] - 1)

    def _num_inflight(self, replica_id: ReplicaID, pending: Counter[str]) -> int:
        # Ray's queue-length cache also sees other routers' traffic when it probes
        cached = self.replica_queue_len_cache.get(replica_id) or 0
        own = self._inflight.get(replica_id, 0) + pending[replica_id.unique_id]
        return max(own, cached)

    def _load(self, replica: RunningReplica, pending: Counter[str]) -> ReplicaLoad:
        return load_from_stats(
            replica.replica_id.unique_id,
            replica.max_ongoing_requests,
            self._num_inflight(replica.replica_id, pending),
            replica.routing_stats or {},
        )

    def _all_loads(
        self, candidate_loads: list[ReplicaLoad], pending: Counter[str]
    ) -> list[ReplicaLoad]:
        """The whole fleet, not only the candidates of this round (locality may narrow them)."""
        seen = {load.replica_id for load in candidate_loads}
        rest = [self._load(r, pending) for r in self.curr_replicas.values()]
        return candidate_loads + [load for load in rest if load.replica_id not in seen]


def _prefix_key(pending_request: PendingRequest | None) -> str | None:
    """The prefix key of a call whose first argument is a request; None for other calls."""
    args = pending_request.args if pending_request is not None else []
    request = args[0] if args else None
    if not isinstance(request, GenerateRequest):
        return None
    return prefix_key(request.kind, request.prompt, request.messages)


def _request_key(pending_request: PendingRequest) -> object:
    """The same request routed again (a retry) keeps its key; requests without an id fall
    back to the object, which lives as long as the routing of the request does."""
    return pending_request.metadata.internal_request_id or id(pending_request)
