"""OpenAI's response objects from one request's engine events: its choices, their logprobs in
the chat and the legacy completions shapes, usage and the speculation report, as one JSON body
or as server-sent events."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import BaseModel

from deployments.openai_schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    SpeculationReport,
    TopLogprob,
    Usage,
)
from deployments.serving import StreamEvent, StreamStart
from faser.engine.async_engine import ModelOutputNotFinite, StreamDelta, TextLogprob
from faser.outputs import SpecStats

logger = logging.getLogger(__name__)
MIN_LOGPROB = -9999.0  # what -inf becomes (JSON has no infinity), as vLLM and OpenAI send it
# what a client is told when the engine fails under its request: a stable type and code, no
# internals (those go to the logs)
ENGINE_FAILED = ErrorInfo(
    message="the server failed while serving this request; it was not completed, retry it",
    type="internal_error", code="engine_failed",
)
# the model's own failure on this request: sending it again fails again
MODEL_OUTPUT_NOT_FINITE = ErrorInfo(
    message="the model's output for this request was not finite (NaN or infinite); it was not "
    "completed, and sending it again gives the same result",
    type="internal_error", code="model_output_not_finite",
)


def failure(exc: BaseException) -> ErrorInfo:
    """What a client is told of an exception under its request (a Ray task error is also an
    instance of the exception it carries)."""
    return MODEL_OUTPUT_NOT_FINITE if isinstance(exc, ModelOutputNotFinite) else ENGINE_FAILED


def speculation_report(
    delta: StreamDelta, policy: str | None, stats: SpecStats | None = None
) -> SpeculationReport:
    """`stats`: several choices' figures summed (default: the delta's own request's)."""
    spec = stats if stats is not None else delta.spec_stats
    return SpeculationReport(
        policy=policy,
        mode=delta.mode,
        drafted=spec.num_draft_tokens,
        accepted=spec.num_accepted_tokens,
        mean_acceptance_length=spec.mean_acceptance_length,
        slo_met=spec.slo_met,
    )


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def completion_logprobs(entries: list[TextLogprob], offset: int) -> CompletionLogprobs:
    """The legacy shape; `offset`: the text offset of the first entry's token. Each position's
    top_logprobs holds the chosen token and the likeliest alternatives, as OpenAI's does."""
    out = CompletionLogprobs()
    for entry in entries:
        out.tokens.append(entry.token)
        out.text_offset.append(offset)
        offset += len(entry.token)
        if entry.logprob is None:  # the prompt's first token
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_clamp(entry.logprob))
        top = {entry.token: _clamp(entry.logprob)}
        top.update((token, _clamp(lp)) for token, lp in entry.top)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(entries: list[TextLogprob]) -> ChatLogprobs:
    def one(token: str, logprob: float) -> TopLogprob:
        return TopLogprob(token=token, logprob=_clamp(logprob), bytes=list(token.encode()))

    return ChatLogprobs(content=[
        ChatTokenLogprob(**one(e.token, e.logprob).model_dump(),
                         top_logprobs=[one(t, lp) for t, lp in e.top])
        for e in entries
    ])


@dataclass(slots=True)
class _Choice:
    """One choice's answer so far."""

    index: int
    start: StreamStart
    parts: list[str] = field(default_factory=list)
    logprobs: list[TextLogprob] = field(default_factory=list)
    last: StreamDelta | None = None
    offset: int = 0  # the text offset of its next token (completions' logprobs)


