"""A run's records binned over time: throughput by completion, latency percentiles by send."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from loadtest.records import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Series:
    t_s: np.ndarray  # [num_bins] bin starts, seconds after the run's first send
    output_tok_s: np.ndarray  # [num_bins] output tokens of requests completed in the bin
    ok_per_s: np.ndarray  # [num_bins]
    backpressure_per_s: np.ndarray  # [num_bins]
    errors_per_s: np.ndarray  # [num_bins]
    in_flight: np.ndarray  # [num_bins] mean requests in flight over the bin
    users: np.ndarray  # [num_bins] closed-loop users seen sending in the bin; nan when unknown
    ttft_ms: dict[int, np.ndarray]  # percentile -> [num_bins], nan where no sample
    tpot_ms: dict[int, np.ndarray]


def auto_bin_s(span_s: float) -> float:
    """About 60 bins over the run, at least one second each."""
    return max(1.0, math.ceil(span_s / 60.0))


def bin_records(records: list[RequestRecord], t0: float, bin_s: float | None = None) -> Series:
    if not records:
        raise ValueError("records: no requests to bin")
    span = max(r.start + r.latency_s for r in records) - t0
    width = bin_s or auto_bin_s(span)
    num_bins = max(1, math.ceil(span / width - 1e-9))
    sent = lambda r: min(int((r.start - t0) // width), num_bins - 1)
    done = lambda r: min(int((r.start + r.latency_s - t0) // width), num_bins - 1)
    by_status = {s: [r for r in records if r.status == s] for s in ("ok", "backpressure", "error")}
    rate = lambda rs, weights=None: _rate([done(r) for r in rs], weights, num_bins, width)
    return Series(
        t_s=np.arange(num_bins) * width,
        output_tok_s=rate(by_status["ok"], [r.output_tokens for r in by_status["ok"]]),
        ok_per_s=rate(by_status["ok"]),
        backpressure_per_s=rate(by_status["backpressure"]),
        errors_per_s=rate(by_status["error"]),
        in_flight=_in_flight(records, t0, num_bins, width),
        users=_users(records, sent, num_bins),
        ttft_ms=_percentiles(records, sent, num_bins, lambda r: r.ttft_s),
        tpot_ms=_percentiles(records, sent, num_bins, lambda r: r.tpot_s),
    )


def _rate(bins: list[int], weights: list[int] | None, num_bins: int, width: float) -> np.ndarray:
    counts = np.bincount(np.asarray(bins, dtype=np.int64), weights=weights, minlength=num_bins)
    return counts[:num_bins].astype(np.float64) / width


def _in_flight(records: list[RequestRecord], t0: float, num_bins: int, width: float) -> np.ndarray:
    """Each request adds its overlap with a bin, so a bin's sum over its width is the mean."""
    busy = np.zeros(num_bins)
    edges = np.arange(num_bins + 1) * width
    for r in records:
        start, end = r.start - t0, r.start - t0 + r.latency_s
        busy += np.clip(np.minimum(edges[1:], end) - np.maximum(edges[:-1], start), 0.0, None)
    return busy / width


def _users(records: list[RequestRecord], sent, num_bins: int) -> np.ndarray:
    users = np.full(num_bins, np.nan)
    for r in records:
        # A replay's users are an idle pool, not load; its load is the requests in flight.
        if r.users is not None and r.scheduled_s is None:
            b = sent(r)
            users[b] = r.users if np.isnan(users[b]) else max(users[b], r.users)
    return users


def _percentiles(records, sent, num_bins: int, value) -> dict[int, np.ndarray]:
    samples: list[list[float]] = [[] for _ in range(num_bins)]
    for r in records:
        if r.status == "ok" and value(r) is not None:
            samples[sent(r)].append(value(r) * 1000.0)
    return {
        q: np.array([np.percentile(s, q) if s else np.nan for s in samples]) for q in PERCENTILES
    }
