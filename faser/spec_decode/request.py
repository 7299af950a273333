"""What the speculation layer needs of a request. The engine's Sequence satisfies it; the spec
layer never imports the engine (layers only look down). The cache cursors are read here and
moved only through the request's own methods."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from faser.layers.sampler import History
from faser.outputs import SpecStats, TokenLogprob
from faser.sampling_params import SamplingParams
from faser.spec_decode.lookup import PromptLookup
from faser.spec_decode.state import SpecState


class SpecRequest(Protocol):
    request_id: str
    params: SamplingParams
    spec_state: SpecState
    generator: torch.Generator
    block_table: list[int]
    lookup: PromptLookup  # its committed tokens' n-grams, for prompt lookup
    stats: SpecStats
    arrival_time: float  # time.perf_counter(), as the SLO clock reads
    first_token_time: float | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    logprobs: list[TokenLogprob]  # the committed tokens', when the request asks for them
    prompt_logprobs: list[TokenLogprob | None]
    finish_reason: str | None  # the verifier sets "error" where the model's rows are not finite

    @property
    def num_cached(self) -> int: ...  # positions in the target's KV cache

    @property
    def num_draft_cached(self) -> int: ...  # positions in the draft's KV cache

    def mark_target_cached(self, num_positions: int, featured: bool = True) -> None: ...

    def mark_draft_cached(self, num_positions: int) -> None: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def last_token_id(self) -> int: ...


def history(seq: SpecRequest, drafted: Sequence[int] = ()) -> History | None:
    """The tokens the penalties of seq's row after `drafted` (tokens past its committed ones)
    look at; None when the request has no penalties, which need none."""
    if not seq.params.penalised:
        return None
    return History(seq.prompt_token_ids, seq.output_token_ids + list(drafted))
