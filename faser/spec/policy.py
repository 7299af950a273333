"""Speculation policies: how many draft tokens each request gets this step.

A policy sees per-request state and the load, and answers with a StepPlan (k caps and frontier
size) before drafting; after drafting, `trim` may shorten each request's k using the draft's own
confidences; after verification, `observe` updates per-request state. Policies never touch
tensors: they are testable with no model loaded. They only choose k and f, so whatever they
choose the output stays lossless; every k they return lies in [0, the request's max_k] and their
sum fits the step's token budget.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from faser.config import SpecConfig
from faser.spec.calibration import ConfidenceCalibration
from faser.spec.controller import ControllerConfig, ModeController
from faser.spec.cost_model import CostProfile
from faser.spec.goodput import (
    StepCost,
    calibrate,
    choose_frontier_size,
    survival,
)
from faser.spec.overhead import NO_OVERHEAD, Overhead
from faser.spec.plan import LoadView, StepPlan
from faser.spec.slo import choose_k_for_slo
from faser.spec.state import SpecState

HEURISTIC_START_K = 4  # HF transformers starts higher (20); our caps are far lower
POPULATION_EMA = 0.02  # weight of each step's rate in a policy's acceptance over all requests


class Policy(ABC):
    name: str = ""
    slo_aware = False  # its plan takes the SLO's step limits (max_step_time_s, tpot_deadlines_s)

    def __init__(self, config: SpecConfig, cost_model: CostProfile | None = None) -> None:
        self.config = config
        self.cost_model = cost_model
        self.controller: ModeController | None = None  # only the adaptive policies have one
        # per-token acceptance over every request this policy has seen, from the global prior
        self.population_alpha = config.alpha_prior
        # a real step's time beyond its forwards (faser.spec.overhead)
        self.overhead = NO_OVERHEAD

    @abstractmethod
    def plan(self, states: list[SpecState], load: LoadView) -> StepPlan: ...

    def set_can_overlap(self, can: bool) -> None:
        """Whether the engine can run a step's draft and target at once (it has lanes and the
        draft does not read the target's features). Where it cannot, the controller never plans
        an overlapped step: priced as overlapped, drafting looked partly free and the plans
        drafted more than the sequential steps that ran could pay for."""
        if self.controller is not None:
            self.controller.allow_overlap = self.allow_overlap and can
            if not self.controller.allow_overlap and self.controller.mode == "overlap":
                self.controller.mode = "prune"

    def set_overhead(self, overhead: Overhead) -> None:
        self.overhead = overhead
        if self.controller is not None:
            self.controller.set_overhead(overhead)

    def trim(
        self, plan: StepPlan, states: list[SpecState], confidences: list[list[float]]
    ) -> list[int]:
        """Final k per request once drafted; confidences[i][t] is the draft's probability of its
        own token t for request i. Static policies keep what was drafted (within the plan)."""
        return [min(len(c), k) for c, k in zip(confidences, plan.max_k, strict=True)]

    def observe(
        self,
        state: SpecState,
        num_drafted: int,
        num_accepted: int,
        confidences: Sequence[float] = (),
    ) -> None:
        """Updates the acceptance EMA (`confidences`, the drafted tokens' own, are for policies
        that learn from them). The step's verification is a run of Bernoulli trials that
        stops at the first rejection, so the per-token estimate is accepted / trials seen
        (accepted, plus one if a rejection ended the run); accepted / drafted would read 0.59 for
        a true alpha of 0.8 at k = 4 and make every adaptive choice too short."""
        state.last_k, state.last_num_accepted = num_drafted, num_accepted
        if num_drafted > 0:
            trials = num_accepted + (1 if num_accepted < num_drafted else 0)
            rate = num_accepted / trials
            state.alpha += self.config.alpha_ema * (rate - state.alpha)
            self.population_alpha += POPULATION_EMA * (rate - self.population_alpha)
        else:  # no evidence this step: drift back toward what the draft does for everyone
            state.alpha += self.config.alpha_recovery * (self.population_alpha - state.alpha)


class OffPolicy(Policy):
    name = "off"

    def plan(self, states: list[SpecState], load: LoadView) -> StepPlan:
        return StepPlan(max_k=[0] * len(states), mode="off")


class FixedPolicy(Policy):
    """Classic static speculative decoding: constant k, one frontier, draft then verify."""

    name = "fixed"

    def plan(self, states: list[SpecState], load: LoadView) -> StepPlan:
        ks = fit_budget([clamp_k(s.max_k, s) for s in states], load.token_budget)
        return StepPlan(max_k=ks, mode=_static_mode(ks))


class DsdPolicy(Policy):
    """A batch size -> k table, as vLLM and TensorRT-LLM ship: the first row whose batch size is
    >= the number of running requests gives k; past the last row, its k."""

    name = "dsd"

    def plan(self, states: list[SpecState], load: LoadView) -> StepPlan:
        k = dsd_k(self.config.dsd_table, max(load.num_running, len(states)))
        ks = fit_budget([clamp_k(k, s) for s in states], load.token_budget)
        return StepPlan(max_k=ks, mode=_static_mode(ks))


class HeuristicPolicy(Policy):
    """HF transformers' assistant schedule, per request: k + 2 after a step with all drafts
    accepted, k - 1 (never below 1) otherwise."""

    name = "heuristic"

    def plan(self, states: list[SpecState], load: LoadView) -> StepPlan:
        ks = [clamp_k(self._current_k(s), s) for s in states]
        ks = fit_budget(ks, load.token_budget)
        return StepPlan(max_k=ks, mode=_static_mode(ks))

    def observe(
        self,
        state: SpecState,
        num_drafted: int,
        num_accepted: int,
        confidences: Sequence[float] = (),
    ) -> None:
        super().observe(state, num_drafted, num_accepted, confidences)
        if num_drafted > 0:
            k = self._current_k(state)
            k = k + 2 if num_accepted >= num_drafted else k - 1
            state.k = min(max(1, k), state.max_k)

    @staticmethod
    def _current_k(state: SpecState) -> int:
        # k never drops below 1 once set, so 0 means a request that has not speculated yet
        return state.k if state.k > 0 else min(HEURISTIC_START_K, state.max_k)


class FaserPolicy(Policy):
    """Per-request k from the goodput model over the cost profile, confidence-based trimming,
    frontier size from the expected verify cost, and the regime from the mode controller:
    overlap at low load, prune with shorter speculation at high load, off when it cannot pay.

    The controller is updated inside `plan`, once per step: the engine reads
    `policy.controller.mode` and feeds `policy.controller.set_cluster_load`, never `update`."""

    name = "faser"
    slo_aware = True
    allow_overlap = True
    allow_prune = True  # several frontiers with early pruning

    def __init__(
        self,
        config: SpecConfig,
        cost_model: CostProfile | None = None,
        *,
        controller_config: ControllerConfig | None = None,
        confidence_weight: float = 0.5,
        prune_k_fraction: float = 0.5,
    ) -> None:
        if cost_model is None:
            raise ValueError(f"policy {self.name!r} needs a cost_model (a CostProfile)")
        super().__init__(config, cost_model)
        self.cost: CostProfile = cost_model
        self.confidence_weight = confidence_weight
        self.calibration = ConfidenceCalibration()  # draft confidence -> acceptance, learned
        self.prune_k_fraction = prune_k_fraction
        self.controller = ModeController(
            cost_model,
            config.max_k,
            config.alpha_prior,
            controller_config,
            allow_overlap=self.allow_overlap,
        )

    def plan(
        self,
        states: list[SpecState],
        load: LoadView,
        *,
        max_step_time_s: float | None = None,
        tpot_deadlines_s: Sequence[float | None] | None = None,
    ) -> StepPlan:
        """SLO-aware speculation (see faser/spec/slo.py): `max_step_time_s` caps the step (the
        TTFT of requests whose prefill ends in it); `tpot_deadlines_s[i]` is what request i's
        TPOT budget allows per committed token (None: no target). k is chosen for the best
        goodput that keeps them; without them, as before."""
        alpha = sum(s.alpha for s in states) / len(states) if states else None
        mode = self.controller.update(load, alpha=alpha)
        notes: dict[str, object] = {
            "controller_mode": mode,
            "pressure": self.controller.last_pressure._asdict(),
            "num_prefill_tokens": load.num_prefill_tokens,
            "token_budget": load.token_budget,
            "max_step_time_s": max_step_time_s,
            "mean_alpha": alpha,
            "population_alpha": self.population_alpha,
            "overhead_per_request_s": self.overhead.per_request_s,
            "overhead_per_draft_token_s": self.overhead.per_draft_token_s,
        }
        if mode == "off" or not states:
            return StepPlan(max_k=[0] * len(states), mode="off", notes=notes)
        cap = self._mode_cap(mode)
        acceptance = [[_prob(s.alpha)] * min(max(0, s.max_k), cap) for s in states]
        overlap = mode == "overlap"
        step_cost = StepCost(self.cost, len(states), load.num_prefill_tokens, overlap=overlap,
                             overhead=self.overhead)
        slo = choose_k_for_slo(
            acceptance, step_cost, token_budget=load.token_budget,
            max_step_time_s=max_step_time_s, tpot_deadlines_s=tpot_deadlines_s,
        )
        choice = slo.choice
        notes.update(
            expected_accepted=choice.expected_accepted,
            predicted_time_s=choice.step_time_s,
            predicted_goodput=choice.goodput,
            baseline_goodput=choice.baseline_goodput,
        )
        if max_step_time_s is not None or tpot_deadlines_s is not None:
            notes.update(slo.notes())
        if not choice.speculates:
            return StepPlan(max_k=choice.ks, mode="off", notes=notes)
        f = self._frontier_size(choice.ks, acceptance, load.num_prefill_tokens)
        return StepPlan(choice.ks, frontier_size=f, mode=mode, overlap=overlap, notes=notes)

    def trim(
        self, plan: StepPlan, states: list[SpecState], confidences: list[list[float]]
    ) -> list[int]:
        """Re-chooses k over the drafted tokens, now that the draft's confidences are known and
        the drafting time is spent: a_{i,t} blends q_{i,t} with alpha_i (see `calibrate`); a tail
        whose cumulative draft confidence fell below `draft_stop_confidence` is cut outright.
        The plan's SLO limits hold here too."""
        drafted = super().trim(plan, states, confidences)
        if not any(drafted):
            return drafted
        stop, weight = self.config.draft_stop_confidence, self.confidence_weight
        acceptance = [
            calibrate([self.calibration(q) for q in _confident_prefix(c[:k], stop)], s.alpha,
                      weight)
            for c, k, s in zip(confidences, drafted, states, strict=True)
        ]
        sunk = sum(self.cost.draft_time(sum(k > j for k in drafted)) for j in range(max(drafted)))
        prefill = plan.notes.get("num_prefill_tokens")
        step_cost = StepCost(
            self.cost,
            len(states),
            prefill if isinstance(prefill, int) else 0,
            overlap=plan.overlap,
            sunk_draft_s=sunk,
            overhead=self.overhead,
        )
        max_time = plan.notes.get("max_step_time_s")
        max_time = float(max_time) if isinstance(max_time, int | float) else None
        deadlines = plan.notes.get("slo_tpot_deadlines_s")
        choice = choose_k_for_slo(
            acceptance, step_cost, max_step_time_s=max_time,
            tpot_deadlines_s=deadlines if isinstance(deadlines, list) else None,
        ).choice
        plan.notes["trimmed_expected_accepted"] = choice.expected_accepted
        plan.notes["trimmed_time_s"] = choice.step_time_s
        return choice.ks

    def observe(
        self,
        state: SpecState,
        num_drafted: int,
        num_accepted: int,
        confidences: Sequence[float] = (),
    ) -> None:
        super().observe(state, num_drafted, num_accepted, confidences)
        self.calibration.observe(confidences[:num_drafted], num_accepted)

    def _mode_cap(self, mode: str) -> int:
        """At high load (prune) speculation is kept short: each token must pay in real compute."""
        if mode == "prune":
            return max(1, math.ceil(self.config.max_k * self.prune_k_fraction))
        return self.config.max_k

    def _frontier_size(
        self, ks: list[int], acceptance: list[list[float]], num_prefill_tokens: int
    ) -> int | None:
        if not self.allow_prune:
            return None
        if self.config.frontier_size is not None:
            return self.config.frontier_size if self.config.frontier_size < max(ks) else None
        return choose_frontier_size(ks, acceptance, self.cost, num_prefill_tokens)


