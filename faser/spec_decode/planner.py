"""The planner: the k vector that maximises a step's goodput under its limits, and the frontier size
that verifies it most cheaply.

- Draft position t of request i survives with p_{i,t} = prod_{s<=t} a_{i,s}, since it is accepted
  only if all before it are, so k_i drafts add E_i(k_i) = sum_{t<=k_i} p_{i,t} expected tokens to
  the one every request commits.
- Goodput = sum_i (1 + E_i(k_i)) / (T(k) - P), P being what the step's prefill adds at k = 0:
  the prefill runs whatever k is, and beside a 400 ms prefill any drafting would look cheap.
- A walk adds the candidate tokens in an order, pricing the step as it goes, and keeps the best
  prefix, so that planning stays linear in the tokens. Two orders: by survival, and, while the
  drafts are still to be made, breadth first (every request's first token before anyone's
  second), since a draft forward costs about the same for one request as for a few, and by
  survival alone one request's second token can come before the others' first, so that no
  prefix drafts one token for each. Once drafted, each token costs only its verified row, and
  the order by survival holds every optimum.
- The limits constrain that prefix: a token budget, a step-time cap (the TTFT of the prefills
  ending in the step) and TPOT deadlines T <= D_i (1 + E_i(k_i)) (faser.spec_decode.slo); when
  no prefix keeps them all, the closest wins.
- Frontiers verify the drafts in several forwards, so that a rejection prunes the positions after
  it; this pays only past the target's knee, where a forward's cost grows with its tokens.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import NamedTuple

from faser.spec_decode.cost_model import CostModel


@dataclass(frozen=True, slots=True)
class Limits:
    token_budget: int | None = None  # target rows still free for draft tokens
    max_step_time_s: float | None = None
    tpot_deadlines_s: tuple[float | None, ...] | None = None  # per request; None: no target


NO_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class Choice:
    ks: tuple[int, ...]
    expected_accepted: tuple[float, ...]  # E_i(k_i)
    step_time_s: float
    goodput: float  # committed tokens per second
    baseline_goodput: float  # with k = 0 for everyone
    meets_limits: bool = True


def survival(acceptance: Sequence[float]) -> list[float]:
    """p_t = prod_{s<=t} a_s."""
    return list(accumulate((min(1.0, max(0.0, a)) for a in acceptance), operator.mul))


def choose_k(
    acceptance: Sequence[Sequence[float]], cost: CostModel, num_prefill_tokens: int = 0,
    limits: Limits = NO_LIMITS, *, drafted: bool = False, draft_lags: Sequence[float] = (),
) -> Choice:
    """The k vector with the best goodput, k_i <= len(acceptance[i]). `drafted`: the drafts exist
    (trimming), so only their verification costs. `draft_lags[i]`: the draft rows request i's
    first draft token pays for (more than 1 while its draft catches up). With TPOT deadlines a
    third walk takes the tightest deadlines' tokens first, as no prefix of the other walks may
    keep the deadline of a request that is behind."""
    probs = [survival(a) for a in acceptance]
    n = len(probs)
    if limits.tpot_deadlines_s is not None and len(limits.tpot_deadlines_s) != n:
        raise ValueError(f"tpot_deadlines_s: {len(limits.tpot_deadlines_s)} for {n} requests")
    candidates = [(p, t, i) for i, ps in enumerate(probs) for t, p in enumerate(ps)]
    orders = [sorted(candidates, key=lambda c: (-c[0], c[1]))]  # by survival
    if n > 1 and not drafted:  # drafts to make: their forwards cost per depth, not per token
        orders.append(sorted(candidates, key=lambda c: (c[1], -c[0])))  # breadth first
    # the target's price at each count of draft rows, once for every walk
    verify = [cost.verify_time(n, r, max(0, num_prefill_tokens))
              for r in range(len(candidates) + 1)]
    fresh = partial(_Step, cost, n, num_prefill_tokens, drafted, verify, draft_lags)
    base = fresh()
    deadlines = _savable(limits.tpot_deadlines_s, probs, base.total())
    if deadlines:
        tightness = {i: d for i, d in deadlines}
        orders.append(sorted(candidates, key=lambda c: (tightness.get(c[2], math.inf), -c[0])))
    budget = len(candidates) if limits.token_budget is None else max(0, limits.token_budget)
    walks = [_walk(order[:budget], probs, fresh(), limits, deadlines) for order in orders]
    best = max(walks, key=lambda w: (w.margin >= 1.0, w.goodput if w.margin >= 1.0 else w.margin))
    ks = [0] * n
    for _, _, i in best.taken:
        ks[i] += 1
    expected = tuple(sum(p[:k]) for p, k in zip(probs, ks, strict=True))
    decode_s = best.time_s - base.prefill_s
    goodput = (n + sum(expected)) / decode_s if decode_s > 0 else 0.0
    baseline = n / base.decode_total() if n else 0.0
    return Choice(tuple(ks), expected, best.time_s, goodput, baseline, best.margin >= 1.0)


class _Walk(NamedTuple):
    taken: list[tuple[float, int, int]]  # the best prefix of the order
    goodput: float
    margin: float  # >= 1: every limit kept
    time_s: float


def _walk(order, probs, step: _Step, limits: Limits, deadlines) -> _Walk:
    """The best prefix of `order`: the best goodput among those that keep every limit, else the
    one that comes closest."""
    n = len(probs)
    gains, gained = [0.0] * n, 0.0
    remaining = sum(p for p, _, _ in order)
    time_s = step.total()
    decode_s = time_s - step.prefill_s
    best = _Walk([], n / decode_s if decode_s > 0 else 0.0,
                 _margin(limits, deadlines, gains, time_s), time_s)
    best_len = 0
    for length, (p, t, i) in enumerate(order, start=1):
        # once a draft token is in (the first may make the target's price a verification's,
        # not always dearer), times only grow: stop when not even every remaining token would win
        bound = (n + gained + remaining) <= best.goodput * decode_s
        if step.speculative and best.margin >= 1.0 and bound:
            break
        step.add(t, i)
        gains[i] += p
        gained += p
        remaining -= p
        time_s = step.total()
        decode_s = time_s - step.prefill_s
        margin = _margin(limits, deadlines, gains, time_s)
        goodput = (n + gained) / decode_s
        if margin >= 1.0:
            better = best.margin < 1.0 or goodput > best.goodput * (1.0 + 1e-9)
        else:
            better = margin > best.margin
        if better:
            best, best_len = _Walk([], goodput, margin, time_s), length
    return best._replace(taken=order[:best_len])


class _Step:
    """A step's predicted seconds as draft tokens are added: draft forward j runs over the
    requests with k_i > j (the first also over the tokens their drafts lag behind), then the
    target verifies every k_i + 1 rows and the prefill in one forward."""

    __slots__ = ("cost", "draft_batches", "draft_costs", "draft_s", "drafted", "lags",
                 "num_prefill", "num_requests", "prefill_s", "rows", "verify")

    def __init__(
        self, cost: CostModel, num_requests: int, num_prefill: int, drafted: bool,
        verify: Sequence[float], lags: Sequence[float] = (),
    ) -> None:
        """`verify[r]`: the target's forward with r draft rows (CostModel.verify_time)."""
        self.cost, self.drafted, self.lags, self.verify = cost, drafted, lags, verify
        self.num_requests, self.num_prefill = num_requests, max(0, num_prefill)
        self.rows = num_requests
        self.draft_batches: list[float] = []  # requests (and lags) per draft forward
        self.draft_costs: list[float] = []  # each forward's price so far
        self.draft_s = 0.0
        self.prefill_s = 0.0
        if self.num_prefill:
            self.prefill_s = verify[0] - cost.verify_time(num_requests)

    def add(self, position: int, request: int) -> None:
        first = position == 0
        if position == len(self.draft_batches):
            self.draft_batches.append(0.0)
            self.draft_costs.append(self.cost.draft_time(0.0, first))
        b = self.draft_batches[position] + (
            max(1.0, self.lags[request]) if first and request < len(self.lags) else 1.0)
        if not self.drafted:
            price = self.cost.draft_time(b, first)
            self.draft_s += price - self.draft_costs[position]
            self.draft_costs[position] = price
        self.draft_batches[position] = b
        self.rows += 1

    @property
    def speculative(self) -> bool:
        """Whether a draft token is in the step (the target then verifies, not decodes)."""
        return self.rows > self.num_requests

    def total(self) -> float:
        return self.draft_s + self.verify[self.rows - self.num_requests]

    def decode_total(self) -> float:
        return self.total() - self.prefill_s


