"""A request's service-level objective: the TTFT and TPOT it was promised, and whether it met
them. TTFT = first token - arrival and TPOT = (finish - first token) / (output tokens - 1); a
request attains its SLO when it meets every target it was given."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

SLO_FIELDS = ("tpot_ms", "ttft_ms")


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

    def as_ms(self) -> dict[str, float]:
        """The targets given, as a request's `slo` field writes them."""
        targets = {"tpot_ms": self.tpot_s, "ttft_ms": self.ttft_s}
        return {name: s * 1e3 for name, s in targets.items() if s is not None}

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        """Whether a request with these figures met every target given."""
        tpot_ok = self.tpot_s is None or tpot_s <= self.tpot_s
        return tpot_ok and (self.ttft_s is None or ttft_s <= self.ttft_s)


def request_met(
    slo: Slo | None, arrival_s: float, first_token_s: float | None, finish_s: float | None,
    num_output_tokens: int,
) -> bool | None:
    """Whether a finished request met its SLO; None without one (or before it finished)."""
    if slo is None or slo == Slo() or first_token_s is None or finish_s is None:
        return None
    tpot = (finish_s - first_token_s) / (num_output_tokens - 1) if num_output_tokens > 1 else 0.0
    return slo.met(first_token_s - arrival_s, tpot)
