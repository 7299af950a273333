"""The decision trace: one JSON line per step, so every choice of mode, k and frontier size can be
checked against what happened (predicted against realised acceptance and step time)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import IO


class DecisionTrace:
    """Appends to `path`; a no-op when `path` is None."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self._file: IO[str] | None = None
        self._lock = threading.Lock()  # the async engine and metrics may record from two threads

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def record(
        self, step: int, mode: str, ks: list[int], frontier_size: int | None = None, *,
        predicted_accepted: list[float] | None = None, realised_accepted: list[int] | None = None,
        predicted_time_s: float | None = None, measured_time_s: float | None = None,
        **extra: object,
    ) -> None:
        """One step: its mode, k per request and frontier size (None: one), the predicted accepted
        tokens and step time beside the realised ones, and any `extra` fields."""
        if self.path is None:
            return
        line = {
            "time": time.time(), "step": step, "mode": mode, "k": list(ks),
            "frontier_size": frontier_size, "predicted_accepted": predicted_accepted,
            "realised_accepted": realised_accepted, "predicted_time_s": predicted_time_s,
            "measured_time_s": measured_time_s, **extra,
        }
        text = json.dumps(line, default=str)
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", encoding="utf-8")
            self._file.write(text + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_trace(path: str | Path) -> list[dict]:
    """The records of a trace file, in order."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
