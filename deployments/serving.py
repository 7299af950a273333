"""The engine side of the OpenAI API: prompt rendering, validation against the context window,
and one event stream per request.

A stream opens with exactly one StreamStart or RequestError and then carries StreamDelta until
the one with `finished` set. These plain dataclasses are what crosses from the engine replica to
the HTTP ingress, so the ingress needs neither the tokenizer nor the engine to serve generation;
it fetches a copy of the Renderer (the tokenizer and the context window) once, for /tokenize and
/detokenize alone.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Literal

from deployments.continuation import Continuation
from faser.chat import render_chat
from faser.engine.async_engine import (
    AsyncLLMEngine,
    StreamDelta,
    TextDeltas,
    TextLogprob,
    to_delta,
)
from faser.outputs import RequestOutput
from faser.sampling_params import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    kind: Literal["completion", "chat"]
    prompt: str | list[int] | None = None  # completion
    messages: tuple[dict[str, str], ...] = ()  # chat
    add_generation_prompt: bool | None = None  # chat: how its rendering ends (faser/chat.py)
    continue_final_message: bool = False
    max_tokens: int | None = None  # 0: the prompt alone, scored (completion with echo)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives per output token; None: no logprobs
    echo: bool = False  # completion: the answer starts with the prompt (and its logprobs)
    speculation: dict[str, Any] | None = None  # {"policy": ..., "max_k": ...}, None values dropped
    slo: dict[str, float] | None = None  # {"tpot_ms": ..., "ttft_ms": ...}, None values dropped
    # the tokens a client already has of this request, sent by a replica that died: this one
    # continues after them (deployments/continuation.py)
    resume_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StreamStart:
    request_id: str
    num_prompt_tokens: int
    replica: str = ""
    policy: str | None = None  # the replica's default policy
    prompt_text: str | None = None  # echo: the prompt as the answer repeats it
    # echo with logprobs: one per prompt token (the first one's logprob is None)
    prompt_logprobs: tuple[TextLogprob, ...] | None = None


@dataclass(frozen=True, slots=True)
class RequestError:
    status: int
    message: str
    param: str | None = None
    type: str = "invalid_request_error"
    code: str | None = None


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


StreamEvent = StreamStart | StreamDelta | RequestError


class Renderer:
    """A request's prompt or conversation into token ids, checked against the vocabulary; and
    /tokenize and /detokenize. Picklable, so that the ingress keeps a copy to answer those two
    itself, never queueing them behind generation in the engines' queues."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def tokenize(self, request: GenerateRequest) -> dict[str, Any] | RequestError:
        """The token ids the engine would see for this prompt or conversation (vLLM's shape)."""
        try:
            ids = self.render(request)
        except BadRequest as exc:
            return RequestError(400, str(exc), exc.param)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    def detokenize(self, ids: list[int]) -> dict[str, Any] | RequestError:
        if self.tokenizer is None:
            return RequestError(400, "this model has no tokenizer", "tokens")
        try:
            self.check_ids(ids, "tokens")
        except BadRequest as exc:
            return RequestError(400, str(exc), exc.param)
        return {"prompt": self.tokenizer.decode(ids)}

    def render(self, request: GenerateRequest) -> list[int]:
        if request.kind == "chat":
            return self._render_chat(request)
        if isinstance(request.prompt, list):
            return self.check_ids(request.prompt)
        if self.tokenizer is None:
            raise BadRequest("this model has no tokenizer: send the prompt as token ids", "prompt")
        return list(self.tokenizer.encode(request.prompt, add_special_tokens=False))

    def _render_chat(self, request: GenerateRequest) -> list[int]:
        try:
            return render_chat(
                self.tokenizer, request.messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
            )
        except ValueError as exc:
            raise BadRequest(str(exc), "messages") from exc

    def check_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        vocab_size = len(self.tokenizer) if self.tokenizer is not None else None
        for token_id in ids:
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                raise BadRequest(f"token id {token_id} lies outside the vocabulary", param)
        return ids