class FaserNoOverlapPolicy(FaserPolicy):
    """Ablation: draft then verify, never on two lanes at once."""

    name = "faser-nooverlap"
    allow_overlap = False


class FaserNoPrunePolicy(FaserPolicy):
    """Ablation: one frontier always, so rejected positions are still computed."""

    name = "faser-noprune"
    allow_prune = False


def clamp_k(k: int, state: SpecState) -> int:
    return min(max(0, k), max(0, state.max_k))


def dsd_k(table: Sequence[tuple[int, int]], batch_size: int) -> int:
    rows = sorted(table)
    if not rows:
        return 0
    for max_batch, k in rows:
        if max_batch >= batch_size:
            return k
    return rows[-1][1]


def fit_budget(ks: list[int], budget: int | None) -> list[int]:
    """Shortens the longest k first until sum(k) <= budget (the target tokens still free)."""
    if budget is None or sum(ks) <= max(0, budget):
        return ks
    budget = max(0, budget)
    low, high = 0, max(ks)  # the largest level L with sum(min(k, L)) <= budget
    while low < high:
        mid = (low + high + 1) // 2
        if sum(min(k, mid) for k in ks) <= budget:
            low = mid
        else:
            high = mid - 1
    out = [min(k, low) for k in ks]
    spare = budget - sum(out)
    for i, k in enumerate(ks):
        if spare == 0:
            break
        if k > low:
            out[i] += 1
            spare -= 1
    return out


