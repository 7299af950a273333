"""The OpenAI-compatible FastAPI app, over any EngineClient (a Ray handle or a local engine).

Requests are parsed from the raw body in strict mode, so malformed JSON and wrongly-typed fields
are 400s in OpenAI's error shape. The engine's first event decides the status (a RequestError or
the start of the stream) before any byte of the body goes out; streaming answers are server-sent
events ending with `data: [DONE]` (the Responses API's with its `response.completed` event).
Leaving a stream early closes the engine stream, which aborts the request and frees its KV
blocks.

A request with n choices per prompt, or a batch of prompts, fans out into one engine request per
choice (prompt-major: choice i * n + j answers prompt i; with a seed, its choice j samples with
seed + j, as vLLM's n does); if any is refused, all are closed and the first refusal is the
answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from importlib import metadata
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from deployments.access import Access, install
from deployments.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    RefusedField,
    TokenizeRequest,
)
from deployments.responses import Formatter, failure
from deployments.responses_api import ResponseFormatter, ResponsesRequest
from deployments.serving import GenerateRequest, RequestError, StreamEvent, StreamStart

logger = logging.getLogger(__name__)
VERSION = metadata.version("faser-serve")


OPEN = Access()


class QueueFull(Exception):
    """The engine replicas' queues are full: answer 503 with Retry-After."""


class EngineClient(Protocol):
    async def warm_up(self) -> None: ...

    async def model_name(self) -> str: ...

    async def tokenize(self, request: GenerateRequest) -> dict | RequestError: ...

    async def detokenize(self, ids: list[int]) -> dict | RequestError: ...

    def stream(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]: ...


def _warming_up(client: EngineClient):
    """The app's lifespan: the client warms up in the background while the app serves (a
    request meanwhile waits for what it needs, as it would without the warm-up)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_warm_up(client))
        try:
            yield
        finally:
            task.cancel()

    return lifespan


async def _warm_up(client: EngineClient) -> None:
    try:
        await client.warm_up()
    except Exception:  # the first request that needs it asks again
        logger.warning("warming up the engine client failed", exc_info=True)


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def validation_error_response(exc: ValidationError) -> JSONResponse:
    first = exc.errors(include_url=False)[0]
    refused = first.get("ctx", {}).get("error")
    if isinstance(refused, RefusedField):
        return error_response(400, str(refused), "invalid_request_error", refused.param)
    param = ".".join(str(part) for part in first["loc"]) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return error_response(400, message, "invalid_request_error", param)


def build_openai_app(
    client: EngineClient, retry_after_s: int = 1, access: Access = OPEN
) -> FastAPI:
    app = FastAPI(title="FASER serve", docs_url=None, redoc_url=None,
                  lifespan=_warming_up(client))
    install(app, access)
    handler = _Handler(client, retry_after_s)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return ModelList(data=[ModelCard(id=await client.model_name())]).model_dump()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        if (missing := await handler.unknown_model(model)) is not None:
            return missing
        return JSONResponse(ModelCard(id=model).model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handler.handle(await request.body(), CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handler.handle(await request.body(), ChatCompletionRequest)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await handler.handle(await request.body(), ResponsesRequest)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await handler.tokens(await request.body(), TokenizeRequest)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await handler.tokens(await request.body(), DetokenizeRequest)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.exception_handler(HTTPException)
    async def no_such_route(request: Request, exc: HTTPException) -> JSONResponse:
        """An unknown path or method, in OpenAI's error shape as every other error."""
        response = error_response(exc.status_code, f"{request.method} {request.url.path}: "
                                  f"{exc.detail}", "invalid_request_error")
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, exc: QueueFull) -> JSONResponse:
        return handler.queue_full()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")  # the details (Ray's, the engine's) go to the logs
        return JSONResponse(ErrorResponse(error=failure(exc)).model_dump(), status_code=500)

    return app


