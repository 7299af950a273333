"""What a request gives back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecStats:
    """Speculation figures of one request (or one engine, summed)."""

    num_steps: int = 0  # steps in which the request decoded (prefill excluded)
    num_drafts: int = 0  # steps in which it had k > 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_pruned_positions: int = 0  # target positions never computed thanks to early pruning
    num_slo_requests: int = 0  # finished requests that had an SLO (per request: 0 or 1)
    num_slo_met: int = 0  # those that met every target they had
    # engine-wide only (empty per request): [m] counts drafts whose position m was accepted,
    # as vLLM's num_accepted_tokens_per_pos; [k] counts request-steps that proposed k drafts
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_steps_per_k: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per decoding step (accepted + 1); 1.0 without speculation."""
        if self.num_steps == 0:
            return 0.0
        return (self.num_accepted_tokens + self.num_steps) / self.num_steps

    @property
    def slo_met(self) -> bool | None:
        """Per request: whether it met its SLO; None without one or before it finished."""
        return None if self.num_slo_requests == 0 else self.num_slo_met == self.num_slo_requests

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def count_step(self, k: int, num_accepted: int) -> None:
        """Adds one request-step with `k` drafts, of which the first `num_accepted` were kept, to
        the per-k and per-position counts (the engine's totals; lists grow with the largest k)."""
        _grow(self.num_steps_per_k, k + 1)
        self.num_steps_per_k[k] += 1
        _grow(self.num_accepted_tokens_per_pos, max(k, num_accepted))
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1

    @classmethod
    def total(cls, stats: list[SpecStats]) -> SpecStats:
        """The per-request counts of several requests summed (the choices of one API call)."""
        return cls(**{name: sum(getattr(s, name) for s in stats) for name in _COUNTS})

    def as_dict(self) -> dict[str, float]:
        return {
            "num_steps": self.num_steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_pruned_positions": self.num_pruned_positions,
            "mean_acceptance_length": self.mean_acceptance_length,
        }


_COUNTS = ("num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
           "num_pruned_positions", "num_slo_requests", "num_slo_met")


def _grow(counts: list[int], size: int) -> None:
    if len(counts) < size:
        counts.extend([0] * (size - len(counts)))


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The target's raw log-probability (log-softmax of its logits, before any sampling
    parameter) of one token, and of the likeliest tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), likeliest first


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    # "stop" | "length" | "abort" | "error" (the model's output for it was not finite: NaN or
    # infinite logits) | None while running
    finish_reason: str | None
    spec_stats: SpecStats = field(default_factory=SpecStats)
    new_token_ids: list[int] = field(default_factory=list)  # committed in the latest step
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first_token, finished times
    # one per output token when the request asked for logprobs; None otherwise
    logprobs: list[TokenLogprob] | None = None
    # one per prompt token (None for the first, which nothing predicts) when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
