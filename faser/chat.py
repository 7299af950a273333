"""A conversation as the model reads it: the tokenizer's chat template with the generation prompt,
applied alike by `LLM.chat` and the OpenAI server, so that both answer it alike."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """The token ids of `messages` ([{"role": ..., "content": ...}, ...]) under the chat template,
    ending where the assistant's answer begins."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    if not messages:
        raise ValueError("a conversation needs at least one message")
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
