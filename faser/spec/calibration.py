"""How often a draft token of confidence q is accepted, learned from every verified position.

The draft's probability of its own token orders positions by difficulty but is no acceptance
rate: a small draft is unsure of tokens the target still takes (its top-1 is often accepted at
confidences where it claims far less), and a looked-up token carries a fixed precision.
Trimming on raw confidences cut tokens that would have paid. Each verified request is a run of
trials: the positions before the first rejection were accepted, the rejected one was not, those
after it were never judged. Counts by bins of q, with a prior of a few pseudo-trials at q itself,
so that an unseen bin answers q.
"""

from __future__ import annotations

from collections.abc import Sequence

NUM_BINS = 10
PRIOR_TRIALS = 4.0


class ConfidenceCalibration:
    __slots__ = ("accepted", "trials")

    def __init__(self) -> None:
        self.accepted = [0.0] * NUM_BINS
        self.trials = [0.0] * NUM_BINS

    def observe(
        self, confidences: Sequence[float], num_accepted: int, skip: Sequence[bool] = ()
    ) -> None:
        """One request's verified drafts: their confidences and how many were accepted;
        positions whose `skip` is true are left out (tokens from another source)."""
        for t, q in enumerate(confidences[: num_accepted + 1]):
            if t < len(skip) and skip[t]:
                continue
            b = _bin(q)
            self.trials[b] += 1.0
            self.accepted[b] += 1.0 if t < num_accepted else 0.0

    def __call__(self, q: float) -> float:
        """The acceptance rate of tokens drafted with confidence q."""
        b = _bin(q)
        return (self.accepted[b] + PRIOR_TRIALS * q) / (self.trials[b] + PRIOR_TRIALS)


def _bin(q: float) -> int:
    return min(NUM_BINS - 1, max(0, int(q * NUM_BINS)))
