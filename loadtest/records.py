"""Per-request records, one JSON line each, so reports can compute percentiles over time."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Literal

Status = Literal["ok", "backpressure", "error"]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    start: float  # wall-clock epoch seconds at send
    latency_s: float
    ttft_s: float | None
    tpot_s: float | None
    output_tokens: int
    prompt_tokens: int | None
    status: Status  # "backpressure": a 503 the server sent on purpose (queue full)
    http_status: int
    error: str | None = None
    retry_after: str | None = None
    users: int | None = None  # Locust users running at send time
    scheduled_s: float | None = None  # trace replay: the arrival's replay offset
    lateness_s: float | None = None  # trace replay: how late it went out (no free pool user)


class RecordWriter:
    """Appends records to a JSON-lines file, flushed per line so a killed run keeps its data."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self._handle: IO[str] | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives for the run

    def write(self, record: RequestRecord) -> None:
        if self._handle is not None:
            self._handle.write(json.dumps(asdict(record)) + "\n")
            self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def read_records(path: str | os.PathLike[str]) -> list[RequestRecord]:
    """Records from a JSON-lines file; a torn last line (a killed run) is skipped."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(RequestRecord(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue
    return records
