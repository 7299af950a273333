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


def test_an_engine_replica_that_cannot_start_says_why_on_its_process_stderr(
        tmp_path, monkeypatch, capfd):
    """Serve takes a replica's sys.stderr into a buffered log that a replica failing in its
    constructor never flushes, and tells `serve run` only "Failed to update the deployments":
    the reason goes to the process's own stderr, which Ray forwards to the console."""
    import io

    from deployments.engine_deployment import FaserEngine

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # as Serve's redirect takes it
    with pytest.raises(ValueError, match="model_type"):
        FaserEngine({"model": str(tmp_path)})
    line = "FASER serve: the engine replica could not start: ValueError: Unrecognized model"
    assert line in capfd.readouterr().err and line not in sys.stderr.getvalue()
