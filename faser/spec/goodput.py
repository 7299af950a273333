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
from faser.spec.deadlines import Allowances
from faser.spec.overhead import NO_OVERHEAD, Overhead

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


# share of the drafting that an overlapped step still waits for (see StepCost._combine); measured
# on the tick pipeline of faser/spec/overlap.py, drafting was rarely hidden by more than half
OVERLAP_EXPOSED_DRAFT = 0.5


class StepCost:
    """Predicted seconds of one step as draft tokens are added one by one.

    Draft step j runs over the requests with k_i > j, so it costs draft_time(b_j) with b_j those
    requests; the target verifies sum_i (k_i + 1) + prefill tokens in one forward. With `overlap`
    the two run on separate lanes and only part of the drafting hides behind the target (see
    `_combine`); with `sunk_draft_s` the
    drafting is done and its time is fixed (trimming after the draft); `overhead` prices the rest
    of a real step (scheduling, sampling, long contexts): per request, and per draft token."""

    def __init__(
        self,
        cost: CostProfile,
        num_requests: int,
        num_prefill_tokens: int = 0,
        *,
        overlap: bool = False,
        sunk_draft_s: float | None = None,
        overhead: Overhead = NO_OVERHEAD,
    ) -> None:
        self.cost = cost
        self.overlap = overlap
        self.sunk_draft_s = sunk_draft_s
        # the step's time beyond its forwards (faser.spec.overhead); grows with each draft token
        self.overhead_s = overhead.seconds(max(0, num_requests))
        self._token_overhead_s = overhead.per_draft_token_s
        self.num_target_tokens = num_requests + max(0, num_prefill_tokens)
        self.batch_per_position: list[int] = []  # b_j: requests drafting position j
        # the draft's extra seconds for one more request at each position, kept up to date so
        # that a marginal cost is arithmetic, not interpolation: the greedy asks for thousands
        self._draft_deltas: list[float] = []
        self._open_delta = self._delta(0)
        self.draft_s = 0.0 if sunk_draft_s is None else sunk_draft_s
        # overlapped, each model runs on its lane, with a smaller share of the device
        self.target_s = cost.target_time(self.num_target_tokens, lane=overlap)
        self._next_target_s = cost.target_time(self.num_target_tokens + 1, lane=overlap)
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
        extra = self._combine(self.draft_s + delta, self._next_target_s) - self._total
        return extra + self._token_overhead_s

    def add(self, position: int) -> None:
        if position == len(self.batch_per_position):
            self.batch_per_position.append(0)
            self._draft_deltas.append(self._open_delta)
        self.draft_s += self._draft_deltas[position]
        self.batch_per_position[position] += 1
        self._draft_deltas[position] = self._delta(self.batch_per_position[position])
        self.num_target_tokens += 1
        self.overhead_s += self._token_overhead_s
        self.target_s = self._next_target_s
        self._next_target_s = self.cost.target_time(self.num_target_tokens + 1, lane=self.overlap)
        self._total = self._combine(self.draft_s, self.target_s)

    def _delta(self, batch_size: int) -> float:
        if self.sunk_draft_s is not None:
            return 0.0
        lane = self.overlap
        return self.cost.draft_time(batch_size + 1, lane=lane) - self.cost.draft_time(
            batch_size, lane=lane
        )

    def _combine(self, draft_s: float, target_s: float) -> float:
        if not self.overlap:
            return self.overhead_s + draft_s + target_s
        # in the overlapped pipeline the first frontier's drafts (and any not carried over from
        # the previous step's post-verify) are still on the critical path: only the rest of the
        # drafting hides behind verification
        exposed = OVERLAP_EXPOSED_DRAFT * draft_s
        return self.overhead_s + exposed + max(draft_s - exposed, target_s)


@dataclass(frozen=True, slots=True)
class KChoice:
    """The chosen k vector and what the model predicts for it."""

    ks: list[int]
    expected_accepted: list[float]  # E_i(k_i)
    step_time_s: float
    goodput: float  # tokens per second
    baseline_goodput: float  # with k = 0 for everyone
    meets_deadlines: bool = True  # False: no k vector keeps every TPOT deadline

    @property
    def speculates(self) -> bool:
        return any(self.ks)


