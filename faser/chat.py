"""A conversation as the model reads it: the tokenizer's chat template, applied alike by
`LLM.chat` and the OpenAI server, so that both answer it alike. By default it ends with the
generation prompt, where the assistant's answer begins; `continue_final_message` ends it inside
the last message instead, an assistant's opening that the answer goes on from (vLLM's
extension, for prefilled answers); `add_generation_prompt=False` ends it after the last message."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """The token ids of `messages` ([{"role": ..., "content": ...}, ...]) under the chat template.
    `add_generation_prompt` None means: unless the final message is continued."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    if not messages:
        raise ValueError("a conversation needs at least one message")
    add_generation_prompt = chat_ending(messages, add_generation_prompt, continue_final_message)
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, tokenize=False,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_ending(
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool | None,
    continue_final_message: bool,
) -> bool:
    """Whether the rendered conversation ends with the generation prompt (None: unless the final
    message is continued); a ValueError where the last message cannot be continued."""
    if not continue_final_message:
        return add_generation_prompt is not False
    if add_generation_prompt:
        raise ValueError("continue_final_message: the answer goes on inside the last message, so "
                         "there is no generation prompt: leave add_generation_prompt unset")
    if messages[-1].get("role") != "assistant":
        raise ValueError("continue_final_message: the answer goes on from the assistant's last "
                         f"message, but the last message's role is {messages[-1].get('role')!r}")
    if not messages[-1].get("content", "").strip():
        raise ValueError("continue_final_message: the last message holds no text to go on from")
    return False