class Formatter:
    """Shapes the choices' deltas into OpenAI's completion or chat objects."""

    def __init__(self, request: BaseModel, model: str, starts: list[StreamStart]) -> None:
        self.request = request
        self.chat = isinstance(request, ChatCompletionRequest)
        self.model = model
        self.choices = [_Choice(i, start) for i, start in enumerate(starts)]
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + starts[0].request_id
        spec = request.speculation
        self.policy = spec.policy if spec is not None and spec.policy else starts[0].policy
        self.logprobs = bool(request.logprobs) if self.chat else request.logprobs is not None
        self.echo = not self.chat and bool(request.echo)

    def usage(self) -> Usage:
        # each prompt counts once, however many choices answer it
        prompt = sum(c.start.num_prompt_tokens for c in self.choices[:: self.request.n])
        completion = sum(c.last.num_output_tokens for c in self.choices if c.last is not None)
        cached = sum(min(c.last.num_cached_tokens, c.start.num_prompt_tokens)
                     for c in self.choices[:: self.request.n] if c.last is not None)
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def report(self) -> SpeculationReport:
        lasts = [c.last for c in self.choices if c.last is not None]
        if not lasts:
            return SpeculationReport(policy=self.policy)
        stats = SpecStats.total([d.spec_stats for d in lasts]) if len(lasts) > 1 else None
        return speculation_report(lasts[-1], self.policy, stats)

    async def collect(self, events: AsyncIterator[tuple[int, StreamEvent]]) -> dict:
        async for i, event in events:
            assert isinstance(event, StreamDelta)
            choice = self.choices[i]
            choice.parts.append(event.text)
            choice.logprobs += event.logprobs or []
            choice.last = event
        assert all(c.last is not None and c.last.finished for c in self.choices)
        usage, report = self.usage(), self.report()
        if self.chat:
            return ChatCompletionResponse(
                id=self.id, model=self.model, choices=[self._chat_choice(c) for c in self.choices],
                usage=usage, speculation=report,
            ).model_dump()
        return CompletionResponse(
            id=self.id, model=self.model, choices=[self._text_choice(c) for c in self.choices],
            usage=usage, speculation=report,
        ).model_dump()

    def _chat_choice(self, choice: _Choice) -> ChatChoice:
        return ChatChoice(
            index=choice.index, message=ChatMessageOut(content="".join(choice.parts)),
            finish_reason=choice.last.finish_reason,
            logprobs=chat_logprobs(choice.logprobs) if self.logprobs else None,
        )

    def _text_choice(self, choice: _Choice) -> CompletionChoice:
        prompt, entries = "", choice.logprobs
        if self.echo:
            prompt = choice.start.prompt_text or ""
            entries = [*(choice.start.prompt_logprobs or ()), *choice.logprobs]
        return CompletionChoice(
            index=choice.index, text=prompt + "".join(choice.parts),
            finish_reason=choice.last.finish_reason,
            logprobs=completion_logprobs(entries, 0) if self.logprobs else None,
        )

    async def sse(self, events: AsyncIterator[tuple[int, StreamEvent]]) -> AsyncIterator[str]:
        try:
            for choice in self.choices:
                if self.chat:
                    yield _sse(self._chat_chunk(choice, ChatDelta(role="assistant", content="")))
                elif self.echo:
                    yield _sse(self._echo_chunk(choice))
            async for i, event in events:
                assert isinstance(event, StreamDelta)
                choice = self.choices[i]
                choice.last = event
                if event.text or event.finished or (self.logprobs and event.logprobs):
                    yield _sse(self._chunk(choice, event))
            if self.request.include_usage:
                yield _sse(self._usage_chunk())
        except Exception as exc:  # mid-stream failure: the status line has gone already
            logger.exception("stream failed")
            yield _sse(ErrorResponse(error=failure(exc)).model_dump())
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    def _chunk(self, choice: _Choice, delta: StreamDelta) -> dict:
        report = speculation_report(delta, self.policy) if delta.finished else None
        entries = delta.logprobs or []
        if self.chat:
            content = ChatDelta(content=delta.text or None)
            logprobs = chat_logprobs(entries) if self.logprobs else None
            return self._chat_chunk(choice, content, delta.finish_reason, report, logprobs)
        return self._text_chunk(choice, delta.text, delta.finish_reason, report, entries)

    def _echo_chunk(self, choice: _Choice) -> dict:
        return self._text_chunk(choice, choice.start.prompt_text or "", None, None,
                                list(choice.start.prompt_logprobs or ()))

    def _text_chunk(self, choice: _Choice, text: str, finish_reason: str | None,
                    report: SpeculationReport | None, entries: list[TextLogprob]) -> dict:
        logprobs = None
        if self.logprobs:
            logprobs = completion_logprobs(entries, choice.offset)
            choice.offset += sum(len(e.token) for e in entries)
        choice_out = CompletionChoice(
            index=choice.index, text=text, finish_reason=finish_reason, logprobs=logprobs
        )
        return CompletionResponse(
            id=self.id, model=self.model, choices=[choice_out], speculation=report
        ).model_dump()

    def _chat_chunk(
        self,
        choice: _Choice,
        delta: ChatDelta,
        finish_reason: str | None = None,
        report: SpeculationReport | None = None,
        logprobs: ChatLogprobs | None = None,
    ) -> dict:
        choice_out = ChatChunkChoice(
            index=choice.index, delta=delta, finish_reason=finish_reason, logprobs=logprobs
        )
        chunk = ChatCompletionChunk(
            id=self.id, model=self.model, choices=[choice_out], speculation=report
        )
        return chunk.model_dump()

    def _usage_chunk(self) -> dict:
        usage, report = self.usage(), self.report()
        if self.chat:
            return ChatCompletionChunk(
                id=self.id, model=self.model, choices=[], usage=usage, speculation=report
            ).model_dump()
        return CompletionResponse(
            id=self.id, model=self.model, choices=[], usage=usage, speculation=report
        ).model_dump()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
