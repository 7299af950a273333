"""Binds the Ray Serve application: an OpenAI ingress in front of the engine deployment.

`build_app(args)` is what `serve run deployments:build_app key=value ...` calls; binding loads
nothing (the engine loads its models in each replica's constructor).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig
from ray.serve.deployment import Application

from deployments.args import AppArgs
from deployments.autoscaling import AUTO_MAX_REPLICAS, faser_autoscaling_policy
from deployments.engine_deployment import FaserEngine
from deployments.ingress import OpenAIIngress
from deployments.router import LoadAwareRequestRouter

INGRESS_MAX_ONGOING = 1024  # the ingress only forwards: backpressure belongs to the engines


def build_app(args: AppArgs | dict[str, Any] | None = None) -> Application:
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    _warn_models_not_here(args)
    engine = serve.deployment(FaserEngine).options(
        name="FaserEngine",
        ray_actor_options=args.ray_actor_options(),
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        request_router_config=_router_config(args),
        health_check_period_s=5.0,
        **_replicas(args),
    )
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress",
        num_replicas=args.ingress_replicas,
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0},
    )
    engine_app = engine.bind(args.model_dump())
    return ingress.bind(engine_app, args.retry_after_s, args.api_keys, args.max_body_bytes)


def _warn_models_not_here(args: AppArgs) -> None:
    """Says so where `serve run` shows it when a model path is not on this machine: replicas that
    fail to load it report only that they failed (their logs say why), and on a cluster the files
    may rightly be on the replicas' nodes alone, so it is no error here."""
    for field, name in (("model", args.model), ("draft_model", args.draft_model)):
        if name is None or ("/" not in name and not name.endswith(".gguf")):
            continue  # a model's name: the replicas resolve it
        if not Path(name).expanduser().exists():
            print(f"faser: {field}={name!r} is not on this machine; the engine replicas load it, "
                  "so it must be on their nodes", file=sys.stderr)


def _router_config(args: AppArgs) -> RequestRouterConfig:
    if args.router == "power_of_two":
        return RequestRouterConfig(request_routing_stats_period_s=args.routing_stats_period_s)
    return RequestRouterConfig(
        request_router_class=LoadAwareRequestRouter,
        request_routing_stats_period_s=args.routing_stats_period_s,
        request_routing_stats_timeout_s=max(1.0, 4 * args.routing_stats_period_s),
    )


def _replicas(args: AppArgs) -> dict[str, Any]:
    if args.num_replicas != "auto":
        return {"num_replicas": args.num_replicas}
    autoscaling = AutoscalingConfig(
        min_replicas=args.min_replicas,
        # "auto": the replicas report what the cluster holds and the policy keeps to it
        max_replicas=AUTO_MAX_REPLICAS if args.max_replicas == "auto" else args.max_replicas,
        upscale_delay_s=args.upscale_delay_s,
        downscale_delay_s=args.downscale_delay_s,
        look_back_period_s=args.look_back_period_s,
        metrics_interval_s=args.metrics_interval_s,
        policy=AutoscalingPolicy(policy_function=faser_autoscaling_policy),
    )
    return {"autoscaling_config": autoscaling}
