"""Autoscaling on the engines' own load figures (`record_autoscaling_stats`), not only on Ray's
count of ongoing requests: a replica whose KV cache is full is busy with few requests.

Each replica reports `load` (its busy fraction, the same score the router uses) and the
`target_load` it was deployed with; the fleet wants as many replicas as keep the mean load at
the target. Ray wraps the policy with min/max replicas and the up/down-scale delays.

With `max_replicas="auto"` (the default) the replicas also report `max_replicas`: how many
replicas of their shape the cluster's GPUs or CPUs hold, read from the cluster as it is, so the
fleet grows to fill the machines it has and no further (Ray's own bound is then
AUTO_MAX_REPLICAS). A cluster that adds nodes on demand (KubeRay) names its number instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ray.serve.config import AutoscalingContext

DEFAULT_TARGET_LOAD = 0.7
AUTO_MAX_REPLICAS = 256  # Ray's bound under "auto"; the cluster's size is the real one


def desired_replicas(loads: Sequence[float], target_load: float) -> float:
    """Replicas that would carry the summed load at `target_load` each (pure)."""
    if target_load <= 0:
        raise ValueError(f"target_load must be > 0, got {target_load}")
    return sum(max(0.0, load) for load in loads) / target_load


def replicas_that_fit(resources: Mapping[str, float], num_cpus: float, num_gpus: float) -> int:
    """How many replicas needing `num_cpus` and `num_gpus` each the cluster's `resources`
    (ray.cluster_resources()) hold; at least 1, and AUTO_MAX_REPLICAS for a replica that
    needs neither."""
    fits = [resources.get(name, 0.0) // need
            for name, need in (("CPU", num_cpus), ("GPU", num_gpus)) if need > 0]
    if not fits:
        return AUTO_MAX_REPLICAS
    return max(1, min(AUTO_MAX_REPLICAS, int(min(fits))))


def faser_autoscaling_policy(ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
    metrics = ctx.aggregated_metrics or {}
    loads = metrics.get("load") or {}
    if not loads:
        # no engine figures yet (replicas starting): keep what is targeted
        return ctx.target_num_replicas, {}
    targets = list((metrics.get("target_load") or {}).values())
    target = targets[0] if targets else DEFAULT_TARGET_LOAD
    desired = desired_replicas(list(loads.values()), target)
    caps = list((metrics.get("max_replicas") or {}).values())
    return (min(desired, min(caps)) if caps else desired), {}
