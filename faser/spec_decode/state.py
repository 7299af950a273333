"""Per-request speculation state that survives across steps."""

from __future__ import annotations

from dataclasses import dataclass

from faser.slo import Slo


@dataclass(slots=True)
class SpecState:
    alpha: float  # the acceptance estimate of its next draft token (faser.spec_decode.estimator)
    policy: str  # the request's own policy (its override, else the engine's)
    max_k: int  # the request's cap on k
    accepted: float = 0.0  # its verified trials, decayed: accepted ones
    trials: float = 0.0  # and all of them
    observed_at: int = 0  # the estimator's step when they were last updated
    k: int = 0  # the current k of stateful policies (heuristic)
    slo: Slo | None = None  # the request's TTFT / TPOT targets, if it has any
    # its draft's confidences are on the calibration's scale (greedy; a sampled request's are
    # the chances of tokens drawn at its temperature)
    greedy: bool = True
