"""Autoscaling on the engines' own load figures (`record_autoscaling_stats`), not only on Ray's
count of ongoing requests: a replica whose KV cache is full is busy with few requests.

Each replica reports `load` (its busy fraction, the same score the router uses) and the
`target_load` it was deployed with; the fleet wants as many replicas as keep the mean load at
the target. Ray wraps the policy with min/max replicas and the up/down-scale delays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ray.serve.config import AutoscalingContext

DEFAULT_TARGET_LOAD = 0.7


def desired_replicas(loads: Sequence[float], target_load: float) -> float:
    """Replicas that would carry the summed load at `target_load` each (pure)."""
    if target_load <= 0:
        raise ValueError(f"target_load must be > 0, got {target_load}")
    return sum(max(0.0, load) for load in loads) / target_load


def faser_autoscaling_policy(ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
    metrics = ctx.aggregated_metrics or {}
    loads = metrics.get("load") or {}
    if not loads:
        # no engine figures yet (replicas starting): keep what is targeted
        return ctx.target_num_replicas, {}
    targets = list((metrics.get("target_load") or {}).values())
    target = targets[0] if targets else DEFAULT_TARGET_LOAD
    return desired_replicas(list(loads.values()), target), {}
