"""Service-level objectives: the time to first token (TTFT) and the time per output token (TPOT)
promised per request, and the step limits that SLO-aware speculation keeps to (the planner takes
them as constraints).

TTFT = first token - arrival; TPOT = (finish - first token) / (output tokens - 1). A request
attains its SLO when it meets every target it was given.

TPOT is an average over the whole output, so a step need not be shorter than the target: it must
be short enough for the tokens it commits. Request i is on track after this step when the step's
time tau satisfies tau <= D_i * (1 + E_i(k_i)): D_i is what its remaining budget allows per token
(`tpot_deadline`) and 1 + E_i(k_i) the tokens it expects to commit. Its own speculation relaxes
its constraint, everyone else's tightens it: that is why the requests that gain least are trimmed
first and the ones behind their target are favoured.
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
    def from_ms(cls, tpot_ms: float | None = None, ttft_ms: float | None = None) -> Slo | None:
        """From milliseconds, as the API and the command line give them; None when neither is."""
        for name, value in zip(SLO_FIELDS, (tpot_ms, ttft_ms), strict=True):
            _check_ms(name, value)
        if tpot_ms is None and ttft_ms is None:
            return None
        return cls(_seconds(tpot_ms), _seconds(ttft_ms))

    @classmethod
    def parse(cls, value: Mapping[str, object] | None) -> Slo | None:
        """A request's `slo: {"tpot_ms": ..., "ttft_ms": ...}`; ValueError naming the field."""
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ValueError(f"slo must be an object with {SLO_FIELDS}, got {value!r}")
        unknown = set(value) - set(SLO_FIELDS)
        if unknown:
            raise ValueError(f"slo: unknown fields {sorted(unknown)}; have {list(SLO_FIELDS)}")
        return cls.from_ms(value.get("tpot_ms"), value.get("ttft_ms"))  # type: ignore[arg-type]

    @property
    def given(self) -> bool:
        return self.tpot_s is not None or self.ttft_s is not None

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        tpot_ok = self.tpot_s is None or tpot_s <= self.tpot_s
        ttft_ok = self.ttft_s is None or ttft_s <= self.ttft_s
        return tpot_ok and ttft_ok


def _check_ms(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"slo.{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"slo.{name} must be > 0, got {value!r}")


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else float(ms) / 1e3


def request_met(
    slo: Slo | None,
    arrival_s: float,
    first_token_s: float | None,
    finish_s: float | None,
    num_output_tokens: int,
) -> bool | None:
    """Whether a finished request met its SLO; None without one (or before it finished)."""
    if slo is None or not slo.given or first_token_s is None or finish_s is None:
        return None
    tpot = (finish_s - first_token_s) / (num_output_tokens - 1) if num_output_tokens > 1 else 0.0
    return slo.met(first_token_s - arrival_s, tpot)


def tpot_deadline(
    tpot_s: float,
    now_s: float,
    first_token_s: float | None,
    num_output_tokens: int,
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
        slo = seq.spec_state.slo
        if slo is None or slo.tpot_s is None:
            out.append(None)
            continue
        out.append(
            tpot_deadline(
                slo.tpot_s, now_s, seq.first_token_time, len(seq.output_token_ids),
                seq.params.max_tokens,
            )
        )
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
