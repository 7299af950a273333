"""A request continued on another replica after the one serving it died: the engine prefills the
prompt plus the tokens the client already has, decodes only the rest, and its outputs read as the
whole answer's, so the client's stream goes on as if nothing had happened.

The ingress names those tokens in `GenerateRequest.resume_token_ids` (deployments/ingress.py).
Greedy decoding continues exactly: the engine is exact, so prefilling prompt + sent tokens gives
the next token that decoding them one by one would have given; so does seeded sampling, whose
tokens are races keyed by the seed and their positions (faser/layers/race.py).

The text is decoded from the whole answer's ids (incrementally, faser/engine/detokenizer.py),
never from the continuation's alone, which could split a multi-byte character at the join or
lose a space the tokenizer strips from a text's first token. Its deltas start where the client's
text ended (the text of the sent tokens less what TextDeltas held back, which the continuation
then sends), and a stop string that spans the join ends the request where the first replica would
have ended it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from faser.engine.async_engine import TextDeltas
from faser.engine.detokenizer import IncrementalText
from faser.outputs import RequestOutput
from faser.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Continuation:
    """The tokens a client already has of its request; with none, everything passes unchanged."""

    sent_ids: tuple[int, ...]
    num_prompt_tokens: int  # the rendered prompt's, without sent_ids: what usage reports
    stop: tuple[str, ...]
    tokenizer: Any
    # the whole answer's text as it grows (each output's); the sent part alone is decoded apart
    detokenizer: IncrementalText = field(default_factory=IncrementalText)

    def engine_prompt(self, prompt_ids: list[int]) -> list[int]:
        return [*prompt_ids, *self.sent_ids]

    def params(self, params: SamplingParams) -> SamplingParams:
        """The request's own parameters, with max_tokens counting only the tokens still due."""
        if not self.sent_ids:
            return params
        return replace(params, max_tokens=params.max_tokens - len(self.sent_ids))

    def text_deltas(self) -> TextDeltas:
        deltas = TextDeltas(self.stop)
        if self.sent_ids:  # the client has this text already: deltas start after it
            sent = "" if self.tokenizer is None else self.tokenizer.decode(
                list(self.sent_ids), skip_special_tokens=True)  # once: not the growing decoder
            deltas.delta(self._cut(sent)[0], finished=False)
        return deltas

    def outputs(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        return self._whole(outputs) if self.sent_ids else outputs

    async def _whole(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        try:
            async for output in outputs:
                whole = self.whole(output)
                yield whole
                if whole.finished:  # a stop string across the join: the engine has not seen it
                    return
        finally:
            await outputs.aclose()  # aborts the engine's request if it is still running

    def whole(self, output: RequestOutput) -> RequestOutput:
        """The engine's output of the continuation as the whole answer's."""
        token_ids = [*self.sent_ids, *output.token_ids]
        text, stopped = self._cut(self.detokenizer.decode(self.tokenizer, token_ids)
                                  if self.tokenizer is not None else "")
        return replace(
            output,
            prompt_token_ids=output.prompt_token_ids[: self.num_prompt_tokens],
            token_ids=token_ids,
            text=text,
            finished=output.finished or stopped,
            finish_reason="stop" if stopped else output.finish_reason,
        )

    def _cut(self, text: str) -> tuple[str, bool]:
        """The text cut before its first stop string (as faser/engine/stop.py cuts it), and
        whether it was cut."""
        hits = [at for stop in self.stop if (at := text.find(stop)) != -1]
        return (text[: min(hits)], True) if hits else (text, False)
