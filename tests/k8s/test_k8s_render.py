"""The committed manifests are exactly what the renderer makes of the serving code."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from faser.deploy.kuberay import main, stale_files


def test_committed_files_equal_the_rendered_ones(rendered: dict[str, str], k8s_dir: Path) -> None:
    stale = stale_files(rendered, k8s_dir)
    assert not stale, (
        f"{stale} differ from the rendering: run `python -m faser.deploy.kuberay render`"
    )


def test_rendering_is_deterministic(rendered: dict[str, str]) -> None:
    from faser.deploy.kuberay import render

    assert render() == rendered


def test_every_manifest_parses(k8s_dir: Path) -> None:
    files = sorted(k8s_dir.glob("*.yaml"))
    assert {f.name for f in files} >= {"rayservice.yaml", "podmonitor.yaml", "kustomization.yaml"}
    for path in files:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert documents, f"{path.name} is empty"
        for document in documents:
            assert {"apiVersion", "kind"} <= set(document), path.name


def test_check_flags_an_edited_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "k8s"
    assert main(["render", "--out", str(out)]) == 0
    assert main(["render", "--out", str(out), "--check"]) == 0
    path = out / "rayservice.yaml"
    path.write_text(path.read_text().replace("maxReplicas: 4", "maxReplicas: 5"))
    assert main(["render", "--out", str(out), "--check"]) == 1
    assert "rayservice.yaml is not current" in capsys.readouterr().err


def test_own_model_pair_from_a_claim(tmp_path: Path) -> None:
    words = ["--models-claim", "my-models", "model=/models/target", "draft_model=/models/draft"]
    assert main(["render", "--out", str(tmp_path), *words]) == 0
    service = yaml.safe_load((tmp_path / "rayservice.yaml").read_text())
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert (args["model"], args["draft_model"]) == ("/models/target", "/models/draft")
    worker = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in worker["containers"][0][
        "volumeMounts"
    ]
    claims = [
        v["persistentVolumeClaim"]["claimName"] for v in worker["volumes"] if v["name"] == "models"
    ]
    assert claims == ["my-models"]


def test_bad_argument_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["render", "--check", "max_replicas=zero"])
    assert exc.value.code == 2
    assert "max_replicas" in capsys.readouterr().err
