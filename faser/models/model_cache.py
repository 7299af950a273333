"""The on-disk cache of prepared models, safe for several processes at once.

Ray Serve starts several replicas that may all ask for the same model on a fresh machine. Each
entry is built once: builders serialise on a lock file, build into a private temporary directory
and publish it with an atomic rename, so a reader sees either no entry or a complete one.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

CACHE_ENV = "FASER_CACHE"


def cache_root() -> Path:
    """$FASER_CACHE, else ~/.cache/faser."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "faser"


@contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock held for the duration of the block (released on process death
    too, so a crashed builder never wedges the others)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(entry: Path, build: Callable[[Path], None]) -> Path:
    """Return `entry`, calling `build(tmp_dir)` to create it first if it does not exist yet.

    `build` fills an empty directory; only when it returns is that directory renamed to `entry`.
    """
    if entry.is_dir():
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(entry.parent / f".{entry.name}.lock"):
        if entry.is_dir():  # another process built it while we waited
            return entry
        _remove_stale_builds(entry)
        tmp_dir = entry.parent / f".tmp-{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp_dir.mkdir()
        try:
            build(tmp_dir)
            os.rename(tmp_dir, entry)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return entry


def _remove_stale_builds(entry: Path) -> None:
    # Holding the lock means nobody else is building this entry: leftovers are from killed builders.
    for stale in entry.parent.glob(f".tmp-{entry.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
