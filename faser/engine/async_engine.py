"""The engine's step loop on a background thread, with one async token stream per request.

Only the loop thread ever touches the engine, from building it on: adds, aborts and the
cluster-load signal are queued as commands and applied between steps, so the engine needs no
lock and a request is validated (and rejected with ValueError) before its stream starts. A
stream that is closed or cancelled before its request finishes aborts the request, which frees
its KV blocks before the next step. A step that raises fails the requests it ran, not those
still waiting for a place; a request the model gave no finite output for (finish_reason
"error") fails alone.

A request's outputs reach its stream at most once per `stream_interval_s` (its first token and
its end at once), and less often while so many streams are open that together they would be
handed more than `stream_deltas_per_s` outputs a second: each hand-off costs every hop to the
client (a Ray message, an SSE chunk) CPU that, on a small CPU host, the step's own threads wait
for, and that cost grows with the streams, not with the step. The stream merges what was held.

The engine is built, prepared and stepped on that one thread because OpenMP's runtime (libgomp)
gives every thread that runs a parallel region its own worker pool, and once a process holds
more pool threads than cores it stops spinning between regions: every region then puts its
workers to sleep and wakes them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from faser.engine.detokenizer import REPLACEMENT_CHAR
from faser.outputs import RequestOutput, SpecStats, TokenLogprob
from faser.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MODEL_OUTPUT_NOT_FINITE = "the model's output for this request was not finite (NaN or infinite)"


class ModelOutputNotFinite(RuntimeError):
    """A request's stream ends with this when the model gave it a NaN or an infinity (finish
    reason "error"): its own failure, which sending the request again repeats, unlike a step or
    a replica that failed under it."""


@dataclass(frozen=True, slots=True)
class TextLogprob:
    """A token's log-probability as a client sees it: the token as text (the ingress holds no
    tokenizer), and the likeliest tokens at its position."""

    token: str
    logprob: float | None  # None: a prompt's first token, which nothing predicts
    top: tuple[tuple[str, float], ...] = ()

    @classmethod
    def of(
        cls, token_id: int, logprob: TokenLogprob | None, text: Callable[[int], str]
    ) -> TextLogprob:
        if logprob is None:
            return cls(text(token_id), None)
        top = tuple((text(t), lp) for t, lp in logprob.top)
        return cls(text(token_id), logprob.logprob, top)


@dataclass(slots=True)
class StreamDelta:
    """What one step added to one request, as a client sees it."""

    request_id: str
    text: str  # new text since the previous delta
    token_ids: list[int]  # tokens committed in this step
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool
    finish_reason: str | None
    spec_stats: SpecStats = field(default_factory=SpecStats)
    mode: str | None = None  # the engine's mode when the request finished
    logprobs: list[TextLogprob] | None = None  # token_ids' own, when the request asked for them
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache


class TextDeltas:
    """Turns the engine's full decoded text into deltas that never need to be taken back.

    Held back: a trailing replacement character (an incomplete UTF-8 sequence that the next
    token may complete) and a suffix that could be the start of a stop string (the engine trims
    a matched stop string from the text, so it must never reach the client)."""

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self.stop = stop
        self.sent = ""

    def delta(self, text: str, finished: bool) -> str:
        ready = text if finished else text[: len(text) - self._held_back(text)]
        if not ready.startswith(self.sent) or len(ready) <= len(self.sent):
            return ""
        new, self.sent = ready[len(self.sent) :], ready
        return new

    def _held_back(self, text: str) -> int:
        held = len(text) - len(text.rstrip(REPLACEMENT_CHAR))
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    held = max(held, n)
                    break
        return held


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException]
    held: list[RequestOutput] = field(default_factory=list)  # the step loop's, until due
    due: float = 0.0  # time.monotonic() from which the next hand-off may go


class AsyncLLMEngine:
    """Builds the engine with `build()` on a daemon thread and runs `engine.step()` there while
    requests wait on asyncio queues; the constructor returns once the engine is built (and
    raises what `build` raised)."""

    def __init__(
        self,
        build: Callable[[], Any],
        idle_wait_s: float = 0.05,
        stream_interval_s: float = 0.0,
        stream_deltas_per_s: float = 0.0,  # 0: no cap
    ) -> None:
        self.idle_wait_s = idle_wait_s
        self.stream_interval_s = stream_interval_s
        self.stream_deltas_per_s = stream_deltas_per_s
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._stopped = threading.Event()
        built: Future = Future()
        self._thread = threading.Thread(
            target=self._run, args=(build, built), name="faser-step-loop", daemon=True
        )
        self._thread.start()
        built.result()

    # ---- public, called from any event loop ------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        speculation: dict | None = None,
        slo: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Adds the request (ValueError on bad input, raised before the first output) and yields
        its outputs until it finishes. Leaving the loop early aborts the request."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        await self._call(lambda: self._add(request_id, prompt, params, speculation, slo, stream))
        finished = False
        try:
            while not finished:
                item, failure = _merged(await stream.outputs.get(), stream.outputs)
                if item is not None:
                    finished = item.finished
                    yield item
                if failure is not None:
                    raise failure
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self._abort(request_id))

    def set_cluster_load(self, load: float) -> None:
        self._submit(lambda: self.engine.set_cluster_load(load))

    def load_stats(self) -> dict[str, Any]:
        """The engine's load figures as of the latest step (no lock: a dict swap is atomic)."""
        return self._stats

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def shutdown(self) -> None:
        self._stopped.set()
        self._wakeup.set()
        self._thread.join(timeout=5.0)

    # ---- loop thread -------------------------------------------------------------------------

    async def _call(self, fn: Callable[[], Any]) -> Any:
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, never kills the loop
                future.set_exception(exc)

        self._submit(run)
        return await asyncio.wrap_future(future)

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _add(self, request_id, prompt, params, speculation, slo, stream: _Stream) -> None:
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already running")
        self.engine.add_request(request_id, prompt, params, speculation=speculation, slo=slo)
        self._streams[request_id] = stream

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)

    def _run(self, build: Callable[[], Any], built: Future) -> None:
        try:
            self.engine = build()
            self._stats: dict[str, Any] = dict(self.engine.load_stats())
        except BaseException as exc:
            built.set_exception(exc)
            return
        built.set_result(None)
        while not self._stopped.is_set():
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                self._stats = dict(self.engine.load_stats())
                self._wakeup.wait(self.idle_wait_s)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                logger.exception("engine step failed; failing the requests it ran")
                self._fail(exc)
                continue
            self._stats = dict(self.engine.load_stats())
            self._dispatch(outputs)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:
                logger.exception("engine command failed")

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now, interval = time.monotonic(), self._interval()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted while the step ran
                continue
            if output.finish_reason == "error":  # its tokens so far, then the failure
                if output.new_token_ids:  # those its last step committed before the NaN
                    stream.held.append(replace(output, finished=False, finish_reason=None))
                stream.held.append(ModelOutputNotFinite(MODEL_OUTPUT_NOT_FINITE))
            else:
                stream.held.append(output)
            if output.finished:
                del self._streams[output.request_id]
                _deliver(stream, stream.held)
        # every stream hands over what it holds once due, a preempted request's stream too
        for stream in self._streams.values():
            if stream.held and now >= stream.due:
                _deliver(stream, stream.held)
                stream.held = []
                stream.due = now + interval

    def _interval(self) -> float:
        """A stream's pause between hand-offs, the open streams sharing the hand-off budget."""
        if self.stream_deltas_per_s <= 0:
            return self.stream_interval_s
        return max(self.stream_interval_s, len(self._streams) / self.stream_deltas_per_s)

    def _fail(self, exc: Exception) -> None:
        """Fails every request but those still waiting for a place, which go on and meet the
        fault in their own step if it was not one request's: the step ran the others (or
        finished one before it raised, whose end was never sent). With every request waiting
        (the step failed before any ran), all fail, so that a fault on every step cannot loop.
        A stream gets the tokens it held back (committed by earlier steps) before the failure."""
        waiting = set(self.engine.waiting_request_ids())
        failed = [r for r in self._streams if r not in waiting] or list(self._streams)
        for request_id in failed:
            with contextlib.suppress(Exception):
                self.engine.abort_request(request_id)
            stream = self._streams.pop(request_id)
            _deliver(stream, [*stream.held, RuntimeError(f"engine step failed: {exc}")])