def choose_k(
    acceptance: Sequence[Sequence[float]],
    step_cost: StepCost,
    *,
    token_budget: int | None = None,
    max_step_time_s: float | None = None,
    tpot_deadlines_s: Sequence[float | None] | None = None,
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
    `token_budget` caps sum(k); `max_step_time_s` (a TTFT limit, for SLO-aware serving) skips
    tokens that would push the step past it, the least gainful going first.
    `tpot_deadlines_s[i]` (seconds per committed token, None: no target) asks for a step time
    tau <= D_i (1 + E_i(k_i)) for every request that has one (see faser/spec/slo.py): the best
    goodput among the k vectors that keep every deadline wins; when none does, the one that
    comes closest (the smallest worst shortfall)."""
    probs = [survival(a) for a in acceptance]
    n = len(probs)
    base_time = step_cost.total()
    baseline = n / base_time if base_time > 0 else 0.0
    allowances = Allowances(tpot_deadlines_s) if tpot_deadlines_s is not None else None
    margin = allowances.margin(base_time) if allowances is not None else math.inf
    best = _Walk([], 0, baseline * (1.0 + min_gain), margin >= 1.0, margin)
    walks: list[tuple[bool, bool, bool]] = [(True, True, False), (False, True, False)]
    if allowances is not None:  # (by cost, strict, rescue first)
        walks += [(True, False, False), (False, False, False), (True, True, True)]
    for by_cost, strict, rescue in walks:
        walker = _Walker(probs, step_cost.copy(), allowances, max_step_time_s, token_budget, best)
        if rescue:
            walker.rescue()
        walker.greedy(by_cost, strict)
        if walker.best_len:
            best = walker.result()
    ks = [0] * n
    for i, _, _ in best.order[: best.best_len]:
        ks[i] += 1
    time_s = best.order[best.best_len - 1][2] if best.best_len else base_time
    expected = [sum(p[:k]) for p, k in zip(probs, ks, strict=True)]
    goodput = (n + sum(expected)) / time_s if time_s > 0 else 0.0
    return KChoice(ks, expected, time_s, goodput, baseline, best.feasible)


class _Walk(NamedTuple):
    order: list[tuple[int, int, float]]  # (request, position, step seconds once it is added)
    best_len: int  # the best prefix of `order`; 0: none beat the incumbent
    best_goodput: float
    feasible: bool  # the best prefix keeps every TPOT deadline
    margin: float  # its Allowances.margin (>= 1: every deadline kept)


class _Walker:
    """Adds draft tokens one by one and keeps the best prefix of that order which beats the
    incumbent: a higher goodput among prefixes that keep the TPOT deadlines, a higher margin
    while none does."""

    def __init__(
        self,
        probs: list[list[float]],
        step_cost: StepCost,
        allowances: Allowances | None,
        max_step_time_s: float | None,
        token_budget: int | None,
        incumbent: _Walk,
    ) -> None:
        self.probs, self.cost, self.max_step_time_s = probs, step_cost, max_step_time_s
        self.allowances = allowances.copy() if allowances is not None else None
        self.limit = math.inf if token_budget is None else max(0, token_budget)
        self.n, self.ks = len(probs), [0] * len(probs)
        self.gained, self.remaining = 0.0, sum(sum(p) for p in probs)
        self.order: list[tuple[int, int, float]] = []
        self.best_len, self.feasible = 0, incumbent.feasible
        self.best = incumbent.best_goodput if incumbent.feasible else 0.0
        self.best_margin = 0.0 if incumbent.feasible else incumbent.margin

    def result(self) -> _Walk:
        return _Walk(self.order, self.best_len, self.best, self.feasible, self.best_margin)

    def margin(self) -> float:
        a = self.allowances
        return a.margin(self.cost.total()) if a is not None else math.inf

    def greedy(self, by_cost: bool, strict: bool) -> None:
        """The greedy order: survival probability per marginal cost, or survival probability
        alone. All candidates at the same draft position share the same marginal cost, so one
        heap per position (by survival probability) suffices: each pick compares only the heads.
        Costs never fall as tokens are added, so once a prefix keeps the deadlines the walk stops
        when even all the remaining gain at today's cost could not beat the best prefix.
        `strict`: a token that would break the deadlines, or narrow a margin already short, is
        skipped with its request's later positions; so the requests that gain least are trimmed
        and those short of their target favoured. Otherwise each prefix is only judged: one
        request's token cannot lift the minimum over many alike, so what only everyone's
        speculation together achieves is found that way alone."""
        heaps: list[list[tuple[float, int]]] = []
        for i, (p, k) in enumerate(zip(self.probs, self.ks, strict=True)):
            if k < len(p):
                _push(heaps, k, p[k], i)
        while len(self.order) < self.limit and (
            not self.feasible
            or (self.n + self.gained + self.remaining) > self.best * self.cost.total()
        ):
            position = _best_head(heaps, self.cost, by_cost)
            if position is None:
                break
            _, i = heapq.heappop(heaps[position])
            if not self._admits(i, position, strict):
                self.remaining -= sum(self.probs[i][position:])
                continue  # this request's later positions would cost at least as much
            self._take(i, position)
            if position + 1 < len(self.probs[i]):
                _push(heaps, position + 1, self.probs[i][position + 1], i)

    def rescue(self) -> None:
        """While a deadline is missed, the request holding the tightest one drafts one more
        token, as long as that raises its own margin (its extra tokens outpace the longer
        step): the request closest to missing its target is served first."""
        a = self.allowances
        while a is not None and self.margin() < 1.0 and len(self.order) < self.limit:
            j = a.tightest()
            if j is None or self.ks[j] >= len(self.probs[j]) or not self._fits_time(self.ks[j]):
                return
            position = self.ks[j]
            time_s = self.cost.total() + self.cost.marginal(position)
            own_after = a.own_margin(j, self.probs[j][position], time_s)
            if own_after <= a.own_margin(j, 0.0, self.cost.total()):
                return
            self._take(j, position)

    def _fits_time(self, position: int) -> bool:
        cap = self.max_step_time_s
        return cap is None or self.cost.total() + self.cost.marginal(position) <= cap

    def _admits(self, i: int, position: int, strict: bool) -> bool:
        if not self._fits_time(position):
            return False
        if self.allowances is None or not strict:
            return True
        time_s = self.cost.total() + self.cost.marginal(position)
        now = self.margin()
        after = self.allowances.margin_if(i, self.probs[i][position], time_s)
        return after >= 1.0 or (now < 1.0 and after > now)

    def _take(self, i: int, position: int) -> None:
        gain = self.probs[i][position]
        self.cost.add(position)
        if self.allowances is not None:
            self.allowances.add(i, gain)
        self.ks[i] += 1
        self.gained += gain
        self.remaining -= gain
        self.order.append((i, position, self.cost.total()))
        margin = self.margin()
        goodput = (self.n + self.gained) / self.cost.total()
        if margin >= 1.0 and (not self.feasible or goodput > self.best * (1.0 + 1e-9)):
            self.best_len, self.best, self.feasible = len(self.order), goodput, True
            self.best_margin = margin
        elif not self.feasible and margin > self.best_margin:
            self.best_len, self.best_margin = len(self.order), margin


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
