"""What a policy decides for one step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoadView:
    """What the policy and the controller see of the load this step."""

    num_running: int  # decoding requests in this step
    num_waiting: int
    num_prefill_tokens: int  # prefill tokens already scheduled into this step's target batch
    token_budget: int  # target tokens still free in this step's batch
    kv_usage: float  # fraction of KV blocks in use
    cluster_load: float | None = None  # the router's fleet-wide signal, 0 (idle) .. 1+ (overloaded)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """k caps per decoding request (index-aligned with the states passed to `plan`), the frontier
    size for verification, and the mode the step runs in."""

    max_k: list[int]
    frontier_size: int | None = None  # None: one frontier (verify all k in one forward)
    mode: str = "prune"
    overlap: bool = False
    notes: dict[str, object] = field(default_factory=dict)  # goes to the decision trace
