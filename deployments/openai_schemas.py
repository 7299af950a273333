"""OpenAI-compatible request and response bodies (pydantic, at the HTTP edge).

Requests are parsed in strict mode from the raw JSON bytes, so a wrongly-typed field (a string
where a number goes, a bool where an integer goes) is a 400, never silently coerced. A request
never quietly gets something else than it asked for: fields that change nothing here (`user`,
`metadata`, ...) are ignored, fields this server does not implement are accepted only at the value
that turns them off (clients send `tools: []` or `response_format: {"type": "text"}`), and any
other field is a 400 that names it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from faser.chat import chat_ending
from faser.config import POLICIES, parse_policy
from faser.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_REPETITION_PENALTY,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
)

MAX_STOP_STRINGS = 4
MAX_CHOICES = 64  # n times the prompts of one request: each choice is an engine request
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's cap)
# completions' logprobs: OpenAI caps them at 5, vLLM at 20, and its clients ask for more than 5
# (lm-eval's loglikelihood body asks for 10)
MAX_COMPLETION_LOGPROBS = 20
MAX_LOGIT_BIAS_TOKENS = 300  # OpenAI's cap on logit_bias's entries
# fields that change no output: ignored
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls",
                            "stream_options", "safety_identifier", "prompt_cache_key"})
# fields not implemented here, and the values besides null (unset) that mean "off";
# `top_logprobs` (chat's) and `echo` (completions') are fields of the endpoint that implements
# them, refused on the other
OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "top_logprobs": (0,), "prompt_logprobs": (0,), "echo": (False,),
    "tools": ([],), "functions": ([],), "tool_choice": ("none",), "function_call": ("none",),
    "best_of": (1,), "response_format": ({"type": "text"},), "suffix": ("",),
    "min_tokens": (0,), "stop_token_ids": ([],), "modalities": (["text"],),
}


class RefusedField(ValueError):
    """A field this server will not take; `param` names it in the 400."""

    def __init__(self, param: str, message: str) -> None:
        # a message from the core may already open with the field's name
        super().__init__(message if message.startswith(f"{param}: ") else f"{param}: {message}")
        self.param = param


class RequestBody(BaseModel):
    """A JSON request body, parsed strictly (no type coercion); unknown keys are its subclasses'
    concern."""

    model_config = ConfigDict(strict=True, extra="ignore")


class _Extension(RequestBody):
    """A field of this server's own: a key it does not know is a typo (`{"polcy": "fixed"}`),
    which ignored would leave the request as if the field were not sent."""

    model_config = ConfigDict(strict=True, extra="forbid")


class SpeculationOptions(_Extension):
    """The `speculation` extension: override the replica's policy for one request. The policy
    may carry its k as the engine and the benchmarks write it: "fixed:4" is
    {"policy": "fixed", "max_k": 4}."""

    policy: Literal[POLICIES] | None = None  # type: ignore[valid-type]
    max_k: int | None = Field(default=None, ge=0, le=16)

    @model_validator(mode="before")
    @classmethod
    def _split_k(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("policy"), str):
            return data
        if ":" not in data["policy"]:
            return data
        name, k = parse_policy(data["policy"], default_k=0)
        if data.get("max_k") is not None and data["max_k"] != k:
            raise ValueError(f"policy {data['policy']!r} contradicts max_k={data['max_k']}")
        return {**data, "policy": name, "max_k": k}


class SloOptions(_Extension):
    """The `slo` extension: the request's targets, which SLO-aware speculation keeps to."""

    tpot_ms: float | None = Field(default=None, gt=0)  # time per output token
    ttft_ms: float | None = Field(default=None, gt=0)  # time to first token


class StreamOptions(RequestBody):
    include_usage: bool = False


class NoSilentFields(RequestBody):
    """A request body that is never quietly answered as another: besides its own fields, those of
    IGNORED change no output and are ignored, those of OFF are not implemented and taken only at
    a value that turns them off, and any other field is a 400 naming it."""

    IGNORED: ClassVar[frozenset[str]] = IGNORED_FIELDS
    OFF: ClassVar[dict[str, tuple[Any, ...]]] = OFF_VALUES

    @model_validator(mode="before")
    @classmethod
    def _no_silent_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        # null is unset: OpenAI's fields that take null ("temperature": null, "n": null) mean
        # their default by it, and clients send it so
        data = {name: value for name, value in data.items() if value is not None}
        for name, value in data.items():
            if name in cls.model_fields or name in cls.IGNORED:
                continue
            if name not in cls.OFF:
                raise RefusedField(name, "unrecognized field")
            if value not in cls.OFF[name]:
                raise RefusedField(name, "not supported by this server (leave it unset)")
        return data


