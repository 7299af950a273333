"""What a real step costs beyond the cost profile: learned online, added to every prediction.

The profile times bare forwards at a short context. A served step also schedules, samples,
keeps per-request state and attends over each request's whole context: on this CPU a decode step
of 16 requests took about 85 ms where the profile said 61-66, one of 32 about 135 where it said 78.
Part of that grows with the requests in the step whatever their k (scheduling, the decode's own
attention), part with the draft tokens verified: each verified token attends over its request's
whole context too, and one request's longer verification pads every request's queries in the
step's attention. With the first part alone the model priced speculation too cheap at high load:
at 32 requests the per-request part grew to 12 ms a request, so a plain step was predicted at
460 ms (plain steps took about 150) and speculation looked cheap beside it; faser chose k = 1.7 on
average and its steps took 450 ms (`benchmarks.policies --step-trace`).

So each decode-only step's measured time minus the profile's prediction for what it ran is fitted
as `per_request_s * requests + per_draft_token_s * draft tokens`, by least squares over recent
steps (exponentially weighted), both terms kept non-negative; policies add it to every step they
predict. When every step verifies one token per request the two columns are proportional and
the residual is split between the terms (the smallest-norm fit). Steps with a prefill chunk are
left out: the profile's long forwards are priced on their own terms.
"""

from __future__ import annotations

from dataclasses import dataclass

OVERHEAD_EMA = 0.05  # weight of the newest step: steps are noisy, the overhead moves slowly
RIDGE = 1e-3  # relative: keeps the fit defined when the two columns are proportional


@dataclass(frozen=True, slots=True)
class Overhead:
    """Seconds a real step takes beyond the profile's forwards."""

    per_request_s: float = 0.0
    per_draft_token_s: float = 0.0

    def seconds(self, num_requests: int, num_draft_tokens: int = 0) -> float:
        return self.per_request_s * num_requests + self.per_draft_token_s * num_draft_tokens


NO_OVERHEAD = Overhead()


class StepOverhead:
    """The running fit; `estimate` is the current Overhead."""

    __slots__ = ("_moments", "estimate", "num_steps")

    def __init__(self) -> None:
        # weighted means of n*n, n*d, d*d, n*r, d*r (n requests, d draft tokens, r residual)
        self._moments = [0.0] * 5
        self.estimate = NO_OVERHEAD
        self.num_steps = 0

    @property
    def per_request_s(self) -> float:
        return self.estimate.per_request_s

    def observe(
        self, predicted_s: float, measured_s: float, num_requests: int, num_draft_tokens: int = 0
    ) -> None:
        if num_requests < 1:
            return
        n, d, r = float(num_requests), float(max(0, num_draft_tokens)), measured_s - predicted_s
        # a running mean over the first steps, then an exponential one
        weight = max(OVERHEAD_EMA, 1.0 / (self.num_steps + 1))
        sample = (n * n, n * d, d * d, n * r, d * r)
        self._moments = [m + weight * (s - m) for m, s in zip(self._moments, sample, strict=True)]
        self.num_steps += 1
        self.estimate = _fit(*self._moments)


def _fit(nn: float, nd: float, dd: float, nr: float, dr: float) -> Overhead:
    """Ridge least squares of r on (n, d), then each term kept >= 0 (a profile that overprices
    steps is the safe side)."""
    ridge = RIDGE * (nn + dd)
    a_nn, a_dd = nn + ridge, dd + ridge
    det = a_nn * a_dd - nd * nd
    per_request = (nr * a_dd - dr * nd) / det
    per_token = (dr * a_nn - nr * nd) / det
    if per_token < 0:
        per_request, per_token = nr / a_nn, 0.0
    elif per_request < 0:
        per_request, per_token = 0.0, (dr / a_dd if dd > 0 else 0.0)
    return Overhead(max(0.0, per_request), max(0.0, per_token))
