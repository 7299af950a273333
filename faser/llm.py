"""Offline entry point, as in vLLM: `LLM(...).generate(prompts, SamplingParams(...))`, and
`LLM(...).chat(messages, ...)` for conversations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tqdm import tqdm

from faser.chat import render_chat
from faser.config import EngineConfig, SpecConfig
from faser.engine.llm_engine import LLMEngine
from faser.outputs import RequestOutput
from faser.sampling_params import SamplingParams


class LLM:
    def __init__(
        self,
        model: str | None = None,
        draft_model: str | None = None,
        spec: SpecConfig | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        **engine_kwargs,
    ) -> None:
        config = EngineConfig(
            model=model, draft_model=draft_model, spec=spec or SpecConfig(), device=device,
            dtype=dtype, **engine_kwargs,
        )
        self.engine = LLMEngine(config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        speculation: dict | None = None,
    ) -> list[RequestOutput]:
        """`speculation` overrides the engine's speculation for these requests:
        {"policy": "fixed", "max_k": 3}."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling_params: one per prompt, or a single one for all")
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                ids.append(self.engine.add_request(None, prompt, sp, speculation=speculation))
            with tqdm(total=len(ids), disable=not use_tqdm, desc="generate") as bar:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            done[out.request_id] = out
                            bar.update(1)
        except BaseException:
            # all or nothing: a bad prompt, a failed step or an interrupt leaves no request
            # behind, which the next call would otherwise step (or fail) on
            for request_id in ids:
                self.engine.abort_request(request_id)
            self.engine.step()
            raise
        return [done[i] for i in ids]

    def chat(
        self,
        messages: Sequence[Mapping[str, str]] | Sequence[Sequence[Mapping[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        speculation: dict | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """One conversation ([{"role": "user", "content": ...}, ...]) or a list of them, each
        rendered with the model's chat template as the OpenAI server renders it, then answered
        as `generate` answers a prompt. `continue_final_message` answers by going on from the
        last message, an assistant's opening (faser/chat.py)."""
        if not messages:
            raise ValueError("messages must not be empty")
        one = isinstance(messages[0], Mapping)
        conversations = [messages] if one else list(messages)
        prompts = [
            render_chat(self.tokenizer, c, add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, speculation)
