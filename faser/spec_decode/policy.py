"""Speculation policies: how many draft tokens each request gets this step.

A policy plans a StepPlan before drafting, may `trim` each k once the draft's confidences are
known, and `observe`s each verified step; it never touches tensors, and every k it gives lies in
[0, the request's max_k] with their sum within the token budget, so the output stays lossless.

- off, fixed (k for everyone), dsd (k from a batch-size table, as vLLM and TensorRT-LLM ship) and
  heuristic (HF transformers' schedule) are the static baselines;
- faser plans with the planner, trims with the draft's confidences and takes its mode from the
  mode controller; faser-nooverlap and faser-noprune are its ablations.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from faser.config import SpecConfig
from faser.spec_decode.controller import ModeController
from faser.spec_decode.cost_model import CostModel
from faser.spec_decode.estimator import AcceptanceEstimator
from faser.spec_decode.planner import NO_LIMITS, Choice, Limits, choose_frontier_size, choose_k
from faser.spec_decode.state import SpecState

HEURISTIC_START_K = 4  # HF transformers starts higher (20); our caps are far lower


@dataclass(frozen=True, slots=True)
class LoadView:
    """What a policy sees of the load this step."""

    num_running: int  # decoding requests in this step
    num_waiting: int
    num_prefill_tokens: int  # prefill tokens already scheduled into this step's target batch
    token_budget: int  # target tokens still free in this step's batch
    cluster_load: float = 0.0  # the router's signal (faser.spec_decode.controller)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """k caps per decoding request (index-aligned with the states passed to `plan`), the frontier
    size for verification and the mode the step runs in. `choice`: what the planner predicted."""

    max_k: tuple[int, ...]
    frontier_size: int | None = None  # None: one frontier (verify all k in one forward)
    mode: str = "prune"
    choice: Choice | None = None

    @property
    def overlap(self) -> bool:
        return self.mode == "overlap"


class Policy(ABC):
    name: str = ""

    def __init__(self, config: SpecConfig, estimator: AcceptanceEstimator) -> None:
        self.config = config
        self.estimator = estimator

    @abstractmethod
    def plan(self, states: list[SpecState], load: LoadView, limits: Limits = NO_LIMITS,
             draft_lags: Sequence[float] = ()) -> StepPlan:
        """`draft_lags[i]`: the draft rows request i's first draft token pays for (see
        faser.spec_decode.planner.choose_k)."""

    def trim(self, plan: StepPlan, states: list[SpecState], confidences: list[list[float]],
             load: LoadView, limits: Limits = NO_LIMITS) -> list[int]:
        """Final k per request once drafted (confidences[i][t]: the draft's probability of its
        own token t for request i). Static policies keep what was drafted."""
        return [len(c) for c in confidences]

    def observe(self, state: SpecState, num_drafted: int, num_accepted: int) -> None:  # noqa: B027
        """A request's verified step, for a policy that keeps state of its own."""


class StaticPolicy(Policy):
    """A k per request from `k_for`, cut to the token budget; one frontier."""

    def plan(self, states: list[SpecState], load: LoadView, limits: Limits = NO_LIMITS,
             draft_lags: Sequence[float] = ()) -> StepPlan:
        ks = [min(max(0, self.k_for(s, load)), max(0, s.max_k)) for s in states]
        ks = fit_budget(ks, _budget(load, limits))
        return StepPlan(max_k=tuple(ks), mode="prune" if any(ks) else "off")

    @abstractmethod
    def k_for(self, state: SpecState, load: LoadView) -> int: ...


class OffPolicy(StaticPolicy):
    name = "off"

    def k_for(self, state: SpecState, load: LoadView) -> int:
        return 0


class FixedPolicy(StaticPolicy):
    """Classic static speculative decoding: constant k, draft then verify."""

    name = "fixed"

    def k_for(self, state: SpecState, load: LoadView) -> int:
        return state.max_k


class DsdPolicy(StaticPolicy):
    """The first table row whose batch size is >= the running requests gives k."""

    name = "dsd"

    def k_for(self, state: SpecState, load: LoadView) -> int:
        return dsd_k(self.config.dsd_table, load.num_running)


class HeuristicPolicy(StaticPolicy):
    """HF transformers' assistant schedule, per request: k + 2 after a step with all drafts
    accepted, k - 1 (never below 1) otherwise."""

    name = "heuristic"

    def k_for(self, state: SpecState, load: LoadView) -> int:
        # k never drops below 1 once set, so 0 means a request that has not speculated yet
        return state.k if state.k > 0 else min(HEURISTIC_START_K, state.max_k)

    def observe(self, state: SpecState, num_drafted: int, num_accepted: int) -> None:
        if num_drafted > 0:
            k = num_drafted + 2 if num_accepted >= num_drafted else num_drafted - 1
            state.k = min(max(1, k), state.max_k)


