"""The committed manifests of k8s/ and one fresh rendering of them, shared by the k8s tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

K8S_DIR = Path(__file__).resolve().parents[2] / "k8s"


@pytest.fixture(scope="session")
def k8s_dir() -> Path:
    return K8S_DIR


@pytest.fixture(scope="session")
def rendered() -> dict[str, str]:
    from faser.deploy.kuberay import render

    return render()


@pytest.fixture(scope="session")
def rayservice() -> dict[str, Any]:
    return yaml.safe_load((K8S_DIR / "rayservice.yaml").read_text())


@pytest.fixture(scope="session")
def podmonitor() -> dict[str, Any]:
    return yaml.safe_load((K8S_DIR / "podmonitor.yaml").read_text())


@pytest.fixture(scope="session")
def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def pod_templates(rayservice: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [group["template"] for group in groups]