def _merged(
    item: RequestOutput | BaseException, waiting: asyncio.Queue[RequestOutput | BaseException]
) -> tuple[RequestOutput | None, BaseException | None]:
    """The newest of the outputs a slow consumer let queue up, with the tokens of all of them
    as its new ones: one delta instead of one per step (as vLLM's output collector does), so a
    stream costs less the more loaded its server is; and the failure queued after them, if one
    was, which is raised only once the tokens before it are handed over."""
    merged: RequestOutput | None = None
    new_token_ids: list[int] = []
    while True:
        if isinstance(item, BaseException):
            return _with_tokens(merged, new_token_ids), item
        merged = item
        new_token_ids += item.new_token_ids
        if item.finished or waiting.empty():
            return _with_tokens(merged, new_token_ids), None
        item = waiting.get_nowait()


def _with_tokens(output: RequestOutput | None, new_token_ids: list[int]) -> RequestOutput | None:
    if output is None or len(new_token_ids) == len(output.new_token_ids):
        return output
    return replace(output, new_token_ids=new_token_ids)


def _deliver(stream: _Stream, items: list[RequestOutput] | list[BaseException]) -> None:
    # a caller whose event loop has closed has gone away; its request is aborted by then
    with contextlib.suppress(RuntimeError):
        stream.loop.call_soon_threadsafe(_put_all, stream.outputs, items)


def _put_all(queue: asyncio.Queue, items: list) -> None:
    for item in items:
        queue.put_nowait(item)


def to_delta(
    output: RequestOutput, deltas: TextDeltas, token_text: Callable[[int], str] = str
) -> StreamDelta:
    logprobs = None
    if output.logprobs is not None:
        new = output.logprobs[len(output.logprobs) - len(output.new_token_ids) :]
        logprobs = [TextLogprob.of(lp.token_id, lp, token_text) for lp in new]
    return StreamDelta(
        request_id=output.request_id,
        text=deltas.delta(output.text or "", output.finished),
        token_ids=list(output.new_token_ids),
        num_prompt_tokens=len(output.prompt_token_ids),
        num_output_tokens=len(output.token_ids),
        finished=output.finished,
        finish_reason=output.finish_reason,
        spec_stats=output.spec_stats,
        logprobs=logprobs,
        num_cached_tokens=output.num_cached_tokens,
    )
