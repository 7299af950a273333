"""The HTTP ingress deployment and the two ways it reaches an engine: a Ray handle to the
engine deployment, or an engine in the same process (tests, single-process use).

Nothing is lost when an engine replica dies. When the replica serving a request dies (its process
killed, its node gone: the stream raises Ray's ActorDiedError, or ActorUnavailableError while the
replica cannot be reached), the ingress sends the request again with the tokens the client already
has (`GenerateRequest.resume_token_ids`). Serve routes it to another replica, or holds it until
the one it restarts is up, and that replica continues after those tokens
(deployments/continuation.py). The client sees a pause, not an error, in a stream and in a
non-streamed answer alike, under the same id, with usage counted over the whole answer.

- Greedy requests (temperature 0, or below 1e-5, or top_k 1) continue exactly as they would
  have, and so do sampled requests with a seed: each of their tokens is a race keyed by the seed
  and its position alone (faser/layers/race.py), which the continuation runs again.
- Sampled requests without a seed continue from the tokens sent: the rest is drawn from the
  model's distribution given them, the very distribution an undisturbed run draws it from.
- Requests with a presence or frequency penalty are not continued once tokens were sent: those
  penalties count the answer's tokens, and a continuation takes the sent ones for prompt. They
  fail with the error below. Before any token is sent, every request is simply sent again.

A request survives MAX_DEATHS deaths of its replica. After each, the continuation is sent at once
(Serve has usually dropped the dead replica from its routing by then) and, while no replica has
room for it (every queue full, or the one replica restarting), again after the waits of BACKOFF_S,
for at most RESUME_WAIT_S. A request that cannot be continued ends as any engine failure does
(deployments/api.py): an error event in the stream (a 500 if nothing was sent yet) of type
`internal_error`, code `engine_failed` and a short message; Ray's own text goes to the ingress's
log only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from deployments.access import MAX_BODY_BYTES, Access
from deployments.api import QueueFull, build_openai_app
from deployments.router import CLUSTER_LOAD_KWARG
from deployments.serving import (
    GenerateRequest,
    OpenAIServing,
    Renderer,
    RequestError,
    StreamEvent,
    StreamStart,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

# the replica died (ActorDiedError), cannot be reached (ActorUnavailableError), or had gone when
# the router picked it: the request may go on elsewhere
REPLICA_LOST = (RayActorError, ReplicaUnavailableError)
MAX_DEATHS = 3  # replica deaths one request survives
BACKOFF_S = (0.0, 0.25, 0.5, 1.0, 2.0)  # before each try of a continuation; then the last again
RESUME_WAIT_S = 60.0  # a restarted replica loads its models before it takes requests


class ReplicaLost(RuntimeError):
    """The replica serving a request died and the request could not be continued; the message is
    for the logs (the client gets responses.ENGINE_FAILED)."""


class _Progress:
    """What the client has been sent of one request: its start and the tokens of its deltas."""

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.start: StreamStart | None = None
        self.sent_ids: list[int] = []
        self.num_output_tokens = 0
        self.finished = False

    def next_request(self) -> GenerateRequest:
        if not self.sent_ids:
            return self.request
        return replace(self.request, resume_token_ids=tuple(self.sent_ids))

    def admit(self, event: StreamEvent) -> StreamEvent | None:
        """The event as the client sees it; None for a resumed call's own start."""
        if isinstance(event, StreamStart):
            if self.start is not None:
                return None
            self.start = event
            return event
        if isinstance(event, RequestError):
            if self.start is None:  # the request itself is refused: the client's answer
                return event
            raise ReplicaLost(f"the continuation was refused: {event.message}")
        self.sent_ids += event.token_ids
        self.num_output_tokens = event.num_output_tokens
        self.finished = event.finished
        event.request_id = self.start.request_id  # the continuation's own id stays inside
        return event

    def why_not_resumable(self) -> str | None:
        if not self.sent_ids:
            return None
        if len(self.sent_ids) != self.num_output_tokens:
            return "the tokens received do not add up to the count sent"
        request = self.request
        if request.presence_penalty or request.frequency_penalty:
            return "presence and frequency penalties count only the continuation's own output"
        return None


class _Resumption:
    """When a request whose replica died is sent again, and when it is given up."""

    def __init__(self) -> None:
        self.num_deaths = 0
        self.num_tries = 0
        self.deadline = 0.0

    def wait_s(self) -> float | None:
        """How long the next call may wait for its first event; no bound before any death."""
        return max(0.0, self.deadline - time.monotonic()) if self.num_deaths else None

    def died(self) -> None:
        self.num_deaths += 1
        self.num_tries = 0
        self.deadline = time.monotonic() + RESUME_WAIT_S

    def why_given_up(self) -> str | None:
        if self.num_deaths > MAX_DEATHS:
            return f"the request lost its replica {self.num_deaths} times"
        return None

    async def backoff(self) -> None:
        delay = BACKOFF_S[min(self.num_tries, len(BACKOFF_S) - 1)]
        self.num_tries += 1
        if time.monotonic() + delay > self.deadline:
            raise ReplicaLost(f"no replica took the continuation in {RESUME_WAIT_S} s")
        await asyncio.sleep(delay)


