"""The OpenAI-compatible FastAPI app, over any EngineClient (a Ray handle or a local engine).

Requests are parsed from the raw body in strict mode, so malformed JSON and wrongly-typed fields
are 400s in OpenAI's error shape. The engine's first event decides the status (a RequestError or
the start of the stream) before any byte of the body goes out; streaming answers are server-sent
events ending with `data: [DONE]`. Leaving a stream early closes the engine stream, which aborts
the request and frees its KV blocks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from importlib import metadata
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from deployments.access import Access, install
from deployments.openai_schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    RefusedField,
    SpeculationReport,
    TokenizeRequest,
    Usage,
)
from deployments.serving import GenerateRequest, RequestError, StreamEvent, StreamStart
from faser.engine.async_engine import StreamDelta

logger = logging.getLogger(__name__)
VERSION = metadata.version("faser-serve")
# what a client is told when the engine fails under its request: a stable type and code, no
# internals (those go to the logs)
ENGINE_FAILED = ErrorInfo(
    message="the server failed while serving this request; it was not completed, retry it",
    type="internal_error", code="engine_failed",
)


OPEN = Access()


class QueueFull(Exception):
    """The engine replicas' queues are full: answer 503 with Retry-After."""


class EngineClient(Protocol):
    async def model_name(self) -> str: ...

    async def tokenize(self, request: GenerateRequest) -> dict | RequestError: ...

    async def detokenize(self, ids: list[int]) -> dict | RequestError: ...

    def stream(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]: ...


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
    app = FastAPI(title="FASER serve", docs_url=None, redoc_url=None)
    install(app, access)
    handler = _Handler(client, retry_after_s)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return ModelList(data=[ModelCard(id=await client.model_name())]).model_dump()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handler.handle(await request.body(), CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handler.handle(await request.body(), ChatCompletionRequest)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await handler.tokens(await request.body(), TokenizeRequest)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await handler.tokens(await request.body(), DetokenizeRequest)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")  # the details (Ray's, the engine's) go to the logs
        return JSONResponse(ErrorResponse(error=ENGINE_FAILED).model_dump(), status_code=500)

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
        if (missing := await self._unknown_model(request.model)) is not None:
            return missing
        served = await self.client.model_name()
        events = self.client.stream(to_generate_request(request))
        try:
            first = await anext(events)
        except QueueFull:
            return self._queue_full()
        if isinstance(first, RequestError):
            return error_response(first.status, first.message, first.type, first.param, first.code)
        assert isinstance(first, StreamStart)
        formatter = _Formatter(request, served, first)
        if request.stream:
            headers = {"x-faser-replica": first.replica}
            return StreamingResponse(
                formatter.sse(events), media_type="text/event-stream", headers=headers
            )
        try:
            body = await formatter.collect(events)
        finally:
            await events.aclose()
        return JSONResponse(body, headers={"x-faser-replica": first.replica})

    async def tokens(self, body: bytes, schema: type[BaseModel]) -> JSONResponse:
        """/tokenize and /detokenize: answered by an engine replica, which holds the tokenizer."""
        try:
            request = schema.model_validate_json(body)
        except ValidationError as exc:
            return validation_error_response(exc)
        if (missing := await self._unknown_model(request.model)) is not None:
            return missing
        if isinstance(request, DetokenizeRequest):
            result = await self.client.detokenize(request.tokens)
        elif request.messages is not None:
            chat = tuple({"role": m.role, "content": m.text()} for m in request.messages)
            result = await self.client.tokenize(GenerateRequest("chat", messages=chat))
        else:
            prompt = GenerateRequest("completion", prompt=request.prompt)
            result = await self.client.tokenize(prompt)
        if isinstance(result, RequestError):
            return error_response(result.status, result.message, result.type, result.param)
        return JSONResponse(result)

    async def _unknown_model(self, model: str) -> JSONResponse | None:
        served = await self.client.model_name()
        if model == served:
            return None
        return error_response(
            404, f"the model `{model}` does not exist; this server serves `{served}`",
            "invalid_request_error", "model", "model_not_found",
        )

    def _queue_full(self) -> JSONResponse:
        response = error_response(
            503, "the server is overloaded; retry later", "service_unavailable", code="queue_full"
        )
        response.headers["Retry-After"] = str(self.retry_after_s)
        return response


def to_generate_request(request: BaseModel) -> GenerateRequest:
    speculation = None
    if request.speculation is not None:
        speculation = request.speculation.model_dump(exclude_none=True) or None
    slo = None
    if request.slo is not None:
        slo = request.slo.model_dump(exclude_none=True) or None
    common = dict(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=max(request.top_k, 0),
        seed=request.seed,
        stop=request.stop_strings(),
        ignore_eos=request.ignore_eos,
        speculation=speculation,
        slo=slo,
    )
    if isinstance(request, ChatCompletionRequest):
        return GenerateRequest(
            "chat",
            messages=tuple(request.conversation()),
            max_tokens=request.max_new_tokens,
            **common,
        )
    return GenerateRequest(
        "completion", prompt=request.prompt_input(), max_tokens=request.max_tokens, **common
    )


def speculation_report(delta: StreamDelta, policy: str | None) -> SpeculationReport:
    spec = delta.spec_stats
    return SpeculationReport(
        policy=policy,
        mode=delta.mode,
        drafted=spec.num_draft_tokens,
        accepted=spec.num_accepted_tokens,
        mean_acceptance_length=spec.mean_acceptance_length,
        slo_met=spec.slo_met,
    )


class _Formatter:
    """Shapes one request's deltas into OpenAI's completion or chat objects."""

    def __init__(self, request: BaseModel, model: str, start: StreamStart) -> None:
        self.request = request
        self.chat = isinstance(request, ChatCompletionRequest)
        self.model = model
        self.start = start
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + start.request_id
        spec = request.speculation
        self.policy = spec.policy if spec is not None and spec.policy else start.policy

    def usage(self, last: StreamDelta) -> Usage:
        prompt = self.start.num_prompt_tokens
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=last.num_output_tokens,
            total_tokens=prompt + last.num_output_tokens,
        )

    async def collect(self, events: AsyncIterator[StreamEvent]) -> dict:
        parts: list[str] = []
        last = None
        async for event in events:
            assert isinstance(event, StreamDelta)
            parts.append(event.text)
            last = event
        assert last is not None and last.finished
        text = "".join(parts)
        usage = self.usage(last)
        report = speculation_report(last, self.policy)
        if self.chat:
            message = ChatMessageOut(content=text)
            choice = ChatChoice(message=message, finish_reason=last.finish_reason)
            return ChatCompletionResponse(
                id=self.id, model=self.model, choices=[choice], usage=usage, speculation=report
            ).model_dump()
        choice = CompletionChoice(text=text, finish_reason=last.finish_reason)
        return CompletionResponse(
            id=self.id, model=self.model, choices=[choice], usage=usage, speculation=report
        ).model_dump()

    async def sse(self, events: AsyncIterator[StreamEvent]) -> AsyncIterator[str]:
        try:
            if self.chat:
                yield _sse(self._chat_chunk(ChatDelta(role="assistant", content="")))
            last = None
            async for event in events:
                assert isinstance(event, StreamDelta)
                last = event
                if event.text or event.finished:
                    yield _sse(self._chunk(event))
            if last is not None and self.request.include_usage:
                yield _sse(self._usage_chunk(last))
        except Exception:  # mid-stream failure: the status line has gone already
            logger.exception("stream failed")
            yield _sse(ErrorResponse(error=ENGINE_FAILED).model_dump())
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    def _chunk(self, delta: StreamDelta) -> dict:
        report = speculation_report(delta, self.policy) if delta.finished else None
        if self.chat:
            content = ChatDelta(content=delta.text or None)
            return self._chat_chunk(content, delta.finish_reason, report)
        choice = CompletionChoice(text=delta.text, finish_reason=delta.finish_reason)
        return CompletionResponse(
            id=self.id, model=self.model, choices=[choice], speculation=report
        ).model_dump()

    def _chat_chunk(
        self,
        delta: ChatDelta,
        finish_reason: str | None = None,
        report: SpeculationReport | None = None,
    ) -> dict:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        chunk = ChatCompletionChunk(
            id=self.id, model=self.model, choices=[choice], speculation=report
        )
        return chunk.model_dump()

    def _usage_chunk(self, last: StreamDelta) -> dict:
        report = speculation_report(last, self.policy)
        if self.chat:
            chunk = ChatCompletionChunk(
                id=self.id, model=self.model, choices=[], usage=self.usage(last), speculation=report
            )
            return chunk.model_dump()
        return CompletionResponse(
            id=self.id, model=self.model, choices=[], usage=self.usage(last), speculation=report
        ).model_dump()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