def _static_mode(ks: list[int]) -> str:
    return "prune" if any(ks) else "off"


def _prob(alpha: float) -> float:
    return min(1.0, max(0.0, alpha))


def _confident_prefix(confidences: Sequence[float], stop: float) -> list[float]:
    """The draft's own stop rule: keep tokens while the cumulative confidence stays >= stop."""
    probs = survival(confidences)
    keep = next((t for t, p in enumerate(probs) if p < stop), len(probs))
    return list(confidences[:keep])


POLICY_REGISTRY: dict[str, Callable[..., Policy]] = {
    "off": OffPolicy,
    "fixed": FixedPolicy,
    "dsd": DsdPolicy,
    "heuristic": HeuristicPolicy,
    "faser": FaserPolicy,
    "faser-nooverlap": FaserNoOverlapPolicy,
    "faser-noprune": FaserNoPrunePolicy,
}


def make_policy(
    config: SpecConfig, cost_model: CostProfile | None = None, **options: object
) -> Policy:
    """The policy `config.policy` names. The faser family needs `cost_model`; `options` go to
    its constructor (controller_config, confidence_weight, prune_k_fraction)."""
    try:
        factory = POLICY_REGISTRY[config.policy]
    except KeyError:
        raise ValueError(
            f"policy {config.policy!r} is not implemented; have {sorted(POLICY_REGISTRY)}"
        ) from None
    return factory(config, cost_model, **options)
