"""`deployments:app` autoscales by default: from one replica up to as many as the cluster's CPUs
or GPUs hold, which the replicas report and the policy keeps to (no Ray cluster needed)."""

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

import deployments
from deployments.args import AppArgs
from deployments.autoscaling import (
    AUTO_MAX_REPLICAS,
    faser_autoscaling_policy,
    replicas_that_fit,
)


def test_the_default_app_autoscales_from_one_replica():
    args = AppArgs()
    assert (args.num_replicas, args.min_replicas, args.max_replicas) == ("auto", 1, "auto")
    engine = deployments.app._bound_deployment.init_args[0]._bound_deployment
    config = engine._deployment_config
    autoscaling = config.autoscaling_config
    assert autoscaling is not None
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, AUTO_MAX_REPLICAS)
    assert autoscaling.policy.policy_function.endswith("faser_autoscaling_policy")


def test_max_replicas_takes_a_number_or_auto():
    assert AppArgs.model_validate({"max_replicas": "3"}).max_replicas == 3
    with pytest.raises(ValidationError, match="max_replicas"):
        AppArgs.model_validate({"max_replicas": "many"})
    with pytest.raises(ValidationError, match="max_replicas must be >= min_replicas"):
        AppArgs.model_validate({"min_replicas": 3, "max_replicas": 2})
    assert AppArgs.model_validate({"min_replicas": 3}).max_replicas == "auto"


@pytest.mark.parametrize(
    ("resources", "num_cpus", "num_gpus", "fits"),
    [
        ({"CPU": 16.0}, 1.0, 0.0, 16),
        ({"CPU": 2.0}, 0.5, 0.0, 4),
        ({"CPU": 64.0, "GPU": 3.0}, 4.0, 1.0, 3),  # the GPUs bound a CUDA fleet
        ({"CPU": 8.0, "GPU": 8.0}, 4.0, 1.0, 2),  # ... unless its CPUs run out first
        ({"CPU": 0.5}, 1.0, 0.0, 1),  # one replica at least: the cluster may grow
        ({"CPU": 4.0}, 0.0, 0.0, AUTO_MAX_REPLICAS),
    ],
)
def test_replicas_that_fit_the_cluster(resources, num_cpus, num_gpus, fits):
    assert replicas_that_fit(resources, num_cpus, num_gpus) == fits


def context(max_replicas: dict | None) -> SimpleNamespace:
    metrics = {"load": {"a": 0.9, "b": 0.9}, "target_load": {"a": 0.6, "b": 0.6}}
    if max_replicas is not None:
        metrics["max_replicas"] = max_replicas
    return SimpleNamespace(aggregated_metrics=metrics, target_num_replicas=2)


def test_the_policy_keeps_to_what_the_cluster_holds():
    assert faser_autoscaling_policy(context(None))[0] == pytest.approx(3.0)
    assert faser_autoscaling_policy(context({"a": 8.0, "b": 8.0}))[0] == pytest.approx(3.0)
    assert faser_autoscaling_policy(context({"a": 2.0, "b": 2.0}))[0] == 2.0