class RayEngineClient:
    """Streams from the engine deployment; the router fills in `cluster_load`. A request whose
    replica dies is continued on another (see the module's docstring)."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle
        self._model_name: str | None = None
        self._renderer: Renderer | None = None
        self._asking = asyncio.Lock()

    async def warm_up(self) -> None:
        """Learns the model's name and the renderer as the ingress starts, so that even the
        first /tokenize never waits in the engines' queues behind generation."""
        await self.model_name()
        await self._renderer_copy()

    async def model_name(self) -> str:
        """Asked of the engines once: a burst of first requests waits for that one answer, where
        each asking would take a place in the engines' queues and push the burst past them."""
        if self._model_name is None:
            async with self._asking:
                if self._model_name is None:
                    self._model_name = await _unary(self.handle.model_name.remote())
        return self._model_name

    async def tokenize(self, request: GenerateRequest) -> dict[str, Any] | RequestError:
        return (await self._renderer_copy()).tokenize(request)

    async def detokenize(self, ids: list[int]) -> dict[str, Any] | RequestError:
        return (await self._renderer_copy()).detokenize(ids)

    async def _renderer_copy(self) -> Renderer:
        """The engines' renderer, fetched once, as the model's name is: from then on /tokenize
        and /detokenize are answered here, and never wait in the engines' queues behind
        generation (seconds under load, or a 503 once the queues are full)."""
        if self._renderer is None:
            async with self._asking:
                if self._renderer is None:
                    self._renderer = await _unary(self.handle.renderer.remote())
        return self._renderer

    async def stream(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        progress = _Progress(request)
        resumption = _Resumption()
        while True:
            try:
                async for event in self._call(progress.next_request(), resumption.wait_s()):
                    if (event := progress.admit(event)) is not None:
                        yield event
                return
            except BackPressureError as exc:
                if progress.start is None:  # nothing sent yet: the client can be told to wait
                    raise QueueFull(str(exc)) from exc
                # a continuation finds every queue full: it waits for room, as it would for a
                # restarting replica
            except REPLICA_LOST as exc:
                if progress.finished:
                    return
                resumption.died()
                _check_resumable(progress, resumption, exc)
            except TimeoutError as exc:
                raise ReplicaLost(f"no replica took the continuation in {RESUME_WAIT_S} s") from exc
            await resumption.backoff()

    async def _call(
        self, request: GenerateRequest, wait_s: float | None
    ) -> AsyncIterator[StreamEvent]:
        """One call to an engine replica; `wait_s` bounds the wait for its first event. Leaving
        early cancels the call, which aborts the engine's request."""
        kwargs = {CLUSTER_LOAD_KWARG: None}
        responses = self.handle.options(stream=True).generate.remote(request, **kwargs)
        finished = False
        try:
            async with asyncio.timeout(wait_s):
                first = await anext(responses)
            yield first
            async for event in responses:
                yield event
            finished = True
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    responses.cancel()


async def _unary(response: Awaitable[T]) -> T:
    """A one-answer call to the engines; full queues are the client's 503, not Ray's text."""
    try:
        return await response
    except BackPressureError as exc:
        raise QueueFull(str(exc)) from exc


def _check_resumable(progress: _Progress, resumption: _Resumption, exc: Exception) -> None:
    """Logs the loss (Ray's text stays here) and raises ReplicaLost if the request cannot go on."""
    reason = resumption.why_given_up() or progress.why_not_resumable()
    logger.warning(
        "engine replica lost under a request after %d tokens (its death %d), %s: %s",
        len(progress.sent_ids), resumption.num_deaths,
        f"not resumed ({reason})" if reason else "resuming it", exc,
    )
    if reason is not None:
        raise ReplicaLost(reason) from exc


class LocalEngineClient:
    def __init__(self, serving: OpenAIServing, model_name: str) -> None:
        self.serving = serving
        self._model_name = model_name

    async def warm_up(self) -> None:
        """Nothing to learn: the engine is in this process."""

    async def model_name(self) -> str:
        return self._model_name

    async def tokenize(self, request: GenerateRequest) -> dict[str, Any] | RequestError:
        return self.serving.renderer.tokenize(request)

    async def detokenize(self, ids: list[int]) -> dict[str, Any] | RequestError:
        return self.serving.renderer.detokenize(ids)

    def stream(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        return self.serving.stream(request)


@serve.ingress()
class OpenAIIngress:
    def __init__(
        self,
        engine: DeploymentHandle,
        retry_after_s: int = 1,
        api_keys: list[str] | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.client = RayEngineClient(engine)
        self.retry_after_s = retry_after_s
        # read here, in the replica: FASER_API_KEYS is the replica's environment
        self.access = Access.from_settings(api_keys, max_body_bytes)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_openai_app(self.client, self.retry_after_s, self.access)
