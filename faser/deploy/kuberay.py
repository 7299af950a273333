"""Render the KubeRay manifests of k8s/ from the serving code, or check that they are current.

    python -m faser.deploy.kuberay render                  # rewrite k8s/ (the committed files)
    python -m faser.deploy.kuberay render --check          # exit 1 when k8s/ differs
    python -m faser.deploy.kuberay render --out my-k8s \\
        --models-claim my-models model=/models/target draft_model=/models/draft

Trailing `key=value` words are `deployments:build_app` arguments (AppArgs), laid over the GPU
defaults of serve_config.GPU_ARGS. Output is deterministic: sorted keys, no timestamps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from faser.deploy.manifests import ClusterSpec, kustomization, pod_monitor, rayservice
from faser.deploy.serve_config import gpu_args, serve_config

RAYSERVICE_FILE = "rayservice.yaml"
PODMONITOR_FILE = "podmonitor.yaml"
KUSTOMIZATION_FILE = "kustomization.yaml"
HEADER = (
    "# Rendered by `python -m faser.deploy.kuberay render` (faser/deploy/kuberay.py) from\n"
    "# deployments:build_app. Do not edit: change the arguments or the renderer and re-render.\n"
)


class _Dumper(yaml.SafeDumper):
    """Block style, no anchors, and multi-line strings (serveConfigV2) as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def dump_yaml(document: Any) -> str:
    return yaml.dump(document, Dumper=_Dumper, sort_keys=True, default_flow_style=False, width=1000)


def render(
    overrides: dict[str, Any] | None = None, cluster: ClusterSpec | None = None
) -> dict[str, str]:
    """File name -> text of every rendered manifest."""
    args = gpu_args(overrides)
    cluster = cluster or ClusterSpec()
    documents = {
        RAYSERVICE_FILE: rayservice(args, cluster, dump_yaml(serve_config(args))),
        PODMONITOR_FILE: pod_monitor(cluster),
        KUSTOMIZATION_FILE: kustomization([RAYSERVICE_FILE, PODMONITOR_FILE], cluster),
    }
    return {name: HEADER + dump_yaml(doc) for name, doc in documents.items()}


def stale_files(files: dict[str, str], out_dir: Path) -> list[str]:
    """Names of the rendered files that are missing from out_dir or differ there."""
    return sorted(
        name
        for name, text in files.items()
        if not (out_dir / name).is_file() or (out_dir / name).read_text() != text
    )


def write_files(files: dict[str, str], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out_dir / name).write_text(text)


def parse_overrides(words: list[str]) -> dict[str, str]:
    overrides = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise ValueError(f"arguments are key=value (AppArgs fields), got {word!r}")
        overrides[key] = value
    return overrides


def add_render_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ClusterSpec()
    parser.add_argument("--out", type=Path, default=Path("k8s"), help="directory to write")
    parser.add_argument("--check", action="store_true", help="exit 1 if --out is not current")
    parser.add_argument("--name", default=defaults.name, help="RayService name")
    parser.add_argument("--image-name", default=defaults.image_name)
    parser.add_argument("--image-tag", default=defaults.image_tag)
    parser.add_argument("--gpus-per-worker", type=int, default=defaults.gpus_per_worker)
    parser.add_argument("--worker-cpus", type=int, default=defaults.worker_cpus)
    parser.add_argument("--worker-memory", default=defaults.worker_memory)
    parser.add_argument("--models-claim", default=None, help="PVC mounted read-only at /models")
    parser.add_argument("app_args", nargs="*", metavar="key=value", help="AppArgs fields")


def run_render(ns: argparse.Namespace) -> int:
    cluster = ClusterSpec(
        name=ns.name,
        image_name=ns.image_name,
        image_tag=ns.image_tag,
        gpus_per_worker=ns.gpus_per_worker,
        worker_cpus=ns.worker_cpus,
        worker_memory=ns.worker_memory,
        models_claim=ns.models_claim,
    )
    files = render(parse_overrides(ns.app_args), cluster)
    if ns.check:
        stale = stale_files(files, ns.out)
        for name in stale:
            print(f"{ns.out / name} is not current: re-render it", file=sys.stderr)
        return 1 if stale else 0
    write_files(files, ns.out)
    for name in sorted(files):
        print(ns.out / name)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m faser.deploy.kuberay")
    commands = parser.add_subparsers(dest="command", required=True)
    add_render_arguments(commands.add_parser("render", help="render the KubeRay manifests"))
    ns = parser.parse_args(argv)
    try:
        return run_render(ns)
    except ValueError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
