"""The engine deployment: one replica holds one engine (draft and target on one device).

It streams StreamStart / StreamDelta / RequestError events to the ingress, takes the fleet's
load from the router with every request, and reports its load to the router
(`record_routing_stats`) and the autoscaler (`record_autoscaling_stats`, with how many replicas
the cluster holds when `max_replicas` is "auto").
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from deployments.args import AppArgs
from deployments.autoscaling import replicas_that_fit
from deployments.metrics import ReplicaMetrics
from deployments.routing_policy import load_from_stats, replica_score
from deployments.serving import GenerateRequest, OpenAIServing, Renderer, StreamEvent
from faser.engine.async_engine import AsyncLLMEngine


class FaserEngine:
    def __init__(self, args: dict[str, Any]) -> None:
        # plain arguments cross to the replica, which builds its own frozen EngineConfig
        app_args = AppArgs.model_validate(args)
        config = app_args.engine_config()
        from faser.engine.llm_engine import LLMEngine  # the heavy import only on replicas

        def build() -> LLMEngine:
            try:
                engine = LLMEngine(config)
                engine.prepare()  # before the replica is ready, not inside its first request
            except Exception as exc:
                _say_why_not_started(exc)
                raise
            return engine

        interval_s = app_args.stream_interval_ms / 1e3
        self.async_engine = AsyncLLMEngine(build, stream_interval_s=interval_s,
                                           stream_deltas_per_s=app_args.stream_deltas_per_s)
        self.engine = engine = self.async_engine.engine
        self.target_load = app_args.target_load
        self.served_model_name = app_args.served_model_name or engine.model_name
        self.capacity = config.max_num_seqs
        # (CPUs, GPUs) of one replica, when the cluster's size bounds the fleet
        self.auto_shape: tuple[float, float] | None = None
        if app_args.max_replicas == "auto":
            self.auto_shape = (app_args.cpus_per_replica, app_args.gpus_per_replica)
        self.replica_id = _replica_id()
        self.serving = OpenAIServing(
            self.async_engine,
            engine.tokenizer,
            engine.max_model_len,
            self.replica_id,
            config.spec.policy,
            app_args.default_slo(),
        )
        self.metrics = ReplicaMetrics(self.async_engine)

    async def model_name(self) -> str:
        return self.served_model_name

    async def renderer(self) -> Renderer:
        """The model's tokenizer and context window, for the ingress's /tokenize and
        /detokenize."""
        return self.serving.renderer

    async def generate(
        self, request: GenerateRequest, cluster_load: float | None = None
    ) -> AsyncIterator[StreamEvent]:
        if cluster_load is not None:
            self.async_engine.set_cluster_load(cluster_load)
        clock = self.metrics.request()
        async for event in self.serving.stream(request):
            clock.observe(event)
            yield event

    def record_routing_stats(self) -> dict[str, Any]:
        stats = dict(self.async_engine.load_stats())
        stats["capacity"] = self.capacity
        return stats

    def record_autoscaling_stats(self) -> dict[str, float]:
        stats = self.async_engine.load_stats()
        load = replica_score(load_from_stats(self.replica_id, self.capacity, 0, stats))
        report = {
            "load": load,
            "target_load": self.target_load,
            "kv_usage": float(stats.get("kv_usage", 0.0)),
        }
        if self.auto_shape is not None:
            fits = replicas_that_fit(ray.cluster_resources(), *self.auto_shape)
            report["max_replicas"] = float(fits)
        return report

    def check_health(self) -> None:
        if not self.async_engine.is_alive():
            raise RuntimeError("the engine's step loop has stopped")

    def block_usage(self) -> dict[str, int]:
        """For tests and operators: blocks free and in total, streams open."""
        return {
            "num_free_blocks": self.engine.num_free_blocks,
            "num_total_blocks": self.engine.num_total_blocks,
            "num_streams": self.async_engine.num_streams,
        }

    def __del__(self) -> None:
        if hasattr(self, "metrics"):
            self.metrics.close()
        if hasattr(self, "async_engine"):
            self.async_engine.shutdown()


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Ray Serve (tests of the class itself)
        return "local"


def _say_why_not_started(exc: Exception) -> None:
    """One line on the replica process's own stderr, which Ray forwards to `serve run`'s console.
    Serve answers a replica that cannot start with "Failed to update the deployments" alone,
    keeps the reason in its controller's log, and takes a replica's sys.stderr into a buffered
    log that a failed replica never flushes (and its print too): hence sys.__stderr__, written."""
    sys.__stderr__.write(
        f"FASER serve: the engine replica could not start: {type(exc).__name__}: {exc}\n"
    )
    sys.__stderr__.flush()
