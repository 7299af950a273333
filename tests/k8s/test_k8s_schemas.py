"""The manifests validate offline: the RayService against KubeRay's CRD schema (strictly), its
serveConfigV2 against Ray Serve's own schema, the pods with kubernetes-validate, the PodMonitor
structurally (kubernetes-validate knows no CRDs)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.k8s.conftest import pod_templates

# the KubeRay CRD ships beside the repository, in ../shared
CRD_PATH = Path(__file__).resolve().parents[3] / "shared" / "schemas" / "ray.io_rayservices.yaml"
K8S_VERSION = "1.33.0"  # one of the versions kubernetes-validate ships schemas for


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Unknown fields become errors: additionalProperties false on every object node with
    `properties`, unless it preserves unknown fields or already says what extra keys may be."""
    node = dict(schema)
    if "properties" in schema:
        node["properties"] = {name: strict(sub) for name, sub in schema["properties"].items()}
        open_node = schema.get("x-kubernetes-preserve-unknown-fields") is True
        if not open_node and "additionalProperties" not in schema:
            node["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            node[key] = strict(schema[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            node[key] = [strict(sub) for sub in schema[key]]
    return node


@pytest.fixture(scope="module")
def rayservice_validator() -> jsonschema.protocols.Validator:
    if not CRD_PATH.is_file():
        pytest.skip(f"{CRD_PATH} is not on this machine")
    # 18,000 lines: libyaml reads them far faster than the pure-Python loader
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(CRD_PATH.read_text(), Loader=loader)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = strict(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def _errors(validator: jsonschema.protocols.Validator, document: Any) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(document)]


def test_rayservice_validates_strictly_against_the_crd(rayservice_validator, rayservice) -> None:
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["kind"] == "RayService"
    assert _errors(rayservice_validator, rayservice) == []


def test_strict_crd_schema_rejects_an_unknown_field(rayservice_validator, rayservice) -> None:
    broken = copy.deepcopy(rayservice)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 4
    errors = _errors(rayservice_validator, broken)
    assert len(errors) == 1 and "maxReplica" in errors[0]


def test_cluster_shape(rayservice) -> None:
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    assert {p["name"] for p in head["ports"]} >= {"serve", "dashboard", "metrics"}
    (worker_group,) = cluster["workerGroupSpecs"]
    worker = worker_group["template"]["spec"]["containers"][0]
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert worker["resources"]["requests"] == worker["resources"]["limits"]
    assert worker_group["minReplicas"] <= worker_group["replicas"] <= worker_group["maxReplicas"]


def test_serve_config_validates_with_ray_serve(serve_config) -> None:
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config)
    (app,) = serve_config["applications"]
    assert app["import_path"] in ("deployments:build_app", "deployments:app")


def test_serve_config_is_what_its_args_build(serve_config) -> None:
    """Ray's controller path: import the builder, call it with `args`, build the application;
    the deployments it yields are exactly the ones listed, option for option."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app as build_serve_app
    from ray.serve.deployment import deployment_to_schema

    from deployments import AppArgs

    (app,) = serve_config["applications"]
    args = AppArgs.model_validate(app["args"])
    assert args.device == "cuda" and args.gpus_per_replica >= 1
    builder = import_attr(app["import_path"])
    application = call_user_app_builder_with_args_if_necessary(builder, app["args"])
    built = build_serve_app(application, name=app["name"])
    schemas = [deployment_to_schema(d) for d in built.deployments]
    assert [s.model_dump(mode="json", exclude_unset=True) for s in schemas] == app["deployments"]
    assert {d["name"] for d in app["deployments"]} == {"FaserEngine", "OpenAIIngress"}


def test_worker_group_holds_the_most_replicas_serve_may_ask_for(rayservice, serve_config) -> None:
    (app,) = serve_config["applications"]
    engine = next(d for d in app["deployments"] if d["name"] == "FaserEngine")
    gpus = engine["ray_actor_options"]["num_gpus"]
    (group,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    per_pod = int(limits["nvidia.com/gpu"]) // gpus
    assert group["maxReplicas"] * per_pod >= engine["autoscaling_config"]["max_replicas"]
    assert group["minReplicas"] * per_pod >= engine["autoscaling_config"]["min_replicas"]


@pytest.mark.parametrize("index", [0, 1], ids=["head", "gpu-worker"])
def test_pod_templates_validate_with_kubernetes_validate(rayservice, index: int) -> None:
    template = pod_templates(rayservice)[index]
    pod_template = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": f"{rayservice['metadata']['name']}-{index}"},
        "template": template,
    }
    try:
        kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:  # the schema dump is too long to show
        pytest.fail(f"{exc.message} at {list(exc.path)}")


def test_kubernetes_validate_catches_a_bad_pod(rayservice) -> None:
    template = copy.deepcopy(pod_templates(rayservice)[1])
    template["spec"]["containers"][0]["gpus"] = 1
    pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({**pod_template, "template": template}, K8S_VERSION, True)


# kubernetes-validate has no schema for monitoring.coreos.com, so the PodMonitor is held to the
# fields of the Prometheus operator's v1 PodMonitor that it uses, strictly.
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_RELABEL = {
    "type": "object",
    "properties": {
        "action": {"enum": ["replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep"]},
        "sourceLabels": {"type": "array", "items": {"type": "string"}},
        "targetLabel": {"type": "string"},
    },
}
PODMONITOR_SCHEMA = strict(
    {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PodMonitor"},
            "metadata": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string"}, "labels": _LABELS},
            },
            "spec": {
                "type": "object",
                "required": ["selector", "podMetricsEndpoints"],
                "properties": {
                    "jobLabel": {"type": "string"},
                    "selector": {"type": "object", "properties": {"matchLabels": _LABELS}},
                    "podMetricsEndpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["port"],
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string"},
                                "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                                "relabelings": {"type": "array", "items": _RELABEL},
                            },
                        },
                    },
                },
            },
        },
    }
)


def test_podmonitor_is_well_formed(podmonitor) -> None:
    assert list(jsonschema.Draft7Validator(PODMONITOR_SCHEMA).iter_errors(podmonitor)) == []


def test_podmonitor_scrapes_every_ray_pod(podmonitor, rayservice) -> None:
    selector = podmonitor["spec"]["selector"]["matchLabels"]
    ports = {endpoint["port"] for endpoint in podmonitor["spec"]["podMetricsEndpoints"]}
    for template in pod_templates(rayservice):
        assert selector.items() <= template["metadata"]["labels"].items()
        (container,) = template["spec"]["containers"]
        assert ports <= {port["name"] for port in container["ports"]}
