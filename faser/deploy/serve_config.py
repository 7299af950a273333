"""serveConfigV2 for KubeRay: the Ray Serve config of `deployments:build_app` with given arguments.

It takes the path `serve build` takes: bind the application, let Ray Serve's own `build_app` walk
it, and turn each deployment into its `DeploymentSchema` with `deployment_to_schema`. `serve build`
only accepts a bound `Application` (no arguments), so the application is named here as the builder
`deployments:build_app` with its `args`, and the per-deployment options Ray derives from those
same arguments are listed beside them. The result is validated by `ServeDeploySchema`.
"""

from __future__ import annotations

from typing import Any

from ray.serve._private.build_app import build_app as build_serve_app
from ray.serve.deployment import deployment_to_schema
from ray.serve.schema import LoggingConfig, ServeApplicationSchema, ServeDeploySchema

from deployments import AppArgs, build_app

IMPORT_PATH = "deployments:build_app"
APP_NAME = "faser"
HTTP_PORT = 8000

# The arguments of the committed manifest: one engine per GPU, autoscaled on the engines' load.
GPU_ARGS: dict[str, Any] = {
    "device": "cuda",
    "dtype": "bfloat16",
    "num_gpus": 1,
    "num_cpus": 4,
    "num_replicas": "auto",
    "min_replicas": 1,
    "max_replicas": 4,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 2048,
    "kv_cache_memory_gb": 8.0,
}


def gpu_args(overrides: dict[str, Any] | None = None) -> AppArgs:
    """GPU_ARGS with `overrides` on top (command-line strings allowed), validated."""
    return AppArgs.model_validate({**GPU_ARGS, **(overrides or {})})


def application_schema(args: AppArgs) -> dict[str, Any]:
    """One application of the Serve config, as `serve build` writes it (plus `args`)."""
    built = build_serve_app(build_app(args), name=APP_NAME)
    schema = ServeApplicationSchema(
        name=APP_NAME,
        route_prefix="/",
        import_path=IMPORT_PATH,
        # the arguments as given: the same call `serve run deployments:build_app k=v ...` makes
        args=args.model_dump(mode="json", exclude_unset=True),
        runtime_env={},
        deployments=[deployment_to_schema(d) for d in built.deployments],
    )
    return schema.model_dump(mode="json", exclude_unset=True)


def serve_config(args: AppArgs) -> dict[str, Any]:
    """The whole ServeDeploySchema document (KubeRay's serveConfigV2), validated."""
    config = {
        "proxy_location": "EveryNode",
        # every interface of the pod: KubeRay's serve Service reaches the proxies through it
        "http_options": {"host": "0.0.0.0", "port": HTTP_PORT},
        "logging_config": LoggingConfig().model_dump(mode="json"),
        "applications": [application_schema(args)],
    }
    ServeDeploySchema.model_validate(config)
    return config
