"""Locust users that stream OpenAI completions and time them.

Locust entries a run produces:
- `POST /v1/chat/completions` (or `/v1/completions`): one per answered request, response time is
  the whole stream, "size" is the output token count;
- `POST /v1/... [503 backpressure]`: the server refused on purpose (queue full); not a failure;
- `METRIC ttft` and `METRIC tpot`: time to first token and time per output token, in ms.
Anything else (other HTTP errors, broken streams, error events) is a failure.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from dataclasses import replace

import gevent
import requests
from locust import HttpUser, task

from loadtest.body import request_body
from loadtest.records import RequestRecord
from loadtest.run_state import RunState
from loadtest.schedule import Slot
from loadtest.settings import API_KEY_ENV
from loadtest.sse import StreamResult, StreamTimer

CONNECT_TIMEOUT_S = 10.0
_USER_IDS = itertools.count()  # seeds each closed-loop user's prompt choice reproducibly


class OpenAIStreamUser(HttpUser):
    abstract = True
    state: RunState  # set by the locustfile on the concrete class

    def __init__(self, environment) -> None:
        super().__init__(environment)
        if key := os.environ.get(API_KEY_ENV):
            self.client.headers["Authorization"] = f"Bearer {key}"

    def send(self, prompt: str, max_tokens: int, slot: Slot | None = None) -> RequestRecord:
        """Stream one completion, report it to Locust and to the records file."""
        model = self._model()
        settings = self.state.settings
        path = settings.path
        lateness = self.state.schedule.lateness_s(slot) if slot and self.state.schedule else None
        start, t0 = time.time(), time.perf_counter()
        timer = StreamTimer()
        body = request_body(settings, model or "", prompt, max_tokens)
        timeout = (CONNECT_TIMEOUT_S, settings.timeout_s)
        with self.client.post(
            path, json=body, stream=True, catch_response=True, name=path, timeout=timeout
        ) as response:
            read_error = _read_stream(response, timer, t0) if response.status_code == 200 else None
            result = timer.result(time.perf_counter() - t0)
            record = _record(response, result, read_error, start, self._users())
            _report(response, record, path)
        if record.status == "ok":
            self._fire_metrics(result)
        if slot is not None:
            record = _with_slot(record, slot, lateness)
        self.state.writer.write(record)
        return record

    def _model(self) -> str | None:
        if self.state.model is None:
            self.state.model = _first_model(self)
        return self.state.model

    def _users(self) -> int | None:
        runner = self.environment.runner
        return runner.user_count if runner is not None else None

    def _fire_metrics(self, result: StreamResult) -> None:
        for name, value in (("ttft", result.ttft_s), ("tpot", result.tpot_s)):
            if value is not None:
                self.environment.events.request.fire(
                    request_type="METRIC", name=name, response_time=value * 1000.0,
                    response_length=0, exception=None, context={},
                )


class ClosedLoopUser(OpenAIStreamUser):
    """Send, wait for the whole answer, think, repeat: the step, spike and diurnal shapes."""

    abstract = True
    error_pause_s = 0.5  # after a failure, so a down server is not hammered in a tight loop

    def wait_time(self) -> float:
        pause = self.error_pause_s if self._last_failed else 0.0
        return max(self.state.settings.think_s, pause)

    def on_start(self) -> None:
        self._rng = random.Random(f"{self.state.settings.seed}-{next(_USER_IDS)}")
        self._last_failed = False

    @task
    def completion(self) -> None:
        prompt = self._rng.choice(self.state.prompts)
        record = self.send(prompt.text, self.state.settings.max_tokens)
        self._last_failed = record.status == "error"


class TraceReplayUser(OpenAIStreamUser):
    """Take the next trace arrival, sleep until it is due, send it: open-loop replay."""

    abstract = True
    idle_s = 0.2  # once the queue is empty, until the shape ends the run

    def wait_time(self) -> float:
        return 0.0

    @task
    def replay(self) -> None:
        schedule = self.state.schedule
        slot = schedule.take() if schedule is not None else None
        if slot is None:
            gevent.sleep(self.idle_s)
            return
        try:
            gevent.sleep(schedule.wait_s(slot))
            self.send(slot.request.prompt, slot.request.max_tokens, slot)
        finally:
            schedule.finish()


def _first_model(user: HttpUser) -> str | None:
    """The first model the server lists; None (and a Locust failure) when it cannot say."""
    with user.client.get("/v1/models", name="/v1/models", catch_response=True) as response:
        try:
            models = response.json().get("data") or []
            return str(models[0]["id"])
        except (ValueError, KeyError, IndexError, AttributeError, TypeError):
            response.failure(f"no model listed by /v1/models (HTTP {response.status_code})")
            return None


def _read_stream(response: requests.Response, timer: StreamTimer, t0: float) -> str | None:
    """Feed each line to the timer as it arrives; the transport error, if any."""
    try:
        for line in response.iter_lines(chunk_size=None):
            timer.feed(line, time.perf_counter() - t0)
    except requests.RequestException as error:
        return f"stream broke: {type(error).__name__}: {error}"
    return None


def _record(
    response: requests.Response, result: StreamResult, read_error: str | None, start: float,
    users: int | None,
) -> RequestRecord:
    status_code = int(response.status_code or 0)
    retry_after = response.headers.get("Retry-After") if status_code else None
    if status_code == 503:
        status, error = "backpressure", None
    elif status_code != 200:
        status, error = "error", f"HTTP {status_code}: {_error_text(response)}"
    else:
        error = read_error or result.error
        status = "ok" if error is None else "error"
    ok = status == "ok"
    return RequestRecord(
        start=start, latency_s=result.latency_s, ttft_s=result.ttft_s if ok else None,
        tpot_s=result.tpot_s if ok else None, output_tokens=result.output_tokens,
        prompt_tokens=result.prompt_tokens, status=status, http_status=status_code, error=error,
        retry_after=retry_after, users=users,
    )


def _error_text(response: requests.Response) -> str:
    if getattr(response, "error", None) is not None:
        return str(response.error)[:300]
    try:
        return response.text[:300]
    except (requests.RequestException, RuntimeError):
        return "(unreadable body)"


def _report(response, record: RequestRecord, path: str) -> None:
    """Tell Locust: the whole stream's time and token count, backpressure under its own name."""
    response.request_meta["response_time"] = record.latency_s * 1000.0
    response.request_meta["response_length"] = record.output_tokens
    if record.status == "backpressure":
        response.request_meta["name"] = f"{path} [503 backpressure]"
        response.success()
    elif record.status == "error":
        response.failure(record.error)
    else:
        response.success()


def _with_slot(record: RequestRecord, slot: Slot, lateness: float | None) -> RequestRecord:
    return replace(record, scheduled_s=slot.request.offset_s, lateness_s=lateness)
