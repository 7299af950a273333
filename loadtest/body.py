"""The JSON body of one streaming OpenAI request, chat or completions."""

from __future__ import annotations

from typing import Any

from loadtest.settings import LoadSettings, speculation_field


def request_body(
    settings: LoadSettings, model: str, prompt: str, max_tokens: int
) -> dict[str, Any]:
    """A streaming request that reports usage in its last chunk.

    `ignore_eos` is the vLLM/FASER extension that makes the server produce exactly `max_tokens`,
    so a replayed trace row gets its recorded output length; `speculation` is FASER's own.
    """
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if settings.ignore_eos:
        body["ignore_eos"] = True
    speculation = speculation_field(settings.speculation)
    if speculation is not None:
        body["speculation"] = speculation
    return body
