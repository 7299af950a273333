"""Engine metrics of one replica, recorded through Ray's metrics API beside Ray Serve's own.

Names follow vLLM's (`spec_decode_num_drafts`, `..._num_accepted_tokens_per_pos{position}`,
`time_to_first_token_seconds`, ...) under the prefix `faser_`. Ray exports a metric `m` as
`ray_m` on every node's metrics port (`ray_m_total` for counters, `ray_m_bucket/_sum/_count` for
histograms), and Ray Serve's wrappers label each with `deployment`, `replica` and
`application`. Mean acceptance length is derived in PromQL as in vLLM:
`1 + rate(accepted) / rate(drafts)`.

Engine-wide counts (drafts, accepted, pruned, per position, per k) are read from the engine's
totals by a poller every `period_s` and added as deltas, so the step loop never calls Ray; the
load gauges come from the same poll. Request latencies are measured on the replica by a
`RequestClock` fed with the stream's events: from the request's arrival at the replica to its
first token (TTFT), between later tokens (TPOT) and to its end (end-to-end).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

from deployments.serving import StreamStart
from faser.config import MODES
from faser.engine.async_engine import StreamDelta
from faser.outputs import SpecStats

logger = logging.getLogger(__name__)

RAY_PREFIX = "ray_"  # Ray's Prometheus namespace for application metrics
MAX_K = 16  # AppArgs.max_k's bound: one k bucket per value
POLL_PERIOD_S = 1.0
# the gauge's value: the controller's levels in rising load (overlap 0, prune 1, off 2)
MODE_VALUES = {mode: float(i) for i, mode in enumerate(MODES)}

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # as recorded: faser_...
    kind: Kind
    description: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()  # histograms only

    @property
    def series(self) -> str:
        """The name Prometheus sees (a histogram's base; its series add _bucket/_sum/_count)."""
        suffix = "_total" if self.kind == "counter" else ""
        return f"{RAY_PREFIX}{self.name}{suffix}"

    @property
    def exported(self) -> tuple[str, ...]:
        if self.kind == "histogram":
            return tuple(f"{self.series}_{part}" for part in ("bucket", "sum", "count"))
        return (self.series,)


def _counter(name: str, description: str, *tag_keys: str) -> MetricSpec:
    return MetricSpec(name, "counter", description, tag_keys)


def _gauge(name: str, description: str) -> MetricSpec:
    return MetricSpec(name, "gauge", description)


def _histogram(name: str, description: str, boundaries: tuple[float, ...]) -> MetricSpec:
    return MetricSpec(name, "histogram", description, boundaries=boundaries)


NUM_DRAFTS = _counter("faser_spec_decode_num_drafts", "Request-steps that proposed k > 0 drafts.")
NUM_DRAFT_TOKENS = _counter("faser_spec_decode_num_draft_tokens", "Draft tokens proposed.")
NUM_ACCEPTED_TOKENS = _counter("faser_spec_decode_num_accepted_tokens", "Draft tokens accepted.")
NUM_ACCEPTED_PER_POS = _counter(
    "faser_spec_decode_num_accepted_tokens_per_pos",
    "Drafts whose token at this position (0-based) was accepted.",
    "position",
)
NUM_PRUNED = _counter(
    "faser_spec_decode_num_pruned_positions",
    "Target positions never computed thanks to early pruning.",
)
# mean k = draft tokens / request-steps: exact, where the k histogram's _sum (as Ray exports it)
# counted a k = 0 step at its bucket's middle, 0.25
NUM_REQUEST_STEPS = _counter(
    "faser_spec_decode_num_request_steps",
    "Decoding request-steps, one per request per step, speculating or not.",
)
NUM_SLO_REQUESTS = _counter("faser_slo_requests", "Finished requests that carried an SLO.")
NUM_SLO_MET = _counter("faser_slo_met", "Finished requests that met their TTFT and TPOT targets.")
GENERATION_TOKENS = _counter("faser_generation_tokens", "Output tokens streamed.")
PROMPT_TOKENS = _counter("faser_prompt_tokens", "Prompt tokens of requests started.")
PREFIX_CACHE_HITS = _counter(
    "faser_prefix_cache_hits", "Prompt tokens of finished requests read from the prefix cache.")
MODE = _gauge("faser_spec_mode", "Controller mode: 0 overlap, 1 prune, 2 off.")
NUM_RUNNING = _gauge("faser_num_requests_running", "Requests in the engine's running batch.")
NUM_WAITING = _gauge("faser_num_requests_waiting", "Requests waiting for the engine.")
KV_USAGE = _gauge("faser_kv_cache_usage", "Fraction of KV-cache blocks in use (0 to 1).")
ALPHA = _gauge("faser_spec_alpha", "Mean estimated acceptance probability of running requests.")
K = _histogram(
    "faser_spec_k", "Draft tokens proposed per request-step (0: plain decoding).",
    tuple(k + 0.5 for k in range(MAX_K + 1)),
)
TTFT = _histogram(
    "faser_time_to_first_token_seconds", "Arrival at the replica to the first output token.",
    (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
     40.0, 80.0, 160.0),
)
TPOT = _histogram(
    "faser_time_per_output_token_seconds", "Mean time between output tokens after the first.",
    (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
     2.5, 5.0, 10.0),
)
E2E = _histogram(
    "faser_e2e_request_latency_seconds", "Arrival at the replica to the last output token.",
    (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
     120.0, 240.0, 480.0),
)

CATALOGUE: tuple[MetricSpec, ...] = (
    NUM_DRAFTS, NUM_DRAFT_TOKENS, NUM_ACCEPTED_TOKENS, NUM_ACCEPTED_PER_POS, NUM_PRUNED,
    NUM_REQUEST_STEPS, NUM_SLO_REQUESTS, NUM_SLO_MET, GENERATION_TOKENS, PROMPT_TOKENS,
    PREFIX_CACHE_HITS, MODE,
    NUM_RUNNING, NUM_WAITING, KV_USAGE, ALPHA,
    K, TTFT, TPOT, E2E,
)
# engine totals (SpecStats fields) that feed a counter of the same meaning
_TOTALS: tuple[tuple[MetricSpec, str], ...] = (
    (NUM_DRAFTS, "num_drafts"),
    (NUM_DRAFT_TOKENS, "num_draft_tokens"),
    (NUM_ACCEPTED_TOKENS, "num_accepted_tokens"),
    (NUM_PRUNED, "num_pruned_positions"),
    (NUM_REQUEST_STEPS, "num_steps"),
    (NUM_SLO_REQUESTS, "num_slo_requests"),
    (NUM_SLO_MET, "num_slo_met"),
)


def exported_names() -> set[str]:
    """Every series name the replicas export."""
    return {name for spec in CATALOGUE for name in spec.exported}


@dataclass(frozen=True, slots=True)
class EngineCounts:
    """A copy of the engine's speculation totals, taken from another thread."""

    totals: dict[str, int]
    accepted_per_pos: tuple[int, ...]
    steps_per_k: tuple[int, ...]

    @classmethod
    def of(cls, stats: SpecStats | None) -> EngineCounts:
        if stats is None:
            return cls({spec.name: 0 for spec, _ in _TOTALS}, (), ())
        totals = {spec.name: int(getattr(stats, field)) for spec, field in _TOTALS}
        # list() copies under the GIL while the step loop may grow the list
        return cls(
            totals, tuple(list(stats.num_accepted_tokens_per_pos)),
            tuple(list(stats.num_steps_per_k)),
        )


def _minus(now: tuple[int, ...], before: tuple[int, ...]) -> list[int]:
    return [n - (before[i] if i < len(before) else 0) for i, n in enumerate(now)]


class ReplicaMetrics:
    """Records one replica's engine metrics; `close()` stops the poller."""

    def __init__(self, engine: Any, period_s: float = POLL_PERIOD_S) -> None:
        from ray.serve import metrics  # Ray's metrics API, with Serve's replica labels

        self.engine = engine  # an AsyncLLMEngine: .engine.stats and load_stats()
        self._metrics = {spec.name: _make(metrics, spec) for spec in CATALOGUE}
        self._last = EngineCounts.of(None)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._poll_loop, args=(period_s,), name="faser-metrics", daemon=True
        )
        self._thread.start()

    def request(self) -> RequestClock:
        return RequestClock(self)

    def poll(self) -> None:
        """Adds the engine's new counts since the last poll and sets the load gauges."""
        with self._lock:
            now = EngineCounts.of(getattr(self.engine.engine, "stats", None))
            self._add_counts(now, self._last)
            self._last = now
        self._set_gauges(self.engine.load_stats())

    def close(self) -> None:
        self._stop.set()

    def inc(self, spec: MetricSpec, value: float, tags: dict[str, str] | None = None) -> None:
        if value > 0:
            self._metrics[spec.name].inc(value, tags=tags)

    def observe(self, spec: MetricSpec, value: float) -> None:
        self._metrics[spec.name].observe(value)

    def _poll_loop(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                self.poll()
            except Exception:  # a metrics hiccup must never take the replica down
                logger.exception("metrics poll failed")

    def _add_counts(self, now: EngineCounts, before: EngineCounts) -> None:
        for spec, _ in _TOTALS:
            self.inc(spec, now.totals[spec.name] - before.totals[spec.name])
        for position, n in enumerate(_minus(now.accepted_per_pos, before.accepted_per_pos)):
            self.inc(NUM_ACCEPTED_PER_POS, n, {"position": str(position)})
        for k, n in enumerate(_minus(now.steps_per_k, before.steps_per_k)):
            for _ in range(n):  # one observation per request-step, as if observed live
                self.observe(K, k)

    def _set_gauges(self, stats: dict[str, Any]) -> None:
        self._metrics[MODE.name].set(MODE_VALUES.get(str(stats.get("mode")), -1.0))
        self._metrics[NUM_RUNNING.name].set(float(stats.get("num_running", 0)))
        self._metrics[NUM_WAITING.name].set(float(stats.get("num_waiting", 0)))
        self._metrics[KV_USAGE.name].set(float(stats.get("kv_usage", 0.0)))
        self._metrics[ALPHA.name].set(float(stats.get("alpha", 0.0)))


class RequestClock:
    """Times one request from the events its stream yields on the replica."""

    def __init__(self, metrics: ReplicaMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.first_token: float | None = None

    def observe(self, event: Any) -> None:
        if isinstance(event, StreamStart):
            self.metrics.inc(PROMPT_TOKENS, event.num_prompt_tokens)
        if not isinstance(event, StreamDelta):
            return
        now = time.perf_counter()
        if event.token_ids:
            self.metrics.inc(GENERATION_TOKENS, len(event.token_ids))
            if self.first_token is None:
                self.first_token = now
                self.metrics.observe(TTFT, now - self.arrival)
        if event.finished:
            self.metrics.inc(PREFIX_CACHE_HITS, event.num_cached_tokens)
        if event.finished and self.first_token is not None:
            self.metrics.observe(E2E, now - self.arrival)
            if event.num_output_tokens > 1:
                tpot = (now - self.first_token) / (event.num_output_tokens - 1)
                self.metrics.observe(TPOT, tpot)


def _make(metrics: Any, spec: MetricSpec) -> Any:
    if spec.kind == "counter":
        return metrics.Counter(spec.name, description=spec.description, tag_keys=spec.tag_keys)
    if spec.kind == "gauge":
        return metrics.Gauge(spec.name, description=spec.description)
    return metrics.Histogram(
        spec.name, description=spec.description, boundaries=list(spec.boundaries)
    )
