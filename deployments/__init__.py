"""Ray Serve application of FASER serve.

`serve run deployments:app` serves the embedded default on CPU; `serve run
deployments:build_app model=... draft_model=... device=cuda num_replicas=auto` takes arguments
(validated by deployments.args.AppArgs). Importing this module binds; it loads no model.
"""

import os

# Serve reads its switches once, when it is imported: importing it first leaves this process (a
# script holding handles, say) Serve's defaults, and the switches below reach only the Ray
# processes started after this import.
import ray.serve  # noqa: F401

# Ray Serve's throughput-optimised mode (gRPC between handles and replicas, user code on the
# replica's own event loop), but through Serve's proxy on the usual port, not direct ingress.
# `serve run` imports the app before it starts a local Ray, whose processes inherit these; a
# cluster started otherwise sets them itself (the KubeRay manifests do).
RAY_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
for _name, _value in RAY_ENV.items():
    os.environ.setdefault(_name, _value)

from deployments.app_builder import build_app  # noqa: E402
from deployments.args import AppArgs  # noqa: E402

app = build_app(AppArgs())

__all__ = ["RAY_ENV", "AppArgs", "app", "build_app"]
