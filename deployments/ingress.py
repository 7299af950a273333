"""The HTTP ingress deployment and the two ways it reaches an engine: a Ray handle to the
engine deployment, or an engine in the same process (tests, single-process use)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from deployments.access import MAX_BODY_BYTES, Access
from deployments.api import QueueFull, build_openai_app
from deployments.router import CLUSTER_LOAD_KWARG
from deployments.serving import GenerateRequest, OpenAIServing, RequestError, StreamEvent


class RayEngineClient:
    """Streams from the engine deployment; the router fills in `cluster_load`."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle
        self._model_name: str | None = None

    async def model_name(self) -> str:
        if self._model_name is None:
            self._model_name = await self.handle.model_name.remote()
        return self._model_name

    async def tokenize(self, request: GenerateRequest) -> dict[str, Any] | RequestError:
        return await self.handle.tokenize.remote(request)

    async def detokenize(self, ids: list[int]) -> dict[str, Any] | RequestError:
        return await self.handle.detokenize.remote(ids)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        kwargs = {CLUSTER_LOAD_KWARG: None}
        responses = self.handle.options(stream=True).generate.remote(request, **kwargs)
        try:
            first = await anext(responses)
        except BackPressureError as exc:
            raise QueueFull(str(exc)) from exc
        finished = False
        try:
            yield first
            async for event in responses:
                yield event
            finished = True
        finally:
            if not finished:  # the client left: cancel the engine call, which aborts it
                with contextlib.suppress(Exception):
                    responses.cancel()


class LocalEngineClient:
    def __init__(self, serving: OpenAIServing, model_name: str) -> None:
        self.serving = serving
        self._model_name = model_name

    async def model_name(self) -> str:
        return self._model_name

    async def tokenize(self, request: GenerateRequest) -> dict[str, Any] | RequestError:
        return self.serving.tokenize(request)

    async def detokenize(self, ids: list[int]) -> dict[str, Any] | RequestError:
        return self.serving.detokenize(ids)

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