class FaserPolicy(Policy):
    """Per-request k from the planner, trimmed once the draft's confidences are known, frontiers
    where pruning saves work, and the mode from the controller."""

    name = "faser"
    allow_overlap = True
    allow_prune = True  # several frontiers with early pruning

    def __init__(self, config: SpecConfig, estimator: AcceptanceEstimator, cost: CostModel,
                 can_overlap: bool = False) -> None:
        super().__init__(config, estimator)
        self.cost = cost
        self.controller = ModeController(can_overlap and self.allow_overlap)

    def plan(self, states: list[SpecState], load: LoadView, limits: Limits = NO_LIMITS,
             draft_lags: Sequence[float] = ()) -> StepPlan:
        if not states or self.controller.stays_off(len(states)):
            return StepPlan(max_k=(0,) * len(states), mode="off")
        if load.num_waiting:
            # requests queue: the replica is compute-bound, and its waiting requests pay for the
            # step's drafting, which the running batch's goodput does not see
            zero = (0,) * len(states)
            mode = self.controller.update(zero, load.num_prefill_tokens, 0.0, load.cluster_load)
            return StepPlan(zero, mode=mode)
        cap = self.controller.cap(self.config.max_k, load.cluster_load)
        acceptance = [self.estimator.before_draft(s, min(s.max_k, cap)) for s in states]
        limits = Limits(_budget(load, limits), limits.max_step_time_s, limits.tpot_deadlines_s)
        choice = choose_k(acceptance, self.cost, load.num_prefill_tokens, limits,
                          draft_lags=draft_lags)
        mode = self.controller.update(choice.ks, load.num_prefill_tokens, self.cost.profile.knee(),
                                      load.cluster_load)
        frontier = None
        if self.allow_prune and mode == "prune":
            frontier = self.config.frontier_size or choose_frontier_size(
                choice.ks, acceptance, self.cost, load.num_prefill_tokens
            )
        return StepPlan(choice.ks, frontier, mode, choice)

    def trim(self, plan: StepPlan, states: list[SpecState], confidences: list[list[float]],
             load: LoadView, limits: Limits = NO_LIMITS) -> list[int]:
        """The planner again, over the drafted tokens' own chances, their drafting now paid."""
        acceptance = [self.estimator.after_draft(s, c)
                      for s, c in zip(states, confidences, strict=True)]
        return list(choose_k(acceptance, self.cost, load.num_prefill_tokens, limits,
                             drafted=True).ks)


class FaserNoOverlapPolicy(FaserPolicy):
    """Ablation: draft then verify, never on two lanes at once."""

    name = "faser-nooverlap"
    allow_overlap = False


class FaserNoPrunePolicy(FaserPolicy):
    """Ablation: one frontier always, so rejected positions are still computed."""

    name = "faser-noprune"
    allow_prune = False


def _budget(load: LoadView, limits: Limits) -> int:
    """The target tokens free for draft tokens: the step's, tightened by the limits'."""
    if limits.token_budget is None:
        return load.token_budget
    return min(load.token_budget, limits.token_budget)


def dsd_k(table: Sequence[tuple[int, int]], batch_size: int) -> int:
    rows = sorted(table)
    if not rows:
        return 0
    return next((k for max_batch, k in rows if max_batch >= batch_size), rows[-1][1])


def fit_budget(ks: list[int], budget: int | None) -> list[int]:
    """Shortens the longest k first until sum(k) <= budget (the target tokens still free)."""
    if budget is None or sum(ks) <= max(0, budget):
        return ks
    out = [0] * len(ks)
    left = max(0, budget)
    for level in range(max(ks)):  # hand out one token per request and level, shortest first
        for i, k in enumerate(ks):
            if left and k > level:
                out[i] += 1
                left -= 1
    return out


POLICY_REGISTRY: dict[str, Callable[..., Policy]] = {
    p.name: p for p in (OffPolicy, FixedPolicy, DsdPolicy, HeuristicPolicy, FaserPolicy,
                        FaserNoOverlapPolicy, FaserNoPrunePolicy)
}


def prices_steps(policy: str) -> bool:
    """Whether a policy plans with the cost model (which then has to be profiled)."""
    return issubclass(POLICY_REGISTRY[policy], FaserPolicy)


def make_policy(config: SpecConfig, estimator: AcceptanceEstimator, cost: CostModel | None = None,
                can_overlap: bool = False) -> Policy:
    """The policy `config.policy` names; the faser family needs `cost`."""
    factory = POLICY_REGISTRY.get(config.policy)
    if factory is None:
        raise ValueError(
            f"policy {config.policy!r} is not implemented; have {sorted(POLICY_REGISTRY)}")
    if not prices_steps(config.policy):
        return factory(config, estimator)
    if cost is None:
        raise ValueError(f"policy {config.policy!r} needs a cost model")
    return factory(config, estimator, cost, can_overlap)
