"""OpenAI's Responses API (`POST /v1/responses`), text only and stateless: a conversation in,
one assistant message out, as one JSON object or as its typed server-sent events.

The input (a string, or message items whose content is text) and the `instructions` (a system
message first) are rendered with the chat template and answered as /v1/chat/completions answers
them, exact under speculation alike. Nothing is stored: `previous_response_id`, `conversation`
and `background` are refused, so the client sends the whole conversation each time. As on the
other endpoints, a field this server does not implement (`tools`, `reasoning`, a `text` format
other than plain text, ...) is a 400 naming it unless it is sent switched off.

Logprobs come as OpenAI's do: `include: ["message.output_text.logprobs"]` asks for them, with
`top_logprobs` (up to 20) alternatives a token; each delta event carries its own tokens' (a
token whose text is held back, part of a character, in a delta of no text), the finished text
all of them. They are the target's own, exact under speculation.

An answer cut by `max_output_tokens` has status "incomplete" (reason "max_output_tokens"), and
its stream ends with `response.incomplete`, as OpenAI's does. A stream that fails after it
started ends with `response.failed`, its error a stable code and a short message; the details go
to the logs.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from deployments.openai_schemas import (
    IGNORED_FIELDS,
    NoSilentFields,
    RefusedField,
    RequestBody,
    SloOptions,
    SpeculationOptions,
)
from deployments.responses import chat_logprobs, failure, speculation_report
from deployments.serving import StreamEvent, StreamStart
from faser.engine.async_engine import StreamDelta

logger = logging.getLogger(__name__)
TEXT_FORMAT = {"format": {"type": "text"}}
LOGPROBS = "message.output_text.logprobs"  # the one `include` this server answers


class InputText(RequestBody):
    # an assistant message of the conversation carries its text as output_text
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(RequestBody):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponsesRequest(NoSilentFields):
    IGNORED: ClassVar[frozenset[str]] = IGNORED_FIELDS | {"prompt_cache_retention"}
    OFF: ClassVar[dict[str, tuple[Any, ...]]] = {
        "tools": ([],), "tool_choice": ("none", "auto"), "text": (TEXT_FORMAT,),
        "reasoning": ({},), "truncation": ("disabled",),
        "background": (False,), "previous_response_id": (),
        "conversation": (), "prompt": (), "max_tool_calls": (0,),
    }

    model: str
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    include: list[str] = Field(default_factory=list)
    top_logprobs: int = Field(default=0, ge=0, le=20)
    speculation: SpeculationOptions | None = None
    slo: SloOptions | None = None

    @field_validator("include")
    @classmethod
    def _only_logprobs(cls, include: list[str]) -> list[str]:
        for i, name in enumerate(include):
            if name != LOGPROBS:
                raise RefusedField(f"include.{i}", f"only {LOGPROBS!r} is answered, not {name!r}")
        return include

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top: int, info: Any) -> int:
        if top and LOGPROBS not in info.data.get("include", ()):
            raise RefusedField("top_logprobs", f"alternatives need include: [{LOGPROBS!r}]")
        return top

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per output token; None: no logprobs."""
        return self.top_logprobs if LOGPROBS in self.include else None

    @field_validator("input", mode="before")
    @classmethod
    def _messages_of_text(cls, items: Any) -> Any:
        """An item that is not a message (a function call's output, a reasoning item), or a part
        that is not text (an image, a file), is refused by its place."""
        if isinstance(items, str) and not items:
            raise RefusedField("input", "the input is empty")
        if not isinstance(items, list):
            return items
        if not items:
            raise RefusedField("input", "the input holds no message")
        for i, item in enumerate(items):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind != "message":
                raise RefusedField(f"input.{i}.type", f"only messages are taken, not {kind!r}")
            parts = item.get("content")
            for j, part in enumerate(parts if isinstance(parts, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("input_text", "output_text"):
                    raise RefusedField(f"input.{i}.content.{j}.type",
                                       f"only text parts are taken, not {kind!r}")
        return items

    def conversation(self) -> list[dict[str, str]]:
        messages = [] if self.instructions is None else [
            {"role": "system", "content": self.instructions}]
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        return [*messages, *({"role": m.role, "content": m.text()} for m in self.input)]

    def sampling(self) -> dict[str, Any]:
        return dict(temperature=self.temperature, top_p=self.top_p)


class ResponseFormatter:
    """Shapes one request's engine events into a Response object or its stream of events."""

    def __init__(self, request: ResponsesRequest, model: str, start: StreamStart) -> None:
        self.request = request
        self.model = model
        self.start = start
        self.id = f"resp_{start.request_id}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.spec = request.speculation
        self.parts: list[str] = []
        self.logprobs: list[dict] = []  # every token's so far, when asked for
        self.last: StreamDelta | None = None
        self.sequence = 0

    async def collect(self, events: AsyncIterator[tuple[int, StreamEvent]]) -> dict:
        async for _, event in events:
            self._take(event)
        return self.response()

    async def sse(self, events: AsyncIterator[tuple[int, StreamEvent]]) -> AsyncIterator[str]:
        try:
            yield self._event("response.created", response=self.response())
            yield self._event("response.in_progress", response=self.response())
            yield self._event("response.output_item.added", output_index=0, item=self.item())
            yield self._event("response.content_part.added", **self._place(), part=_text(""))
            async for _, event in events:
                new = self._take(event)
                if event.text or new:  # tokens whose text is held back still bring logprobs
                    yield self._event("response.output_text.delta", **self._place(),
                                      delta=event.text, logprobs=new)
            text = "".join(self.parts)
            yield self._event("response.output_text.done", **self._place(), text=text,
                              logprobs=self.logprobs)
            yield self._event("response.content_part.done", **self._place(),
                              part=_text(text, self.logprobs))
            yield self._event("response.output_item.done", output_index=0, item=self.item())
            response = self.response()
            yield self._event(f"response.{response['status']}", response=response)
        except Exception as exc:  # mid-stream failure: the status line has gone already
            logger.exception("stream failed")
            failed = {**self.response(), "status": "failed",
                      "error": {"code": "server_error", "message": failure(exc).message}}
            yield self._event("response.failed", response=failed)
        finally:
            await events.aclose()

    def _take(self, event: StreamEvent) -> list[dict]:
        """Adds an engine event's text and logprobs; returns its logprobs."""
        assert isinstance(event, StreamDelta)
        self.parts.append(event.text)
        self.last = event
        if not event.logprobs:  # not asked for: no per-event objects on the stream's path
            return []
        new = [lp.model_dump() for lp in chat_logprobs(event.logprobs).content]
        self.logprobs += new
        return new

    def status(self) -> str:
        if self.last is None or not self.last.finished:
            return "in_progress"
        return "incomplete" if self.last.finish_reason == "length" else "completed"

    def response(self) -> dict:
        request, status = self.request, self.status()
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "temperature": request.temperature, "top_p": request.top_p,
            "top_logprobs": request.top_logprobs,
            "output": [] if status == "in_progress" else [self.item()],
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "text": TEXT_FORMAT, "truncation": "disabled", "store": False, "metadata": {},
            "usage": self._usage(), "speculation": self._report(),
        }

    def item(self) -> dict:
        status = self.status()
        content = [] if status == "in_progress" else [_text("".join(self.parts), self.logprobs)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": content}

    def _usage(self) -> dict | None:
        if self.last is None or not self.last.finished:
            return None
        prompt, output = self.start.num_prompt_tokens, self.last.num_output_tokens
        cached = min(self.last.num_cached_tokens, prompt)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + output}

    def _report(self) -> dict | None:
        if self.last is None:
            return None
        policy = self.spec.policy if self.spec is not None and self.spec.policy else None
        return speculation_report(self.last, policy or self.start.policy).model_dump()

    def _place(self) -> dict:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"


def _text(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
