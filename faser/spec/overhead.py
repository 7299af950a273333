"""What a real step costs beyond the cost profile: learned online, added to every prediction.

The profile times bare forwards at a short context. A served step also schedules, samples,
keeps per-request state and attends over each request's whole context, so it takes longer than
the profile says, and the more so the more requests it holds.
Part of that grows with the requests in the step whatever their k (scheduling, the decode's own
attention), part with the draft tokens verified: each verified token attends over its request's
whole context too, and one request's longer verification pads every request's queries in the
step's attention. With the first part alone the model priced speculation too cheap at high load:
the per-request part absorbed what verification cost, so plain steps were predicted far slower
than they ran, speculation looked cheap beside them, and faser's speculative steps came out as
slow as that prediction (`benchmarks.policies --step-trace` shows it step by step).

So each decode-only step's measured time minus the profile's prediction for what it ran is fitted
as `per_request_s * requests + per_draft_token_s * draft tokens`, by least squares over recent
steps (exponentially weighted), both terms kept non-negative; policies add it to every step they
predict. When every step verifies one token per request the two columns are proportional and
the residual is split between the terms (the smallest-norm fit). Steps with a prefill chunk are
left out: the profile's long forwards are priced on their own terms.

The draft-token term is learned only from the speculative steps a policy chose, and a policy stops
choosing them once the term says they do not pay: an estimate pushed up by a few noisy steps then
never met new evidence, and faser ran `off` for the rest of the run. So the term has a prior,
which weighs in as its evidence ages: while steps speculate it counts for nothing, and each plain
step since the last speculative one moves it toward `PRIOR_WEIGHT` of the evidence the
speculative steps gave (their mean squared draft tokens), as that evidence decays. After 20 to
40 plain steps the estimate is halfway to the prior, so that speculation is tried again where
the prior says it pays, and either confirmed or priced anew. The prior is that a draft token
costs beyond the profile what a request does (the plain steps keep measuring that): each
verified token attends over its request's whole context as the request's own token does. A prior
of no cost at all made faser retry speculation at loads where it cannot pay, each try a step
several times as long as a plain one.

The first step of each shape (target rows: requests plus draft tokens) also pays for warming up:
the kernels' first calls at a size plan and allocate. The engine's fit (`skip_cold_shapes`)
learns nothing from it: a cold first step can take several times as long as the next of its
shape, and that one step alone priced draft tokens so dear that faser ran `off` from then on. A
cost profile measured at start-up warms every shape it times; one read from the cache warms none.
"""

from __future__ import annotations

from dataclasses import dataclass

OVERHEAD_EMA = 0.05  # weight of the newest step: steps are noisy, the overhead moves slowly
RIDGE = 1e-3  # relative: keeps the fit defined when the two columns are proportional
PRIOR_WEIGHT = 0.2  # the draft-token term's prior, once aged, against its evidence when fresh


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

    __slots__ = ("_moments", "_token_scale", "_warm_rows", "estimate", "num_steps",
                 "num_token_steps", "steps_since_token")

    def __init__(self, skip_cold_shapes: bool = False) -> None:
        # target rows of the shapes seen once (None: every step is learned from)
        self._warm_rows: set[int] | None = set() if skip_cold_shapes else None
        # weighted means of n*n, n*d, d*d, n*r, d*r (n requests, d draft tokens, r residual)
        self._moments = [0.0] * 5
        self._token_scale = 0.0  # mean d*d of the speculative steps alone: the prior's unit
        self.estimate = NO_OVERHEAD
        self.num_steps = 0
        self.num_token_steps = 0
        self.steps_since_token = 0  # plain steps since the last one that verified a draft token

    @property
    def per_request_s(self) -> float:
        return self.estimate.per_request_s

    def observe(
        self, predicted_s: float, measured_s: float, num_requests: int, num_draft_tokens: int = 0
    ) -> None:
        num_draft_tokens = max(0, num_draft_tokens)
        if num_requests < 1 or self._is_cold(num_requests + num_draft_tokens):
            return
        n, d, r = float(num_requests), float(num_draft_tokens), measured_s - predicted_s
        # a running mean over the first steps, then an exponential one
        weight = max(OVERHEAD_EMA, 1.0 / (self.num_steps + 1))
        sample = (n * n, n * d, d * d, n * r, d * r)
        self._moments = [m + weight * (s - m) for m, s in zip(self._moments, sample, strict=True)]
        self.num_steps += 1
        if d > 0:
            self.num_token_steps += 1
            self.steps_since_token = 0
            weight = max(OVERHEAD_EMA, 1.0 / self.num_token_steps)
            self._token_scale += weight * (d * d - self._token_scale)
        else:
            self.steps_since_token += 1
        # the share of the window that plain steps have filled since the last speculative one
        aged = 1.0 - (1.0 - OVERHEAD_EMA) ** self.steps_since_token
        self.estimate = _fit(*self._moments, prior=PRIOR_WEIGHT * aged * self._token_scale)

    def _is_cold(self, rows: int) -> bool:
        if self._warm_rows is None or rows in self._warm_rows:
            return False
        self._warm_rows.add(rows)
        return True


def _fit(
    nn: float, nd: float, dd: float, nr: float, dr: float, prior: float = 0.0
) -> Overhead:
    """Ridge least squares of r on (n, d), with `prior` pulling the draft-token term toward the
    per-request one (a penalty prior * (per_token - per_request)**2), then each term kept >= 0
    (a profile that overprices steps is the safe side)."""
    ridge = RIDGE * (nn + dd)
    a_nn, a_dd, a_nd = nn + ridge + prior, dd + ridge + prior, nd - prior
    det = a_nn * a_dd - a_nd * a_nd
    per_request = (nr * a_dd - dr * a_nd) / det
    per_token = (dr * a_nn - nr * a_nd) / det
    if per_token < 0:
        per_request, per_token = nr / (nn + ridge), 0.0
    elif per_request < 0:
        per_request, per_token = 0.0, (dr / a_dd if dd > 0 else 0.0)
    return Overhead(max(0.0, per_request), max(0.0, per_token))
