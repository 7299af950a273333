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

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per decoding step (accepted + 1); 1.0 without speculation."""
        if self.num_steps == 0:
            return 0.0
        return (self.num_accepted_tokens + self.num_steps) / self.num_steps

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "num_steps": self.num_steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_pruned_positions": self.num_pruned_positions,
            "mean_acceptance_length": self.mean_acceptance_length,
        }


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    spec: SpecStats = field(default_factory=SpecStats)
    new_token_ids: list[int] = field(default_factory=list)  # committed in the latest step
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first_token, finished times
