"""Service-level objectives: the TTFT and TPOT promised per request, and the step limits that
SLO-aware speculation keeps to (the planner takes them as constraints).

- TTFT = first token - arrival and TPOT = (finish - first token) / (output tokens - 1); a request
  attains its SLO when it meets every target it was given.
- TPOT averages over the output, so a step need only be short enough for the tokens it commits:
  request i stays on track when the step's time tau <= D_i (1 + E_i(k_i)), D_i being what its
  remaining budget allows per token, so its own speculation relaxes its limit and everyone
  else's tightens it.
- A TTFT target caps the step in which the request's prefill ends, as none after it can help.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the request protocol imports SpecState, which holds an Slo
    from faser.spec_decode.request import SpecRequest

SLO_FIELDS = ("tpot_ms", "ttft_ms")
# a request behind its TPOT target catches up within this many tokens (or its remaining ones);
# one ahead spends its slack over all its remaining tokens, as later load is unknown
CATCH_UP_TOKENS = 32


@dataclass(frozen=True, slots=True)
class Slo:
    """A request's targets in seconds; None: no promise on that figure."""

    tpot_s: float | None = None
    ttft_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("tpot_s", "ttft_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"slo.{name} must be a positive number, got {value!r}")

    @classmethod
    def parse(cls, value: Mapping[str, object] | None) -> Slo | None:
        """A request's `slo: {"tpot_ms": ..., "ttft_ms": ...}`, None when it gives neither;
        ValueError naming the field."""
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ValueError(f"slo must be an object with {SLO_FIELDS}, got {value!r}")
        unknown = set(value) - set(SLO_FIELDS)
        if unknown:
            raise ValueError(f"slo: unknown fields {sorted(unknown)}; have {list(SLO_FIELDS)}")
        given = [value.get(name) for name in SLO_FIELDS]
        for name, ms in zip(SLO_FIELDS, given, strict=True):
            if ms is not None and (isinstance(ms, bool) or not isinstance(ms, int | float)):
                raise ValueError(f"slo.{name} must be a number, got {ms!r}")
            if ms is not None and not (math.isfinite(ms) and ms > 0):
                raise ValueError(f"slo.{name} must be > 0, got {ms!r}")
        if given == [None, None]:
            return None
        return cls(*(None if ms is None else float(ms) / 1e3 for ms in given))


def request_met(
    slo: Slo | None, arrival_s: float, first_token_s: float | None, finish_s: float | None,
    num_output_tokens: int,
) -> bool | None:
    """Whether a finished request met its SLO; None without one (or before it finished)."""
    if slo is None or slo == Slo() or first_token_s is None or finish_s is None:
        return None
    tpot = (finish_s - first_token_s) / (num_output_tokens - 1) if num_output_tokens > 1 else 0.0
    tpot_ok = slo.tpot_s is None or tpot <= slo.tpot_s
    return tpot_ok and (slo.ttft_s is None or first_token_s - arrival_s <= slo.ttft_s)


def tpot_deadline(
    tpot_s: float, now_s: float, first_token_s: float | None, num_output_tokens: int,
    max_tokens: int,
) -> float:
    """Seconds per committed token that this step may take and keep the request on its TPOT
    target by its last token: the budget left, (tokens so far + tokens left) * tpot - elapsed,
    spread over the tokens left (over CATCH_UP_TOKENS at most when behind). Negative when the
    request is so far behind that nothing this step can save it."""
    if first_token_s is None:
        return tpot_s
    done = max(0, num_output_tokens - 1)  # tokens since the first, the ones TPOT counts
    left = max(1, max_tokens - num_output_tokens)
    slack = done * tpot_s - (now_s - first_token_s)  # > 0: ahead of the target
    horizon = left if slack >= 0 else min(left, CATCH_UP_TOKENS)
    return tpot_s + slack / horizon


def tpot_deadlines(requests: Sequence[SpecRequest], now_s: float) -> list[float | None]:
    """`tpot_deadline` per decoding request; None for one with no TPOT target."""
    out: list[float | None] = []
    for seq in requests:
        tpot_s = seq.spec_state.slo.tpot_s if seq.spec_state.slo is not None else None
        out.append(None if tpot_s is None else tpot_deadline(
            tpot_s, now_s, seq.first_token_time, len(seq.output_token_ids), seq.params.max_tokens))
    return out


def ttft_step_limit(prefills: Sequence[tuple[SpecRequest, int]], now_s: float) -> float | None:
    """The longest this step may take so that every request whose prefill ends in it still gets
    its first token within its TTFT target; None when no such target is at stake (a target
    already missed is not one: nothing this step does can save it)."""
    limits = []
    for seq, num_tokens in prefills:
        slo = seq.spec_state.slo
        if slo is None or slo.ttft_s is None or seq.num_cached + num_tokens < seq.num_tokens:
            continue
        left = seq.arrival_time + slo.ttft_s - now_s
        if left > 0:
            limits.append(left)
    return min(limits) if limits else None
