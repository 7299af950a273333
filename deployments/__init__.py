"""Ray Serve application of FASER serve.

`serve run deployments:app` serves the embedded default on CPU; `serve run
deployments:build_app model=... draft_model=... device=cuda num_replicas=auto` takes arguments
(validated by deployments.args.AppArgs). Importing this module binds; it loads no model.
"""

from deployments.app_builder import build_app
from deployments.args import AppArgs

app = build_app(AppArgs())

__all__ = ["AppArgs", "app", "build_app"]
