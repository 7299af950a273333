"""What every user of one Locust process shares: settings, prompts, the replay queue, records."""

from __future__ import annotations

from dataclasses import dataclass, field

from loadtest.prompts import Prompt, load_prompts
from loadtest.records import RecordWriter
from loadtest.schedule import ArrivalSchedule
from loadtest.settings import LoadSettings
from loadtest.trace import TraceWindow, read_trace, to_arrivals, to_requests, trace_path


@dataclass
class RunState:
    settings: LoadSettings
    prompts: list[Prompt]
    writer: RecordWriter
    schedule: ArrivalSchedule | None = None  # trace replay only
    model: str | None = field(default=None)  # resolved once from /v1/models unless given


def trace_window(settings: LoadSettings) -> TraceWindow:
    return TraceWindow(
        time_scale=settings.time_scale,
        start_s=settings.trace_start_s,
        span_s=settings.trace_span_s,
        max_requests=settings.max_requests,
        max_prompt_tokens=settings.max_prompt_tokens,
        max_output_tokens=settings.max_output_tokens,
    )


def build_schedule(settings: LoadSettings, prompts: list[Prompt]) -> ArrivalSchedule:
    arrivals = to_arrivals(read_trace(trace_path(settings.trace)), trace_window(settings))
    return ArrivalSchedule(to_requests(arrivals, prompts))


def build_run_state(settings: LoadSettings) -> RunState:
    prompts = load_prompts(settings.prompts_path)
    schedule = build_schedule(settings, prompts) if settings.shape == "trace" else None
    writer = RecordWriter(settings.records_path)
    return RunState(settings, prompts, writer, schedule, settings.model)
