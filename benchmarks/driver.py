"""Drives one engine through one run: closed loop (C requests in flight) or open loop (arrivals).

Both loops step the engine in this thread; between steps they add whatever is due. A run's
requests all carry one policy through the engine's per-request override, so one loaded engine
serves every policy under test.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks.workload import BenchRequest
from faser.engine.llm_engine import LLMEngine
from faser.outputs import RequestOutput
from faser.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RunSpec:
    """Where a run's requests go and how they speculate."""

    label: str  # unique per run: request ids are `<label>-<i>`
    spec: dict  # the engine's per-request speculation override: {"policy", "max_k"}
    ignore_eos: bool = False
    request_kwargs: dict | None = None  # extra add_request arguments (the SLO, where supported)
    temperature: float = 0.0  # 0: greedy; else sampled, request i with seed i when `seeded`
    seeded: bool = True


@dataclass(frozen=True, slots=True)
class RunResult:
    outputs: list[RequestOutput]  # in request order
    wall_s: float  # first add to last finish
    target_positions_computed: int
    draft_positions_computed: int


def run_closed(
    engine: LLMEngine,
    requests: Sequence[BenchRequest],
    concurrency: int,
    run: RunSpec,
    on_finish: Callable[[], None] = lambda: None,
) -> RunResult:
    """Keeps `concurrency` requests in flight, refilling as they finish, until all are done."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    pending = deque(enumerate(requests))
    in_flight = 0

    def admit(now: float) -> None:
        nonlocal in_flight
        while pending and in_flight < concurrency:
            i, request = pending.popleft()
            _add(engine, run, i, request)
            in_flight += 1

    def finished() -> None:
        nonlocal in_flight
        in_flight -= 1
        on_finish()

    return _drive(engine, len(requests), run, admit, finished, lambda: bool(pending), None)


def run_open(
    engine: LLMEngine,
    requests: Sequence[BenchRequest],
    run: RunSpec,
    on_finish: Callable[[], None] = lambda: None,
) -> RunResult:
    """Adds each request once its offset has passed, whatever is still in flight; idles (sleeps)
    only when nothing is in flight and the next arrival is still ahead."""
    pending = deque(sorted(enumerate(requests), key=lambda item: item[1].offset_s))
    start = time.perf_counter()

    def admit(now: float) -> None:
        while pending and start + pending[0][1].offset_s <= now:
            i, request = pending.popleft()
            _add(engine, run, i, request)

    def next_arrival() -> float | None:
        return start + pending[0][1].offset_s if pending else None

    return _drive(engine, len(requests), run, admit, on_finish, lambda: bool(pending),
                  next_arrival, start)


def _drive(
    engine: LLMEngine,
    num_requests: int,
    run: RunSpec,
    admit: Callable[[float], None],
    finished: Callable[[], None],
    has_pending: Callable[[], bool],
    next_arrival: Callable[[], float | None] | None,
    start: float | None = None,
) -> RunResult:
    positions = _positions(engine)
    start = time.perf_counter() if start is None else start
    done: dict[str, RequestOutput] = {}
    while has_pending() or engine.has_unfinished_requests():
        admit(time.perf_counter())
        if not engine.has_unfinished_requests():
            due = next_arrival() if next_arrival is not None else None
            if due is not None:
                time.sleep(max(0.0, due - time.perf_counter()))
            continue
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
                finished()
    end = time.perf_counter()
    outputs = [done[f"{run.label}-{i}"] for i in range(num_requests)]
    target, draft = _positions(engine)
    return RunResult(outputs, end - start, target - positions[0], draft - positions[1])


def _add(engine: LLMEngine, run: RunSpec, index: int, request: BenchRequest) -> None:
    sampled = run.temperature > 0
    params = SamplingParams(
        max_tokens=request.max_tokens, temperature=run.temperature, ignore_eos=run.ignore_eos,
        seed=index if sampled and run.seeded else None,
    )
    engine.add_request(
        f"{run.label}-{index}", list(request.prompt_token_ids), params, speculation=dict(run.spec),
        **(run.request_kwargs or {}),
    )


def _positions(engine: LLMEngine) -> tuple[int, int]:
    """Positions computed so far by the target and by the draft (0 without a draft)."""
    proposer = engine.speculator.proposer
    draft = proposer.runner.num_positions_computed if proposer is not None else 0
    return engine.target.num_positions_computed, draft
