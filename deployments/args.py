"""Arguments of `serve run deployments:build_app key=value ...`, validated at the edge.

Every value may arrive as a string from the command line; pydantic turns it into its type or
answers with an error naming the field. `engine_config()` hands the core its frozen dataclass.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from deployments.access import MAX_BODY_BYTES
from faser.config import EngineConfig, SpecConfig, parse_policy


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # what to serve
    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct)
    draft_model: str | None = None
    served_model_name: str | None = None  # None: the engine's own name for the model
    policy: str = "faser"
    max_k: int = Field(default=4, ge=0, le=16)
    frontier_size: int | None = Field(default=None, ge=1)  # None: the policy's choice per step
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # how linear weights are laid out (faser/runner/weights.py); "auto": the row-invariant
    # CPU kernel's "packed" panels where it runs, else torch's "dense" linear
    weight_format: Literal["auto", "dense", "packed"] = "auto"
    # the draft's weights: "int8" (packed bf16) or "q8_0" (packed float32) cut the bytes a draft
    # step reads; the output never changes, only how often drafts are accepted; "auto": the one
    # that runs
    draft_weights: Literal["auto", "same", "int8", "q8_0"] = "auto"
    seed: int = 0
    # the deployment's default SLO, for requests that bring none (SLO-aware speculation)
    slo_tpot_ms: float | None = Field(default=None, gt=0)
    slo_ttft_ms: float | None = Field(default=None, gt=0)

    # engine capacity
    max_num_seqs: int = Field(default=16, ge=1)
    max_num_batched_tokens: int = Field(default=512, ge=1)
    max_model_len: int | None = Field(default=None, ge=2)
    block_size: int = Field(default=16, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    kv_cache_memory_gb: float = Field(default=1.0, gt=0)
    prefix_caching: bool = True  # reuse the KV of prompt blocks an earlier request computed

    # replicas and their resources: autoscaled by default, up to as many replicas as the
    # cluster's GPUs (device cuda) or CPUs hold ("auto", read as the cluster grows or shrinks)
    num_replicas: int | Literal["auto"] = "auto"
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int | Literal["auto"] = "auto"
    target_load: float = Field(default=0.7, gt=0, le=4.0)  # autoscaling: busy fraction to aim at
    # autoscaling pace (Ray's AutoscalingConfig names): how long a decision must hold, how far
    # back the replicas' load is averaged and how often replicas report it (Ray 2.60 still
    # reads metrics_interval_s, though it warns that an environment variable will replace it)
    upscale_delay_s: float = Field(default=5.0, ge=0)
    downscale_delay_s: float = Field(default=60.0, ge=0)
    look_back_period_s: float = Field(default=30.0, gt=0)
    metrics_interval_s: float = Field(default=10.0, gt=0)
    # None: a CPU replica takes its node's cores (its engine's threads are the speed it has), a
    # GPU replica one core
    num_cpus: float | None = Field(default=None, ge=0)
    num_gpus: float | None = Field(default=None, ge=0)  # None: 1 on cuda, 0 on cpu
    torch_threads: int | None = Field(default=None, ge=1)  # None: num_cpus (at least 1)

    # backpressure and routing
    max_ongoing_requests: int = Field(default=32, ge=1)
    max_queued_requests: int = Field(default=64, ge=-1)  # -1: unbounded
    retry_after_s: int = Field(default=1, ge=0)
    router: Literal["load_aware", "power_of_two"] = "load_aware"
    routing_stats_period_s: float = Field(default=0.5, gt=0)
    ingress_replicas: int = Field(default=1, ge=1)
    # a stream's tokens go out at most this often (its first token and its end at once); 0: every
    # step. Each chunk costs every hop to the client CPU time that the engine's threads wait for.
    stream_interval_ms: float = Field(default=50.0, ge=0)
    # and all of a replica's streams together at most this many chunks a second (0: no cap): at
    # 16 streams each then gets a chunk every 250 ms
    stream_deltas_per_s: float = Field(default=64.0, ge=0)

    # access: Bearer keys (None: the FASER_API_KEYS environment variable; none: open) and the
    # largest request body accepted
    api_keys: list[str] | None = None
    max_body_bytes: int = Field(default=MAX_BODY_BYTES, ge=1024)

    @field_validator("num_replicas", "max_replicas", mode="before")
    @classmethod
    def _replicas_from_text(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str) and value != "auto":
            if not value.isdigit():
                raise ValueError(f"{info.field_name} must be a positive integer or 'auto'")
            return int(value)
        return value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys_from_text(cls, value: Any) -> Any:
        return value.split(",") if isinstance(value, str) else value

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        parse_policy(value, 4)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> AppArgs:
        if isinstance(self.num_replicas, int) and self.num_replicas < 1:
            raise ValueError("num_replicas must be >= 1 or 'auto'")
        if isinstance(self.max_replicas, int) and self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas must be >= min_replicas")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.draft_model is not None and self.model is None:
            raise ValueError("draft_model needs model: the embedded default brings its own draft")
        return self

    @property
    def gpus_per_replica(self) -> float:
        if self.num_gpus is not None:
            return self.num_gpus
        return 1.0 if self.device == "cuda" else 0.0

    @property
    def cpus_per_replica(self) -> float:
        if self.num_cpus is not None:
            return self.num_cpus
        return 1.0 if self.device == "cuda" else _node_cpus()

    @property
    def threads_per_replica(self) -> int:
        return self.torch_threads or max(1, int(self.cpus_per_replica))

    def default_slo(self) -> dict[str, float] | None:
        """The requests' default `slo` object; None when the deployment sets none."""
        slo = {"tpot_ms": self.slo_tpot_ms, "ttft_ms": self.slo_ttft_ms}
        return {k: v for k, v in slo.items() if v is not None} or None

    def ray_actor_options(self) -> dict[str, Any]:
        return {"num_cpus": self.cpus_per_replica, "num_gpus": self.gpus_per_replica}

    def engine_config(self) -> EngineConfig:
        policy, k = parse_policy(self.policy, self.max_k)
        return EngineConfig(
            model=self.model,
            draft_model=self.draft_model,
            spec=SpecConfig(
                policy=policy, num_speculative_tokens=k, frontier_size=self.frontier_size
            ),
            device=self.device,
            dtype=self.dtype,
            weight_format=self.weight_format,
            draft_weights=self.draft_weights,
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory_gb=self.kv_cache_memory_gb,
            prefix_caching=self.prefix_caching,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            num_threads=self.threads_per_replica,
            seed=self.seed,
        )


def _node_cpus() -> float:
    """The CPUs Ray counts on this node (cgroup quotas included, unlike os.cpu_count()), so that a
    replica asking for all of them can be placed."""
    try:
        from ray._private.utils import get_num_cpus

        return float(get_num_cpus())
    except Exception:  # a Ray without that helper
        return float(os.cpu_count() or 1)
