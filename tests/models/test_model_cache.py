"""build_once: one builder per entry across concurrent callers; no reader sees a partial one."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from faser.models.model_cache import build_once, cache_root


def _slow_build(calls: list[str]) -> Callable[[Path], None]:
    def build(tmp: Path) -> None:
        calls.append(tmp.name)
        (tmp / "part-1").write_text("a")
        time.sleep(0.2)  # long enough for the other callers to arrive while this one builds
        (tmp / "part-2").write_text("b")

    return build


def test_concurrent_callers_build_once_and_all_see_the_complete_entry(tmp_path: Path) -> None:
    entry, calls, results = tmp_path / "models" / "m", [], []
    build = _slow_build(calls)
    # flock conflicts between separate open() calls, so threads exercise the same exclusion that
    # separate processes (Ray replicas) get.
    threads = [
        threading.Thread(target=lambda: results.append(build_once(entry, build))) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(calls) == 1
    assert results == [entry] * 4
    assert sorted(p.name for p in entry.iterdir()) == ["part-1", "part-2"]


def test_failed_build_leaves_no_entry_and_a_later_build_succeeds(tmp_path: Path) -> None:
    entry = tmp_path / "m"

    def failing(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space"):
        build_once(entry, failing)
    assert not entry.exists()
    assert not list(tmp_path.glob(".tmp-*"))

    assert build_once(entry, lambda tmp: (tmp / "ok").write_text("y")) == entry
    assert (entry / "ok").read_text() == "y"


def test_stale_builds_of_killed_processes_are_swept(tmp_path: Path) -> None:
    stale = tmp_path / ".tmp-m-999-deadbeef"
    stale.mkdir()
    build_once(tmp_path / "m", lambda tmp: None)
    assert not stale.exists()


def test_cache_root_follows_faser_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FASER_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("FASER_CACHE")
    assert cache_root() == Path.home() / ".cache" / "faser"