class OpenAIServing:
    """Renders requests into token ids and sampling parameters and streams the engine's work."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        tokenizer: Any,
        max_model_len: int,
        replica: str = "",
        policy: str | None = None,
        default_slo: dict[str, float] | None = None,
    ) -> None:
        self.engine = engine
        self.renderer = Renderer(tokenizer, max_model_len)
        self.replica = replica
        self.policy = policy
        self.default_slo = default_slo or {}  # the deployment's; a request's own fields win
        # a token's text for logprobs, decoded once per token id
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)

    @property
    def tokenizer(self) -> Any:
        return self.renderer.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.renderer.max_model_len

    async def stream(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        request_id = uuid.uuid4().hex
        try:
            prompt_ids = self.prompt_ids(request)
            params = self.sampling_params(request, len(prompt_ids))
            slo = {**self.default_slo, **(request.slo or {})} or None
            resumed = Continuation(
                request.resume_token_ids, len(prompt_ids), params.stop, self.tokenizer
            )
            outputs = resumed.outputs(self.engine.generate(
                request_id, resumed.engine_prompt(prompt_ids), resumed.params(params),
                request.speculation, slo,
            ))
            first = await anext(outputs)
        except BadRequest as exc:
            yield RequestError(400, str(exc), exc.param)
            return
        except ValueError as exc:  # the engine's own validation
            yield RequestError(400, str(exc))
            return
        deltas = resumed.text_deltas()
        try:
            yield self._start(request_id, request, prompt_ids, first)
            if request.max_tokens == 0:
                yield _prompt_only(first, request)
                return
            yield self._delta(first, deltas)
            async for output in outputs:
                yield self._delta(output, deltas)
        finally:
            await outputs.aclose()  # aborts the request if the consumer left early

    def _start(
        self, request_id: str, request: GenerateRequest, prompt_ids: list[int],
        first: RequestOutput,
    ) -> StreamStart:
        start = StreamStart(request_id, len(prompt_ids), self.replica, self.policy)
        if not request.echo:
            return start
        text = request.prompt if isinstance(request.prompt, str) else self._decode(prompt_ids)
        scored = None
        if first.prompt_logprobs is not None:
            scored = tuple(TextLogprob.of(token, lp, self.token_text)
                           for token, lp in zip(prompt_ids, first.prompt_logprobs, strict=False))
        return replace(start, prompt_text=text, prompt_logprobs=scored)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _delta(self, output: RequestOutput, deltas: TextDeltas) -> StreamDelta:
        delta = to_delta(output, deltas, self.token_text)
        if delta.finished:
            delta.mode = self.engine.load_stats().get("mode")
        return delta

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        ids = self.renderer.render(request)
        if not ids:
            raise BadRequest("the prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:
            raise BadRequest(
                f"the prompt has {len(ids)} tokens, but this model's maximum context length is "
                f"{self.max_model_len} tokens, which leaves no room for output",
                "messages" if request.kind == "chat" else "prompt",
            )
        return ids

    def sampling_params(self, request: GenerateRequest, num_prompt_tokens: int) -> SamplingParams:
        room = self.max_model_len - num_prompt_tokens
        max_tokens = request.max_tokens
        if max_tokens is None:
            default = DEFAULT_COMPLETION_MAX_TOKENS if request.kind == "completion" else room
            max_tokens = min(default, room)
        elif max_tokens > room:
            raise BadRequest(
                f"this model's maximum context length is {self.max_model_len} tokens; you asked "
                f"for {num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, "
                f"{max_tokens} in the completion)",
                "max_tokens",
            )
        self.renderer.check_ids([token_id for token_id, _ in request.logit_bias], "logit_bias")
        return SamplingParams(
            # max_tokens 0 (echo): the engine samples a token after the prompt, which no one sees
            max_tokens=max(1, max_tokens),
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.seed,
            stop=request.stop,
            ignore_eos=request.ignore_eos,
            min_p=request.min_p,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            logit_bias=request.logit_bias,
            logprobs=request.logprobs,
            prompt_logprobs=request.logprobs if request.echo else None,
        )

    def _token_text(self, token_id: int) -> str:
        """vLLM's shape: the token decoded alone, or "token_id:N" without a tokenizer."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

def _prompt_only(first: RequestOutput, request: GenerateRequest) -> StreamDelta:
    """The end of a max_tokens 0 answer: no output token, finished for its length."""
    return StreamDelta(
        request_id=first.request_id, text="", token_ids=[],
        num_prompt_tokens=len(first.prompt_token_ids), num_output_tokens=0, finished=True,
        finish_reason="length", logprobs=[] if request.logprobs is not None else None,
        num_cached_tokens=first.num_cached_tokens,
    )
