"""Speculation policies: how many draft tokens each request gets this step.

A policy sees per-request state and the load, and answers with a StepPlan (k caps and frontier
size) before drafting; after drafting, `trim` may shorten each request's k using the draft's own
confidences; after verification, `observe` updates per-request state. Policies never touch
tensors: they are testable with no model loaded.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from faser.config import SpecConfig
from faser.spec.plan import LoadView, StepPlan
from faser.spec.state import SpecState


class Policy(ABC):
    name: str = ""

    def __init__(self, config: SpecConfig) -> None:
        self.config = config

    @abstractmethod
    def plan(self, states: list[SpecState], load: LoadView) -> StepPlan: ...

    def trim(
        self, plan: StepPlan, states: list[SpecState], confidences: list[list[float]]
    ) -> list[int]:
        """Final k per request once drafted; confidences[i][t] is the draft's probability of its
        own token t for request i. Static policies keep what was drafted."""
        return [len(c) for c in confidences]

    def observe(self, state: SpecState, num_drafted: int, num_accepted: int) -> None:
        state.last_k, state.last_num_accepted = num_drafted, num_accepted
        if num_drafted > 0:
            rate = num_accepted / num_drafted
            state.alpha += self.config.alpha_ema * (rate - state.alpha)


class OffPolicy(Policy):
    name = "off"

    def plan(self, states: list[SpecState], load: LoadView) -> StepPlan:
        return StepPlan(max_k=[0] * len(states), mode="off")


class FixedPolicy(Policy):
    """Classic static speculative decoding: constant k, one frontier, draft then verify."""

    name = "fixed"

    def plan(self, states: list[SpecState], load: LoadView) -> StepPlan:
        return StepPlan(max_k=[s.max_k for s in states], mode="prune")


POLICY_REGISTRY: dict[str, Callable[[SpecConfig], Policy]] = {
    "off": OffPolicy,
    "fixed": FixedPolicy,
}


def make_policy(config: SpecConfig) -> Policy:
    try:
        return POLICY_REGISTRY[config.policy](config)
    except KeyError:
        raise ValueError(
            f"policy {config.policy!r} is not implemented; have {sorted(POLICY_REGISTRY)}"
        ) from None