class _Handler:
    def __init__(self, client: EngineClient, retry_after_s: int) -> None:
        self.client = client
        self.retry_after_s = retry_after_s

    async def handle(self, body: bytes, schema: type[BaseModel]) -> Response:
        try:
            request = schema.model_validate_json(body)
        except ValidationError as exc:
            return validation_error_response(exc)
        if (missing := await self.unknown_model(request.model)) is not None:
            return missing
        served = await self.client.model_name()
        streams = [self.client.stream(r) for r in to_generate_requests(request)]
        try:
            firsts = await _first_events(streams)
        except QueueFull:
            await _close(streams)
            return self.queue_full()
        except BaseException:
            await _close(streams)
            raise
        refused = next((e for e in firsts if isinstance(e, RequestError)), None)
        if refused is not None:
            await _close(streams)
            return error_response(
                refused.status, refused.message, refused.type, refused.param, refused.code
            )
        assert all(isinstance(e, StreamStart) for e in firsts)
        formatter = _formatter(request, served, firsts)
        events = _merge(streams)
        headers = {"x-faser-replica": firsts[0].replica}
        if request.stream:
            return StreamingResponse(
                formatter.sse(events), media_type="text/event-stream", headers=headers
            )
        try:
            body = await formatter.collect(events)
        finally:
            await events.aclose()
        return JSONResponse(body, headers=headers)

    async def tokens(self, body: bytes, schema: type[BaseModel]) -> JSONResponse:
        """/tokenize and /detokenize: answered by the client's renderer (the ingress's copy of the
        engines' tokenizer), not queued behind generation."""
        try:
            request = schema.model_validate_json(body)
        except ValidationError as exc:
            return validation_error_response(exc)
        if (missing := await self.unknown_model(request.model)) is not None:
            return missing
        if isinstance(request, DetokenizeRequest):
            result = await self.client.detokenize(request.tokens)
        elif request.messages is not None:
            chat = tuple({"role": m.role, "content": m.text()} for m in request.messages)
            result = await self.client.tokenize(GenerateRequest(
                "chat", messages=chat, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
            ))
        else:
            prompt = GenerateRequest("completion", prompt=request.prompt)
            result = await self.client.tokenize(prompt)
        if isinstance(result, RequestError):
            return error_response(result.status, result.message, result.type, result.param)
        return JSONResponse(result)

    async def unknown_model(self, model: str) -> JSONResponse | None:
        served = await self.client.model_name()
        if model == served:
            return None
        return error_response(
            404, f"the model `{model}` does not exist; this server serves `{served}`",
            "invalid_request_error", "model", "model_not_found",
        )

    def queue_full(self) -> JSONResponse:
        response = error_response(
            503, "the server is overloaded; retry later", "service_unavailable", code="queue_full"
        )
        response.headers["Retry-After"] = str(self.retry_after_s)
        return response


def _formatter(
    request: BaseModel, served: str, starts: list[StreamStart]
) -> Formatter | ResponseFormatter:
    if isinstance(request, ResponsesRequest):
        return ResponseFormatter(request, served, starts[0])
    return Formatter(request, served, starts)


async def _first_events(streams: list[AsyncIterator[StreamEvent]]) -> list[StreamEvent]:
    """Each stream's first event, awaited together (a choice's request waits on no other's)."""
    if len(streams) == 1:
        return [await anext(streams[0])]
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _close(streams: list[AsyncIterator[StreamEvent]]) -> None:
    """Closing an engine stream aborts its request (a finished one is left as it is)."""
    for stream in streams:
        await stream.aclose()


async def _merge(
    streams: list[AsyncIterator[StreamEvent]],
) -> AsyncIterator[tuple[int, StreamEvent]]:
    """The streams' events as they come, each with its stream's index; leaving early, or one
    stream failing, closes them all."""
    if len(streams) == 1:  # the common case, with no task in between
        try:
            async for event in streams[0]:
                yield 0, event
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[StreamEvent]) -> None:
        try:
            async for event in stream:
                queue.put_nowait((i, event))
            queue.put_nowait((i, None))
        except Exception as exc:  # handed to the consumer, which closes the others
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            i, event = await queue.get()
            if isinstance(event, Exception):
                raise event
            if event is None:
                running -= 1
            else:
                yield i, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close(streams)


def to_generate_request(request: BaseModel) -> GenerateRequest:
    """The engine request of the first choice (of the first prompt)."""
    speculation = None
    if request.speculation is not None:
        speculation = request.speculation.model_dump(exclude_none=True) or None
    slo = None
    if request.slo is not None:
        slo = request.slo.model_dump(exclude_none=True) or None
    common = dict(**request.sampling(), speculation=speculation, slo=slo)
    if isinstance(request, ResponsesRequest):
        return GenerateRequest("chat", messages=tuple(request.conversation()),
                               max_tokens=request.max_output_tokens,
                               logprobs=request.num_logprobs, **common)
    if isinstance(request, ChatCompletionRequest):
        return GenerateRequest(
            "chat", messages=tuple(request.conversation()), **request.chat_ending(),
            max_tokens=request.max_new_tokens, logprobs=request.num_logprobs, **common,
        )
    return GenerateRequest(
        "completion", prompt=request.prompts()[0], max_tokens=request.max_tokens,
        logprobs=request.logprobs, echo=bool(request.echo), **common,
    )


def to_generate_requests(request: BaseModel) -> list[GenerateRequest]:
    """One engine request per choice, prompt-major; choice j of a prompt samples with seed + j."""
    first = to_generate_request(request)
    if isinstance(request, ResponsesRequest):
        return [first]
    prompts = request.prompts() if isinstance(request, CompletionRequest) else [first.prompt]
    return [
        replace(first, prompt=prompt, seed=None if first.seed is None else first.seed + j)
        for prompt in prompts
        for j in range(request.n)
    ]
