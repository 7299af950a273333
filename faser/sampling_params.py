"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # alternatives a request may ask for at each position (OpenAI's chat cap)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it
# past any vocabulary, so no cut; bounded because the step holds every request's top_k in one
# int64 tensor, which one request's 10**30 would overflow, failing the whole batch's step
MAX_TOP_K = 2**31 - 1
# Logits divided by a temperature far below this (under 1e-38 a float32 temperature is 0 once
# denormals flush) or by a repetition penalty far outside its range overflow to inf, and the
# distribution to NaN, which no sampler can draw from. So, as vLLM does, a temperature below this
# samples greedily (its distribution is all but the argmax's anyway), and the penalty is bounded.
MIN_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-2, 1e2


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest (0: off)
    # OpenAI's, over the output so far: logit - frequency * count - presence * (count > 0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (as Hugging Face's), over prompt and output: a seen token's logit / p if > 0, else * p
    repetition_penalty: float = 1.0
    # OpenAI's: (token id, bias) pairs added to those tokens' logits before anything else samples
    # from them; a dict {token id: bias} is taken too
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # the target's raw log-probability of each output (prompt) token and of this many likeliest
    # alternatives at its position; None: none
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must lie in [0, {MAX_TOP_K}], got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must lie in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must lie in [-2, 2], got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must lie in [{MIN_REPETITION_PENALTY:g}, "
                             f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None")

    @property
    def greedy(self) -> bool:
        # a temperature of 0 (or below MIN_TEMPERATURE), or top_k 1, leaves the argmax alone
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def seeded(self) -> bool:
        """It samples with a seed: each token is a race keyed by the seed and the token's position
        (faser.layers.race), the same whatever speculation did before it."""
        return not self.greedy and self.seed is not None

    @property
    def by_argmax(self) -> bool:
        """Its tokens are argmaxes, of its logits (greedy) or of its races (seeded): its drafts
        are verified without their q rows or uniforms, by the greedy rule."""
        return self.greedy or self.seeded

    @property
    def penalised(self) -> bool:
        """Its logits depend on the tokens before them (so each row needs its own history)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def plain(self) -> bool:
        """It samples from the model's logits as they are: no penalty and no bias changes them."""
        return not self.penalised and not self.logit_bias


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    pairs = list(bias.items() if isinstance(bias, dict) else bias)
    for pair in pairs:
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise ValueError(f"logit_bias: (token id, bias) pairs, got {pair!r}")
        token_id, value = pair
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"logit_bias: token ids are integers >= 0, got {token_id!r}")
        if not (isinstance(value, int | float) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise ValueError(f"logit_bias: a bias lies in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}], got {value!r} for token {token_id}")
    if len({token_id for token_id, _ in pairs}) != len(pairs):
        raise ValueError("logit_bias: a token id is given twice")
    return tuple(sorted((token_id, float(value)) for token_id, value in pairs))
