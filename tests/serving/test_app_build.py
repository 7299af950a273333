"""Binding the application loads no model, and `serve build deployments:app` writes a config
that Ray's own schema accepts."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments import build_app
from deployments.autoscaling import faser_autoscaling_policy

ROOT = Path(__file__).resolve().parents[2]


def engine_deployment(app):
    ingress = app._bound_deployment
    return ingress.init_args[0]._bound_deployment


def test_autoscaling_and_router_arguments_reach_the_engine_deployment():
    app = build_app({"num_replicas": "auto", "min_replicas": 1, "max_replicas": 3,
                     "device": "cuda", "max_queued_requests": 5})
    engine = engine_deployment(app)
    config = engine._deployment_config
    assert config.autoscaling_config.max_replicas == 3
    assert config.autoscaling_config.policy.policy_function.endswith("faser_autoscaling_policy")
    assert callable(faser_autoscaling_policy)
    assert config.max_queued_requests == 5
    assert engine.ray_actor_options["num_gpus"] == 1.0
    router = config.request_router_config.request_router_class
    assert router.endswith("LoadAwareRequestRouter")


@pytest.mark.slow
def test_serve_build_gives_a_valid_config(tmp_path):
    out = tmp_path / "serve_config.yaml"
    subprocess.run(
        [str(Path(sys.executable).parent / "serve"), "build", "deployments:app", "-o", str(out)],
        cwd=ROOT, check=True, capture_output=True, timeout=120,
    )
    config = yaml.safe_load(out.read_text())
    ServeDeploySchema.model_validate(config)
    app = config["applications"][0]
    assert app["import_path"] == "deployments:app"
    names = {d["name"] for d in app["deployments"]}
    assert names == {"FaserEngine", "OpenAIIngress"}
