"""One request as the engine tracks it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from faser.engine.detokenizer import IncrementalText
from faser.outputs import SpecStats, TokenLogprob
from faser.sampling_params import SamplingParams
from faser.spec_decode.lookup import PromptLookup
from faser.spec_decode.state import SpecState


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    spec_state: SpecState
    generator: torch.Generator  # this request's own randomness, seeded when it asks to be
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)  # shared by the target and draft caches
    # positions held in the target's and the draft's KV caches; written only by the methods below
    num_cached: int = 0
    num_draft_cached: int = 0
    # of the target's, the leading positions whose features the feature cache holds (a forward
    # of policy `off`'s requests alone computes none)
    num_featured: int = 0
    # prefix caching (faser.runner.block_manager): the keys of the leading full blocks, those of
    # them marked as holding the draft's half, and the prompt positions read from the cache
    prefix_digests: list[bytes] = field(default_factory=list)
    num_draft_marked: int = 0
    num_cached_prompt_tokens: int = 0
    lookup: PromptLookup = field(default_factory=PromptLookup)  # for prompt lookup
    stats: SpecStats = field(default_factory=SpecStats)
    # asked-for logprobs: the verifier appends one per token it commits (the engine drops those
    # past a stop), and one per prompt position its prefill chunks score
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    detokenizer: IncrementalText = field(default_factory=IncrementalText)  # grows `text`
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    def mark_target_cached(self, num_positions: int, featured: bool = True) -> None:
        """A forward just fed the target positions up to `num_positions`, writing their features
        where `featured`."""
        if featured and self.num_featured >= self.num_cached:
            self.num_featured = num_positions
        self.num_cached = num_positions

    def mark_draft_cached(self, num_positions: int) -> None:
        """The draft's cache holds (or, after a guess is dropped, is trusted for) the first
        `num_positions` positions."""
        self.num_draft_cached = num_positions

    def roll_back_caches(self) -> None:
        """After tokens are committed: what the target and the draft computed past them (rejected
        drafts) is dropped; the newest committed token is fed again by the next step."""
        self.num_cached = min(self.num_cached, self.num_tokens - 1)
        self.num_draft_cached = min(self.num_draft_cached, self.num_tokens - 1)
        self.num_featured = min(self.num_featured, self.num_cached)

    def reset_caches(self) -> None:
        """Preempted: its blocks are freed, so both caches start again from the prompt."""
        self.num_cached = self.num_draft_cached = self.num_draft_marked = self.num_featured = 0
        self.prefix_digests.clear()

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_decoding(self) -> bool:
        """All but the newest token are in the target's cache: the next forward is a decode."""
        return self.num_tokens - self.num_cached == 1

    @property
    def num_uncached(self) -> int:
        return self.num_tokens - self.num_cached

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