def _savable(
    deadlines: Sequence[float | None] | None, probs: list[list[float]], base_time_s: float
) -> list[tuple[int, float]]:
    """(request, deadline) of the TPOT deadlines worth keeping: one that not even the request's
    full speculation at the plainest step could meet would only slow everyone down."""
    if deadlines is None:
        return []
    return [
        (i, d) for i, d in enumerate(deadlines)
        if d is not None and d * (1.0 + sum(probs[i])) >= base_time_s
    ]


def _margin(
    limits: Limits, deadlines: list[tuple[int, float]], gains: list[float], time_s: float
) -> float:
    """How many times over the tightest limit covers the step (>= 1: every limit kept)."""
    if time_s <= 0:
        return math.inf
    margin = math.inf
    if limits.max_step_time_s is not None:
        margin = limits.max_step_time_s / time_s
    for i, d in deadlines:
        margin = min(margin, d * (1.0 + gains[i]) / time_s)
    return margin


def expected_verify_time(
    ks: Sequence[int], acceptance: Sequence[Sequence[float]], frontier_size: int,
    cost: CostModel, num_prefill_tokens: int = 0,
) -> float:
    """Expected target seconds to verify `ks` in frontiers of `frontier_size` draft positions:
    frontier j feeds positions [j f, (j+1) f) of the requests still alive (all earlier positions
    accepted), plus the bonus input in a request's last frontier; prefill rides in frontier 0.
    A frontier runs only if some request is alive, so it costs P(any alive) * t(E[tokens | any])."""
    if frontier_size < 1:
        raise ValueError(f"frontier_size must be >= 1, got {frontier_size}")
    probs = [survival(a[:k]) for a, k in zip(acceptance, ks, strict=True)]
    num_frontiers = max(1, math.ceil(max(ks, default=0) / frontier_size))
    total = 0.0
    for j in range(num_frontiers):
        start = j * frontier_size
        tokens, p_none = (max(0, num_prefill_tokens) if j == 0 else 0.0), 1.0
        for p, k in zip(probs, ks, strict=True):
            if start > k or (start == k and j > 0):
                continue
            alive = 1.0 if start == 0 else p[start - 1]
            last = start + frontier_size >= k
            tokens += alive * (min(frontier_size, k - start) + int(last))
            p_none *= 1.0 - alive
        p_any = 1.0 - p_none if j > 0 else 1.0
        if p_any > 1e-12:
            total += p_any * cost.profile.target_time(tokens / p_any)
    return total


def choose_frontier_size(
    ks: Sequence[int], acceptance: Sequence[Sequence[float]], cost: CostModel,
    num_prefill_tokens: int = 0,
) -> int | None:
    """The frontier size with the least expected verify time; None for one frontier. Below the
    knee every extra forward costs a whole step and pruning saves nothing: one frontier."""
    max_k = max(ks, default=0)
    num_tokens = sum(k + 1 for k in ks) + max(0, num_prefill_tokens)
    if max_k <= 1 or num_tokens <= cost.profile.knee():
        return None
    best_f = max_k
    best_time = expected_verify_time(ks, acceptance, max_k, cost, num_prefill_tokens)
    for f in range(max_k - 1, 0, -1):
        time_s = expected_verify_time(ks, acceptance, f, cost, num_prefill_tokens)
        if time_s < best_time * (1.0 - 1e-9):
            best_f, best_time = f, time_s
    return None if best_f >= max_k else best_f
