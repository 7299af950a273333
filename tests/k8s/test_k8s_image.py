"""The image, the kustomization and the cluster agree with each other and with the project."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import ray
import yaml

from deployments import AppArgs
from faser.deploy.manifests import ClusterSpec, worker_bounds

ROOT = Path(__file__).resolve().parents[2]


def _dockerfile_args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S*)$", text, flags=re.MULTILINE))


def test_image_is_rays_own_at_the_pinned_version(k8s_dir: Path, rayservice) -> None:
    text = (k8s_dir / "Dockerfile").read_text()
    assert _dockerfile_args(text)["RAY_VERSION"] == ray.__version__
    assert rayservice["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__
    (base,) = re.findall(r"^FROM (\S+)", text, flags=re.MULTILINE)
    assert base == "rayproject/ray:${RAY_VERSION}-py311-gpu"
    assert "pip install /tmp/faser-src" in text and "torch==${TORCH_VERSION}" in text


def test_dockerignore_keeps_what_pip_install_needs(k8s_dir: Path) -> None:
    ignored = {
        line.strip().rstrip("/")
        for line in (k8s_dir / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dirs = project["tool"]["setuptools"]["package-dir"]
    packages = project["tool"]["setuptools"]["packages"]
    needed = {package_dirs.get(p, p.replace(".", "/")).split("/")[0] for p in packages}
    needed |= {"pyproject.toml", project["project"]["readme"]}
    assert not needed & ignored
    assert {".git", ".venv"} <= ignored


def test_kustomization_lists_every_manifest_and_names_the_image(k8s_dir: Path, rayservice) -> None:
    kustomization = yaml.safe_load((k8s_dir / "kustomization.yaml").read_text())
    manifests = {p.name for p in k8s_dir.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests
    (image,) = kustomization["images"]
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        (container,) = group["template"]["spec"]["containers"]
        assert container["image"].rpartition(":")[0] == image["name"]


@pytest.mark.parametrize(
    ("overrides", "cluster", "bounds"),
    [
        ({}, ClusterSpec(), (1, 4)),
        ({"num_gpus": 0.5, "num_cpus": 2}, ClusterSpec(), (1, 2)),
        ({"max_replicas": 5}, ClusterSpec(gpus_per_worker=2, worker_cpus=16), (1, 3)),
        ({"num_replicas": 3}, ClusterSpec(), (3, 3)),
        ({"num_gpus": 1, "num_cpus": 3}, ClusterSpec(gpus_per_worker=4), (1, 2)),
    ],
)
def test_worker_bounds(overrides, cluster: ClusterSpec, bounds: tuple[int, int]) -> None:
    from faser.deploy.serve_config import gpu_args

    result = worker_bounds(gpu_args(overrides), cluster)
    assert (result.min_replicas, result.max_replicas) == bounds


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (AppArgs(device="cpu"), "device"),
        (AppArgs(device="cuda", num_gpus=2), "num_gpus"),
        (AppArgs(device="cuda", num_gpus=0), "num_gpus"),
        (AppArgs(device="cuda", num_cpus=8), "num_cpus"),
        (AppArgs(device="cuda", max_replicas="auto"), "max_replicas"),
    ],
)
def test_worker_bounds_name_the_bad_field(args: AppArgs, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        worker_bounds(args, ClusterSpec())