class _SamplingRequest(NoSilentFields):
    """The fields of a completion or chat request this server implements."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=MAX_TOP_K)  # vLLM's extension; -1 or 0: no top-k
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # vLLM's extension
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # vLLM's extension (Hugging Face's semantics): > 1 makes a seen token less likely
    repetition_penalty: float | None = Field(
        default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    # OpenAI's: {"token id": bias}, the bias added to the token's logit before sampling
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS_TOKENS)
    # choices per prompt, each its own engine request; with a seed, choice j draws with seed + j
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # vLLM's int64 range
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says
    speculation: SpeculationOptions | None = None
    slo: SloOptions | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_and_biases(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.isdecimal():
                raise ValueError(f"keys are token ids written as integers, got {key!r}")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"a bias lies in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {value} for token {key}")
        return bias

    @field_validator("stop")
    @classmethod
    def _few_stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS or any(not s for s in strings):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        return stop

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self) -> dict[str, Any]:
        """The sampling fields as GenerateRequest takes them (None: the field's off value)."""
        return dict(
            temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
            min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed, stop=self.stop_strings(), ignore_eos=self.ignore_eos,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
        )


class CompletionRequest(_SamplingRequest):
    # a prompt (text or token ids) or a batch of them; choice i * n + j answers prompt i
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 with echo: the prompt alone, scored (the legacy API's way to score text, as lm-eval does)
    max_tokens: int | None = Field(default=None, ge=0)
    # the target's logprobs of each token and of this many likeliest alternatives
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None  # the answer repeats the prompt (with its logprobs, if asked)

    @field_validator("prompt")
    @classmethod
    def _some_prompts(cls, prompt: Any) -> Any:
        if len(prompt) == 0 or (isinstance(prompt[0], str | list) and any(not p for p in prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    @model_validator(mode="after")
    def _no_tokens_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise RefusedField("max_tokens", "0 answers with the prompt alone: it needs echo: true")
        return self

    @model_validator(mode="after")
    def _few_choices(self) -> CompletionRequest:
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise RefusedField("n", f"n times the prompts may be at most {MAX_CHOICES}")
        return self

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Conversation(RequestBody):
    """Messages and how their rendering ends (vLLM's extensions, faser/chat.py): by default with
    the generation prompt; `continue_final_message` goes on inside a last assistant message."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _ending_fits(self) -> _Conversation:
        try:
            chat_ending(self.conversation(), self.add_generation_prompt,
                        self.continue_final_message)
        except ValueError as exc:
            raise RefusedField("continue_final_message", str(exc)) from exc
        return self

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def chat_ending(self) -> dict[str, Any]:
        """The ending as render_chat and GenerateRequest take it."""
        return dict(add_generation_prompt=self.add_generation_prompt,
                    continue_final_message=self.continue_final_message)


class ChatCompletionRequest(_SamplingRequest, _Conversation):
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        """A message part that is not text (an image, audio, a file), a text part without its
        text, or content that is neither (null, a number) is refused by its place: the union of
        `content` would otherwise report that the list is not a string."""
        messages = data.get("messages") if isinstance(data, dict) else None
        for i, message in enumerate(messages if isinstance(messages, list) else []):
            parts = message.get("content") if isinstance(message, dict) else None
            if isinstance(message, dict) and not isinstance(parts, str | list):
                raise RefusedField(f"messages.{i}.content",
                                   "a message's content is a string or a list of text parts")
            for j, part in enumerate(parts if isinstance(parts, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    said = f", not {kind!r}" if isinstance(kind, str) else ""
                    raise RefusedField(f"messages.{i}.content.{j}.type",
                                       f'only text parts {{"type": "text"}} are taken{said}')
                if not isinstance(part.get("text"), str):
                    raise RefusedField(f"messages.{i}.content.{j}.text",
                                       "a text part holds its text as a string")
        return data

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise RefusedField("top_logprobs", "needs logprobs: true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize: a completion prompt or a chat conversation (rendered with the chat
    template as /v1/chat/completions renders it)."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(RequestBody):
    model: str
    tokens: list[int]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # read from the prefix cache instead of computed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class SpeculationReport(BaseModel):
    """Per-request speculation figures, returned in every response (the extension's answer)."""

    policy: str | None = None
    drafted: int = 0
    accepted: int = 0
    mean_acceptance_length: float = 0.0
    mode: str | None = None
    slo_met: bool | None = None  # whether the request met its SLO; None without one


def _completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Response(BaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionLogprobs(BaseModel):
    """The legacy completions' shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Response):
    id: str = Field(default_factory=lambda: _completion_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculation: SpeculationReport | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Response):
    id: str = Field(default_factory=lambda: _completion_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    speculation: SpeculationReport | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculation: SpeculationReport | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "faser"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
