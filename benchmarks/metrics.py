"""One run's requests summarised into one record: throughput, latency, TTFT, TPOT, speculation.

Times come from each RequestOutput's metrics (time.perf_counter): latency = finish - arrival,
TTFT = first token - arrival, TPOT = (finish - first token) / (output tokens - 1). Speculation
figures are pooled over the run's requests, so long requests weigh by their steps:
mean acceptance length = (accepted + steps) / steps, mean k = drafted tokens / decoding steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.driver import RunResult
from faser.outputs import RequestOutput
from faser.slo import Slo


@dataclass(frozen=True, slots=True)
class RequestTimes:
    latency_s: float
    ttft_s: float
    tpot_s: float  # 0 for a single-token output


def request_times(out: RequestOutput) -> RequestTimes:
    m = out.metrics
    arrival, first, finish = m["arrival_time"], m["first_token_time"], m["finish_time"]
    num_tokens = len(out.token_ids)
    tpot = (finish - first) / (num_tokens - 1) if num_tokens > 1 else 0.0
    return RequestTimes(finish - arrival, first - arrival, tpot)


def summarise(result: RunResult, slo: Slo | None) -> dict[str, float | int]:
    """The record's measured fields (the caller adds policy and load); with an SLO, the share of
    requests that met it."""
    outs = result.outputs
    times = [request_times(o) for o in outs]
    latencies = [t.latency_s for t in times]
    num_output = sum(len(o.token_ids) for o in outs)
    steps = sum(o.spec_stats.num_steps for o in outs)
    drafted = sum(o.spec_stats.num_draft_tokens for o in outs)
    accepted = sum(o.spec_stats.num_accepted_tokens for o in outs)
    record: dict[str, float | int] = {
        "num_requests": len(outs),
        "num_output_tokens": num_output,
        "wall_s": result.wall_s,
        "output_tokens_per_s": num_output / result.wall_s if result.wall_s > 0 else 0.0,
        "mean_latency_s": _mean(latencies),
        "p50_latency_s": percentile(latencies, 50),
        "p99_latency_s": percentile(latencies, 99),
        "mean_ttft_s": _mean([t.ttft_s for t in times]),
        "p99_ttft_s": percentile([t.ttft_s for t in times], 99),
        "mean_tpot_s": _mean([t.tpot_s for t in times if t.tpot_s > 0]),
        "mean_acceptance_length": (accepted + steps) / steps if steps else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_k": drafted / steps if steps else 0.0,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "num_pruned_positions": sum(o.spec_stats.num_pruned_positions for o in outs),
        "target_positions_computed": result.target_positions_computed,
        "draft_positions_computed": result.draft_positions_computed,
    }
    if slo is not None:
        record["slo_attainment"] = _mean([float(slo.met(t.ttft_s, t.tpot_s)) for t in times])
    return record


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
