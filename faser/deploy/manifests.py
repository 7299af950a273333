"""KubeRay manifests as plain dicts: the RayService (a CPU head and an autoscaled GPU worker group
serving `deployments:build_app`), a PodMonitor for Prometheus and the kustomization over them.

The worker group is sized from the same AppArgs that size the Serve deployment, so the number of
GPU pods KubeRay may start always matches the number of engine replicas Serve may ask for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import ray

from deployments import RAY_ENV, AppArgs
from faser.deploy.serve_config import HTTP_PORT

APP_LABEL = "faser-serve"  # app.kubernetes.io/name of every pod: what the PodMonitor selects
METRICS_PORT = 8080  # Ray's metrics export port (KubeRay's default), Serve and app metrics included
DASHBOARD_PORT = 8265
GCS_PORT = 6379
CLIENT_PORT = 10001
MODELS_DIR = "/models"
CACHE_DIR = "/home/ray/.cache/faser"  # where the image keeps the embedded default model


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """What the cluster is made of, beside the application's own arguments."""

    name: str = "faser"
    image_name: str = "faser-serve"  # `kustomize edit set image` points it at a registry
    image_tag: str = "0.1.0"
    ray_version: str = ray.__version__
    gpus_per_worker: int = 1
    worker_cpus: int = 8
    worker_memory: str = "32Gi"
    head_cpus: int = 2
    head_memory: str = "8Gi"
    gpu_resource: str = "nvidia.com/gpu"
    models_claim: str | None = None  # a PVC with the user's checkpoints, read-only at MODELS_DIR

    def __post_init__(self) -> None:
        if self.gpus_per_worker < 1:
            raise ValueError(f"gpus_per_worker must be >= 1, got {self.gpus_per_worker}")
        if self.worker_cpus < 1 or self.head_cpus < 1:
            raise ValueError("worker_cpus and head_cpus must be >= 1")

    @property
    def image(self) -> str:
        return f"{self.image_name}:{self.image_tag}"


@dataclass(frozen=True, slots=True)
class WorkerBounds:
    replicas: int
    min_replicas: int
    max_replicas: int


def worker_bounds(args: AppArgs, cluster: ClusterSpec) -> WorkerBounds:
    """GPU pods needed for the engine replicas Serve may run (fewest, most)."""
    if args.device != "cuda":
        raise ValueError(f"device must be 'cuda' for a GPU cluster, got {args.device!r}")
    gpus = args.gpus_per_replica
    if not 0 < gpus <= cluster.gpus_per_worker:
        raise ValueError(f"num_gpus must lie in (0, {cluster.gpus_per_worker}], got {gpus}")
    cpus = args.cpus_per_replica
    if cpus > cluster.worker_cpus - 1:  # one core stays with the raylet and the proxy
        raise ValueError(f"num_cpus must be <= {cluster.worker_cpus - 1}, got {cpus}")
    per_worker = int(cluster.gpus_per_worker // gpus)
    if cpus > 0:
        per_worker = min(per_worker, int((cluster.worker_cpus - 1) // cpus))
    if args.num_replicas == "auto":
        if args.max_replicas == "auto":  # the cluster grows on demand: it has no size to read
            raise ValueError("max_replicas must be a number for a KubeRay cluster, not 'auto'")
        low, high = args.min_replicas, args.max_replicas
    else:
        low = high = args.num_replicas
    low_pods, high_pods = math.ceil(low / per_worker), math.ceil(high / per_worker)
    return WorkerBounds(replicas=low_pods, min_replicas=low_pods, max_replicas=high_pods)


def rayservice(args: AppArgs, cluster: ClusterSpec, serve_config_yaml: str) -> dict[str, Any]:
    bounds = worker_bounds(args, cluster)
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": cluster.name, "labels": _labels("rayservice")},
        "spec": {
            "serveConfigV2": serve_config_yaml,
            "rayClusterConfig": {
                "rayVersion": cluster.ray_version,
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": _autoscaler_options(),
                "headGroupSpec": _head_group(cluster),
                "workerGroupSpecs": [_gpu_worker_group(cluster, bounds)],
            },
        },
    }


def pod_monitor(cluster: ClusterSpec) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        # kube-prometheus-stack picks up monitors labelled with its Helm release name
        "metadata": {
            "name": cluster.name,
            "labels": {**_labels("monitoring"), "release": "prometheus"},
        },
        "spec": {
            "jobLabel": "app.kubernetes.io/name",
            "selector": {"matchLabels": {"app.kubernetes.io/name": APP_LABEL}},
            "podMetricsEndpoints": [
                {
                    "port": "metrics",
                    "path": "/metrics",
                    "interval": "15s",
                    # the labels Ray's own Grafana dashboards filter on
                    "relabelings": [
                        _copy_label("ray_io_cluster", "ray_io_cluster"),
                        _copy_label("ray_io_node_type", "ray_io_node_type"),
                    ],
                }
            ],
        },
    }


def kustomization(files: list[str], cluster: ClusterSpec) -> dict[str, Any]:
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": files,
        # `kustomize edit set image faser-serve=<registry>/faser-serve:<tag>` rewrites this entry
        "images": [{"name": cluster.image_name, "newTag": cluster.image_tag}],
    }


