"""Server-sent events of an OpenAI streaming completion, timed as they arrive.

Works for `/v1/chat/completions` (`choices[0].delta.content`) and `/v1/completions`
(`choices[0].text`). TTFT is the time to the first chunk that carries text; TPOT is the mean gap
between later tokens, `(latency - ttft) / (output_tokens - 1)`, as vLLM's benchmarks define it.
Output tokens come from the final `usage` chunk (`stream_options.include_usage`); without one,
each text chunk counts as one token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


@dataclass(frozen=True, slots=True)
class StreamResult:
    ttft_s: float | None
    tpot_s: float | None
    latency_s: float
    output_tokens: int
    prompt_tokens: int | None
    text: str
    error: str | None  # None when the stream ended with [DONE] and no error event


def sse_data(line: str | bytes) -> str | None:
    """The payload of a `data:` line; None for blank lines, comments and other fields."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    line = line.rstrip("\r\n")
    if not line.startswith("data:"):
        return None
    payload = line[5:]
    return payload[1:] if payload.startswith(" ") else payload


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a chat or completions chunk adds (empty for role-only and usage-only chunks)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""


class StreamTimer:
    """Feed it each SSE line with its arrival time (seconds from the request's start)."""

    def __init__(self) -> None:
        self.ttft_s: float | None = None
        self.num_text_chunks = 0
        self.usage: dict[str, Any] | None = None
        self.parts: list[str] = []
        self.error: str | None = None
        self.done = False

    def feed(self, line: str | bytes, t_s: float) -> None:
        data = sse_data(line)
        if data is None or self.done:
            return
        if data.strip() == DONE:
            self.done = True
            return
        self._on_chunk(data, t_s)

    def _on_chunk(self, data: str, t_s: float) -> None:
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"bad SSE chunk: {data[:200]!r}"
            return
        if chunk.get("error"):
            self.error = f"error event: {json.dumps(chunk['error'])[:300]}"
            return
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        text = chunk_text(chunk)
        if text:
            self.ttft_s = t_s if self.ttft_s is None else self.ttft_s
            self.num_text_chunks += 1
            self.parts.append(text)

    def result(self, latency_s: float) -> StreamResult:
        output_tokens = int((self.usage or {}).get("completion_tokens") or self.num_text_chunks)
        prompt_tokens = (self.usage or {}).get("prompt_tokens")
        tpot_s = None
        if self.ttft_s is not None and output_tokens > 1:
            tpot_s = (latency_s - self.ttft_s) / (output_tokens - 1)
        error = self.error or (None if self.done else "stream ended without data: [DONE]")
        return StreamResult(
            ttft_s=self.ttft_s,
            tpot_s=tpot_s,
            latency_s=latency_s,
            output_tokens=output_tokens,
            prompt_tokens=int(prompt_tokens) if prompt_tokens is not None else None,
            text="".join(self.parts),
            error=error,
        )


def parse_stream(lines: list[tuple[float, str]], latency_s: float) -> StreamResult:
    """Time a captured stream: `(arrival_s, line)` pairs and the request's total latency."""
    timer = StreamTimer()
    for t_s, line in lines:
        timer.feed(line, t_s)
    return timer.result(latency_s)
