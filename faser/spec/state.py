"""Per-request speculation state that survives across steps."""

from __future__ import annotations

from dataclasses import dataclass

from faser.spec.slo import Slo


@dataclass(slots=True)
class SpecState:
    alpha: float  # EMA estimate of P(next draft token accepted), from the global prior
    policy: str  # the request's own policy (its override, else the engine's)
    max_k: int  # the request's cap on k
    k: int = 0  # the current k of stateful policies (heuristic)
    last_k: int = 0
    last_num_accepted: int = 0
    slo: Slo | None = None  # the request's TTFT / TPOT targets, if it has any
