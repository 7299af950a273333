"""The goodput model: expected committed tokens per second of a step, and the k vector and frontier
size that maximise it.

For request i with per-position acceptance probabilities a_{i,1..}, the survival probability of
draft position t is p_{i,t} = prod_{s<=t} a_{i,s} (position t is accepted only if all before it
are), and the expected accepted tokens for k drafts are E_i(k) = sum_{t<=k} p_{i,t}. A step commits
E_i(k_i) + 1 tokens per request (the +1 is the recovered or bonus token) and costs
C = draft time + target time, so goodput = sum_i (E_i(k_i) + 1) / C.
"""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from faser.spec.cost_model import CostProfile

_EPS = 1e-12


def survival(acceptance: Sequence[float]) -> list[float]:
    """p_t = prod_{s<=t} a_s, for t = 0 .. len-1."""
    out, p = [], 1.0
    for a in acceptance:
        p *= a
        out.append(p)
    return out


def expected_accepted(acceptance: Sequence[float], k: int) -> float:
    """E(k) = sum_{t<k} p_t: the expected accepted draft tokens when k are verified."""
    return sum(survival(acceptance[:k]))


def calibrate(confidences: Sequence[float], alpha: float, weight: float = 0.5) -> list[float]:
    """Per-position acceptance after drafting: a_t = weight * q_t + (1 - weight) * alpha.

    q_t, the draft's probability of its own token, knows which positions are easy but is
    overconfident exactly where the draft and the target disagree; alpha, the request's measured
    acceptance, knows how well the two models agree on this text but not which position is hard.
    A linear blend is exact when both say the same, falls back to either one when the other is
    uninformative, and stays a probability; weight 0 ignores the draft's confidence."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight must lie in [0, 1], got {weight}")
    return [_clip01(weight * q + (1.0 - weight) * alpha) for q in confidences]


class StepCost:
    """Predicted seconds of one step as draft tokens are added one by one.

    Draft step j runs over the requests with k_i > j, so it costs draft_time(b_j) with b_j those
    requests; the target verifies sum_i (k_i + 1) + prefill tokens in one forward. With `overlap`
    the two run on separate lanes and the step costs max(draft, target); with `sunk_draft_s` the
    drafting is done and its time is fixed (trimming after the draft)."""

    def __init__(
        self,
        cost: CostProfile,
        num_requests: int,
        num_prefill_tokens: int = 0,
        *,
        overlap: bool = False,
        sunk_draft_s: float | None = None,
    ) -> None:
        self.cost = cost
        self.overlap = overlap
        self.sunk_draft_s = sunk_draft_s
        self.num_target_tokens = num_requests + max(0, num_prefill_tokens)
        self.batch_per_position: list[int] = []  # b_j: requests drafting position j
        # the draft's extra seconds for one more request at each position, kept up to date so
        # that a marginal cost is arithmetic, not interpolation: the greedy asks for thousands
        self._draft_deltas: list[float] = []
        self._open_delta = self._delta(0)
        self.draft_s = 0.0 if sunk_draft_s is None else sunk_draft_s
        self.target_s = cost.target_time(self.num_target_tokens)
        self._next_target_s = cost.target_time(self.num_target_tokens + 1)
        self._total = self._combine(self.draft_s, self.target_s)

    def copy(self) -> StepCost:
        twin = copy.copy(self)
        twin.batch_per_position = list(self.batch_per_position)
        twin._draft_deltas = list(self._draft_deltas)
        return twin

    def total(self) -> float:
        return self._total

    def marginal(self, position: int) -> float:
        """Extra seconds if one more request drafts (and the target verifies) `position`."""
        deltas = self._draft_deltas
        delta = deltas[position] if position < len(deltas) else self._open_delta
        return self._combine(self.draft_s + delta, self._next_target_s) - self._total

    def add(self, position: int) -> None:
        if position == len(self.batch_per_position):
            self.batch_per_position.append(0)
            self._draft_deltas.append(self._open_delta)
        self.draft_s += self._draft_deltas[position]
        self.batch_per_position[position] += 1
        self._draft_deltas[position] = self._delta(self.batch_per_position[position])
        self.num_target_tokens += 1
        self.target_s = self._next_target_s
        self._next_target_s = self.cost.target_time(self.num_target_tokens + 1)
        self._total = self._combine(self.draft_s, self.target_s)

    def _delta(self, batch_size: int) -> float:
        if self.sunk_draft_s is not None:
            return 0.0
        return self.cost.draft_time(batch_size + 1) - self.cost.draft_time(batch_size)

    def _combine(self, draft_s: float, target_s: float) -> float:
        return max(draft_s, target_s) if self.overlap else draft_s + target_s


@dataclass(frozen=True, slots=True)
class KChoice:
    """The chosen k vector and what the model predicts for it."""

    ks: list[int]
    expected_accepted: list[float]  # E_i(k_i)
    step_time_s: float
    goodput: float  # tokens per second
    baseline_goodput: float  # with k = 0 for everyone

    @property
    def speculates(self) -> bool:
        return any(self.ks)


def choose_k(
    acceptance: Sequence[Sequence[float]],
    step_cost: StepCost,
    *,
    token_budget: int | None = None,
    max_step_time_s: float | None = None,
    min_gain: float = 0.0,
) -> KChoice:
    """The k vector maximising predicted goodput, k_i <= len(acceptance[i]).

    Draft tokens are added greedily by marginal gain (their survival probability) per marginal
    cost, and the best prefix of that order is kept. A token that rides for free (a draft step
    and a target forward already paid for) can crowd out a likelier one whose draft step is not,
    so the order by survival probability alone is walked too and the better prefix wins (alone,
    the first order fell up to 8 % short of the brute-force optimum on small random cases; the
    two together matched it on 1,500 of 1,500).
    k = 0 for all unless that beats no speculation by more than `min_gain` (relative).
    `token_budget` caps sum(k); `max_step_time_s` (a TPOT target, for SLO-aware serving) skips
    tokens that would push the step past it, the least gainful going first."""
    probs = [survival(a) for a in acceptance]
    n = len(probs)
    base_time = step_cost.total()
    baseline = n / base_time if base_time > 0 else 0.0
    best = _Walk([], 0, baseline * (1.0 + min_gain))
    for by_cost in (True, False):
        walk = _greedy_walk(
            probs, step_cost.copy(), token_budget, max_step_time_s, by_cost, best.best_goodput
        )
        if walk.best_len:
            best = walk
    ks = [0] * n
    for i, _, _ in best.order[: best.best_len]:
        ks[i] += 1
    time_s = best.order[best.best_len - 1][2] if best.best_len else base_time
    expected = [sum(p[:k]) for p, k in zip(probs, ks, strict=True)]
    goodput = (n + sum(expected)) / time_s if time_s > 0 else 0.0
    return KChoice(ks, expected, time_s, goodput, baseline)


class _Walk(NamedTuple):
    order: list[tuple[int, int, float]]  # (request, position, step seconds once it is added)
    best_len: int  # the best prefix of `order`
    best_goodput: float


def _greedy_walk(
    probs: list[list[float]],
    step_cost: StepCost,
    token_budget: int | None,
    max_step_time_s: float | None,
    by_cost: bool,
    floor: float,
) -> _Walk:
    """Adds draft tokens in the greedy order (survival probability per marginal cost, or
    survival probability alone) and finds the best prefix above `floor` goodput.

    All candidates at the same draft position share the same marginal cost, so one heap per
    position (by survival probability) suffices: each pick compares only the heads. Costs never
    fall as tokens are added, so the walk stops once even all the remaining gain at today's cost
    could not beat the best prefix."""
    heaps: list[list[tuple[float, int]]] = []
    for i, p in enumerate(probs):
        if p:
            _push(heaps, 0, p[0], i)
    n, remaining = len(probs), sum(sum(p) for p in probs)
    order: list[tuple[int, int, float]] = []
    best_len, best, gained = 0, floor, 0.0
    limit = math.inf if token_budget is None else max(0, token_budget)
    while len(order) < limit and (n + gained + remaining) > best * step_cost.total():
        position = _best_head(heaps, step_cost, by_cost)
        if position is None:
            break
        _, i = heapq.heappop(heaps[position])
        if max_step_time_s is not None and (
            step_cost.total() + step_cost.marginal(position) > max_step_time_s
        ):
            remaining -= sum(probs[i][position:])
            continue  # this request's later positions would cost at least as much
        step_cost.add(position)
        gained += probs[i][position]
        remaining -= probs[i][position]
        order.append((i, position, step_cost.total()))
        if (n + gained) > best * (1.0 + 1e-9) * step_cost.total():
            best_len, best = len(order), (n + gained) / step_cost.total()
        if position + 1 < len(probs[i]):
            _push(heaps, position + 1, probs[i][position + 1], i)
    return _Walk(order, best_len, best)


def _push(heaps: list[list[tuple[float, int]]], position: int, p: float, i: int) -> None:
    while len(heaps) <= position:
        heaps.append([])
    heapq.heappush(heaps[position], (-p, i))


def _best_head(
    heaps: list[list[tuple[float, int]]], step_cost: StepCost, by_cost: bool
) -> int | None:
    best, best_ratio = None, -1.0
    for position, heap in enumerate(heaps):
        if heap:
            cost = max(step_cost.marginal(position), _EPS) if by_cost else 1.0
            ratio = -heap[0][0] / cost
            if ratio > best_ratio:  # strict: ties go to the earlier position, spreading k
                best, best_ratio = position, ratio
    return best


def expected_verify_time(
    ks: Sequence[int],
    acceptance: Sequence[Sequence[float]],
    frontier_size: int,
    cost: CostProfile,
    num_prefill_tokens: int = 0,
) -> float:
    """Expected target seconds to verify `ks` in frontiers of `frontier_size` draft positions.

    Frontier j feeds positions [j f, (j+1) f) of the requests still alive (all earlier positions
    accepted), plus the bonus input in a request's last frontier; prefill rides in frontier 0.
    A frontier runs only if some request is alive, so it costs P(any alive) * t(E[tokens | any])."""
    if frontier_size < 1:
        raise ValueError(f"frontier_size must be >= 1, got {frontier_size}")
    probs = [survival(a[:k]) for a, k in zip(acceptance, ks, strict=True)]
    num_frontiers = max(1, math.ceil(max(ks, default=0) / frontier_size))
    total = 0.0
    for j in range(num_frontiers):
        tokens, p_none = (max(0, num_prefill_tokens) if j == 0 else 0.0), 1.0
        for p, k in zip(probs, ks, strict=True):
            start = j * frontier_size
            if start > k or (start == k and j > 0):
                continue
            alive = 1.0 if start == 0 else p[start - 1]
            last = start + frontier_size >= k
            tokens += alive * (min(frontier_size, k - start) + (1 if last else 0))
            p_none *= 1.0 - alive
        p_any = 1.0 - p_none if j > 0 else 1.0
        if p_any > _EPS:
            total += p_any * cost.target_time(tokens / p_any)
    return total


def choose_frontier_size(
    ks: Sequence[int],
    acceptance: Sequence[Sequence[float]],
    cost: CostProfile,
    num_prefill_tokens: int = 0,
) -> int | None:
    """The frontier size minimising the expected verify time; None for one frontier.

    Below the knee the target is memory-bound: every extra forward costs a whole step's fixed
    overhead and pruning saves nothing, so one frontier. Past it, pruning saves real work and the
    sizes are compared by their expected cost (ties go to fewer frontiers)."""
    max_k = max(ks, default=0)
    if max_k <= 1:
        return None
    num_tokens = sum(k + 1 for k in ks) + max(0, num_prefill_tokens)
    if num_tokens <= cost.knee():
        return None
    best_f, best_time = max_k, expected_verify_time(ks, acceptance, max_k, cost, num_prefill_tokens)
    for f in range(max_k - 1, 0, -1):
        time_s = expected_verify_time(ks, acceptance, f, cost, num_prefill_tokens)
        if time_s < best_time * (1.0 - 1e-9):
            best_f, best_time = f, time_s
    return None if best_f >= max_k else best_f


def _clip01(x: float) -> float:
    return min(1.0, max(0.0, x))