def _labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": APP_LABEL, "app.kubernetes.io/component": component}


def _copy_label(pod_label: str, target: str) -> dict[str, Any]:
    return {
        "action": "replace",
        "sourceLabels": [f"__meta_kubernetes_pod_label_{pod_label}"],
        "targetLabel": target,
    }


def _autoscaler_options() -> dict[str, Any]:
    resources = {"cpu": "500m", "memory": "512Mi"}
    return {
        "upscalingMode": "Default",
        # Serve's downscale delay is 60 s: idle GPU pods go a minute after their replicas
        "idleTimeoutSeconds": 60,
        "resources": {"limits": resources, "requests": resources},
    }


def _head_group(cluster: ClusterSpec) -> dict[str, Any]:
    resources = {"cpu": str(cluster.head_cpus), "memory": cluster.head_memory}
    container = {
        "name": "ray-head",
        "image": cluster.image,
        "imagePullPolicy": "IfNotPresent",
        "env": _env(),
        "ports": [
            _port("gcs-server", GCS_PORT),
            _port("dashboard", DASHBOARD_PORT),
            _port("client", CLIENT_PORT),
            _port("serve", HTTP_PORT),
            _port("metrics", METRICS_PORT),
        ],
        "resources": {"limits": resources, "requests": resources},
    }
    return {
        # num-cpus 0: no engine replica (nor any task that asks for a CPU) lands on the head
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0", "num-gpus": "0"},
        "template": {
            "metadata": {"labels": _labels("ray-head")},
            "spec": {"containers": [container]},
        },
    }


def _gpu_worker_group(cluster: ClusterSpec, bounds: WorkerBounds) -> dict[str, Any]:
    resources = {
        "cpu": str(cluster.worker_cpus),
        "memory": cluster.worker_memory,
        cluster.gpu_resource: str(cluster.gpus_per_worker),
    }
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if cluster.models_claim:
        mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
        claim = {"claimName": cluster.models_claim, "readOnly": True}
        volumes.append({"name": "models", "persistentVolumeClaim": claim})
    container = {
        "name": "ray-worker",
        "image": cluster.image,
        "imagePullPolicy": "IfNotPresent",
        "env": _env(),
        "ports": [_port("serve", HTTP_PORT), _port("metrics", METRICS_PORT)],
        "resources": {"limits": resources, "requests": resources},
        "volumeMounts": mounts,
    }
    return {
        "groupName": "gpu",
        "replicas": bounds.replicas,
        "minReplicas": bounds.min_replicas,
        "maxReplicas": bounds.max_replicas,
        "rayStartParams": {},
        "template": {
            "metadata": {"labels": _labels("ray-worker")},
            "spec": {
                "containers": [container],
                "volumes": volumes,
                # GPU node pools are commonly tainted so that only GPU work lands there
                "tolerations": [
                    {"key": cluster.gpu_resource, "operator": "Exists", "effect": "NoSchedule"}
                ],
            },
        },
    }


def _env() -> list[dict[str, str]]:
    # Ray's switches the app runs under (deployments/__init__.py)
    ray_env = [{"name": name, "value": value} for name, value in RAY_ENV.items()]
    return [{"name": "FASER_CACHE", "value": CACHE_DIR}, *ray_env]


def _port(name: str, number: int) -> dict[str, Any]:
    return {"name": name, "containerPort": number, "protocol": "TCP"}
