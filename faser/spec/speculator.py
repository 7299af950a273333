"""One speculative step over the scheduled batch: choose k -> propose -> verify by frontiers.

The speculator owns the policies, the proposer and the verifier; the engine hands it the
scheduled requests and commits what it returns."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from faser.config import SpecConfig
from faser.outputs import SpecStats
from faser.runner.lanes import Lanes
from faser.runner.model_runner import ModelRunner
from faser.spec.calibration import ConfidenceCalibration
from faser.spec.cost_model import CostProfile
from faser.spec.goodput import StepCost
from faser.spec.overhead import StepOverhead
from faser.spec.overlap import OverlapStep
from faser.spec.plan import LoadView, StepPlan
from faser.spec.policy import Policy, make_policy
from faser.spec.proposer import Proposal, Proposer
from faser.spec.request import SpecRequest
from faser.spec.slo import tpot_deadlines, ttft_step_limit
from faser.spec.trace import DecisionTrace
from faser.spec.verifier import Verdict, Verifier

_TRACE_FIELDS = ("expected_accepted", "predicted_time_s")
# grows a request's block table to cover n slots; False when no block is free
Reserve = Callable[[SpecRequest, int], bool]


class Speculator:
    def __init__(
        self,
        config: SpecConfig,
        target: ModelRunner,
        draft: ModelRunner | None,
        token_map: torch.Tensor | None,
        profiler: Callable[[], CostProfile] | None = None,
    ) -> None:
        self.config = config
        self._profiler = profiler  # measures the cost model when a cost-aware policy needs it
        self._cost_model: CostProfile | None = None
        self.verifier = Verifier(target)
        vocab = target.vocab_size
        # how often the draft's own tokens are accepted by its confidence, over every policy:
        # prompt lookup weighs its guesses against it
        self.draft_calibration = ConfidenceCalibration()
        self.proposer = (
            Proposer(draft, vocab, token_map, prompt_lookup=config.prompt_lookup,
                     calibration=self.draft_calibration)
            if draft is not None else None
        )
        self._policies: dict[str, Policy] = {}
        self._cluster_load: float | None = None
        self.mode = "off" if config.policy == "off" else "prune"
        self.stats = SpecStats()
        self.trace = DecisionTrace.from_config(config)
        self.overhead = StepOverhead(skip_cold_shapes=True)  # real steps beyond the cost profile
        self.num_steps = 0
        self.overlap: OverlapStep | None = None  # set by use_lanes
        # test and benchmark hook: every speculative step overlaps when lanes exist
        self.force_overlap = False

    @property
    def has_draft(self) -> bool:
        return self.proposer is not None

    def prepare(self) -> None:
        """Measures or loads the cost profile now if the configured policy prices its steps
        with one; else the first step of such a policy does, inside a request."""
        if self.has_draft and _prices_steps(self.config.policy):
            self.policy(self.config.policy)

    def policy(self, name: str) -> Policy:
        if name not in self._policies:
            cost = self.cost_model if _prices_steps(name) else None
            policy = make_policy(replace(self.config, policy=name), cost_model=cost)
            if policy.controller is not None and self._cluster_load is not None:
                policy.controller.set_cluster_load(self._cluster_load)
            policy.set_overhead(self.overhead.estimate)
            policy.set_can_overlap(self.overlap is not None)
            self._policies[name] = policy
        return self._policies[name]

    def starting_alpha(self, policy: str) -> float:
        """A new request's acceptance estimate: what the draft achieved on this policy's earlier
        requests (the global prior before any); a fixed prior over- or under-speculates every
        new request's first steps."""
        known = self._policies.get(policy)
        return known.population_alpha if known is not None else self.config.alpha_prior

    @property
    def cost_model(self) -> CostProfile:
        if self._cost_model is None:
            if self._profiler is None:
                raise ValueError("the faser policies need a draft model")
            self._cost_model = self._profiler()
        return self._cost_model

    @property
    def cluster_load(self) -> float | None:
        return self._cluster_load

    @cluster_load.setter
    def cluster_load(self, load: float) -> None:
        """The router's fleet-wide load signal, handed to every mode controller."""
        self._cluster_load = load
        for policy in self._policies.values():
            if policy.controller is not None:
                policy.controller.set_cluster_load(load)

    def run(
        self,
        decodes: list[SpecRequest],
        prefills: list[tuple[SpecRequest, int]],
        load: LoadView,
        reserve: Reserve,
    ) -> tuple[list[Verdict], list[int | None]]:
        start = time.perf_counter()
        profiled = self._cost_model is not None  # else this step may pay for the profiling
        plans = self._plan(decodes, prefills, load)
        max_k = self._fit(decodes, plans, load.token_budget, reserve)
        frontier = self.config.frontier_size or min(
            (p.frontier_size for p in plans.values() if p.frontier_size), default=None
        )
        overlapped = self._overlaps(plans, max_k)
        if overlapped:
            proposal, verdicts, prefill_tokens = self.overlap.run(
                decodes, prefills, max_k, frontier, self._stop_confidence(plans), reserve,
                self._draft_budget(decodes, prefills, max_k, frontier),
            )
        else:
            if self.overlap is not None:
                self.overlap.forget()
            proposal = self._propose(decodes, max_k, plans)
            verdicts, prefill_tokens = self.verifier.verify(decodes, proposal, prefills, frontier)
        self._observe(decodes, proposal, verdicts)
        elapsed = time.perf_counter() - start
        # an overlapped step's profiled time is a guess of its own; a prefill's is priced apart
        if profiled and not overlapped and not prefills:
            self._learn_overhead(proposal, elapsed)
        self._record(plans, proposal, verdicts, frontier, elapsed)
        return verdicts, prefill_tokens

    def _learn_overhead(self, proposal: Proposal, elapsed: float) -> None:
        """Measured minus profiled time of what a sequential decode step ran, handed to every
        policy. Only once a cost-aware policy has profiled: a plain one never pays for that."""
        assert self._cost_model is not None
        ks = [len(d) for d in proposal.draft_token_ids]
        step = StepCost(self._cost_model, len(ks))
        for k in ks:
            for position in range(k):
                step.add(position)
        self.overhead.observe(step.total(), elapsed, len(ks), sum(ks))
        for policy in self._policies.values():
            policy.set_overhead(self.overhead.estimate)

    def _record(self, plans, proposal: Proposal, verdicts, frontier, elapsed: float) -> None:
        self.num_steps += 1
        if not self.trace.enabled or not verdicts:
            return
        name = self.config.policy
        if name not in plans and len(plans) == 1:  # every request overrides the engine's policy
            name = next(iter(plans))
        notes = plans[name].notes if name in plans else {}
        mode = plans[name].mode if name in plans else self.mode
        self.trace.record(
            self.num_steps, mode, [len(d) for d in proposal.draft_token_ids], frontier,
            predicted_accepted=notes.get("expected_accepted"),
            realised_accepted=[v.num_accepted for v in verdicts],
            predicted_time_s=notes.get("predicted_time_s"),
            measured_time_s=elapsed,
            cluster_load=self._cluster_load,
            policy=name,
            **{k: v for k, v in notes.items() if k not in _TRACE_FIELDS},
        )

    def _plan(
        self, decodes: list[SpecRequest], prefills: list[tuple[SpecRequest, int]], load: LoadView
    ) -> dict[str, StepPlan]:
        """One plan per policy present in the batch (requests may override the engine's)."""
        now = time.perf_counter()
        ttft_limit = ttft_step_limit(prefills, now)
        plans: dict[str, StepPlan] = {}
        for name in {s.spec_state.policy for s in decodes}:
            group = [s for s in decodes if s.spec_state.policy == name]
            policy = self.policy(name)
            limits = _slo_limits(policy, group, ttft_limit, now)
            plans[name] = policy.plan([s.spec_state for s in group], load, **limits)
        main = plans.get(self.config.policy)
        if main is not None:
            self.mode = main.mode
        return plans

    def _fit(self, decodes, plans, budget: int, reserve: Reserve) -> list[int]:
        """Caps each request's k by the plan, the token budget and the free KV blocks."""
        cursors = {name: iter(plan.max_k) for name, plan in plans.items()}
        max_k = []
        for seq in decodes:
            k = min(next(cursors[seq.spec_state.policy]), seq.spec_state.max_k, budget)
            if k > 0 and (self.proposer is None or not reserve(seq, seq.num_tokens + k)):
                k = 0  # never preempt anyone for speculation
            budget -= k
            max_k.append(k)
        return max_k

    def _propose(self, decodes, max_k: list[int], plans) -> Proposal:
        if self.proposer is None or not any(max_k):
            return Proposal([[] for _ in decodes], [None] * len(decodes), [[] for _ in decodes])
        proposal = self.proposer.propose(decodes, max_k, self._stop_confidence(plans))
        proposal.truncate(self._trim(decodes, proposal, plans))
        return proposal

    def _stop_confidence(self, plans) -> float | None:
        early = any(getattr(self.policy(name), "early_stop", False) for name in plans)
        return self.config.draft_stop_confidence if early else None

    def use_lanes(self, lanes: Lanes | None) -> None:
        """Gives the speculator two lanes: steps whose plan says overlap then run the draft and
        the target at once (see faser/spec/overlap.py); None keeps every step sequential. A
        feature draft never overlaps: its next guesses need the features the target is still
        computing, so its lanes are closed at once."""
        if self.overlap is not None:
            self.overlap.lanes.close()
        self.overlap = None
        if lanes is not None and self.proposer is not None:
            if self.proposer.runner.reads_features:
                lanes.close()
            else:
                self.overlap = OverlapStep(self.proposer, self.verifier, lanes)
        for policy in self._policies.values():
            policy.set_can_overlap(self.overlap is not None)

    def _draft_budget(self, decodes, prefills, max_k: list[int], frontier) -> int | None:
        """Draft forwards that fit in one target forward of this step, by the cost profile
        (only when one is measured already: a plain policy never pays for profiling)."""
        if self._cost_model is None:
            return None
        size = frontier or max(max_k) + 1
        tokens = sum(min(size, k + 1) for k in max_k) + sum(n for _, n in prefills)
        draft_s = self._cost_model.draft_time(len(decodes))
        return max(1, int(self._cost_model.target_time(tokens) / draft_s)) if draft_s > 0 else None

    def _overlaps(self, plans: dict[str, StepPlan], max_k: list[int]) -> bool:
        """Overlap when the engine has lanes, someone speculates and a plan asks for it. In
        overlap, the policies' post-draft trim is not applied: verification starts before the
        drafting ends; the draft's own confidence stop still cuts each line."""
        if self.overlap is None or not any(max_k):
            return False
        return self.force_overlap or any(p.overlap for p in plans.values())

    def _trim(self, decodes, proposal: Proposal, plans) -> list[int]:
        k = [len(d) for d in proposal.draft_token_ids]
        for name, plan in plans.items():
            idx = [i for i, s in enumerate(decodes) if s.spec_state.policy == name]
            states = [decodes[i].spec_state for i in idx]
            trimmed = self.policy(name).trim(plan, states, [proposal.confidences[i] for i in idx])
            for i, k_i in zip(idx, trimmed, strict=True):
                k[i] = min(k[i], max(0, k_i))
        return k

    def _observe(self, decodes, proposal: Proposal, verdicts: list[Verdict]) -> None:
        rows = zip(decodes, proposal.draft_token_ids, proposal.confidences, verdicts, strict=True)
        for row, (seq, drafted, confidences, verdict) in enumerate(rows):
            k = len(drafted)
            for stats in (seq.stats, self.stats):
                stats.num_steps += 1
                stats.num_drafts += int(k > 0)
                stats.num_draft_tokens += k
                stats.num_accepted_tokens += verdict.num_accepted
                stats.num_pruned_positions += verdict.num_pruned
            self.stats.count_step(k, verdict.num_accepted)
            self.policy(seq.spec_state.policy).observe(
                seq.spec_state, k, verdict.num_accepted, confidences
            )
            if k and seq.params.greedy:  # sampled drafts are judged on another scale
                looked_up = proposal.looked_up[row] if proposal.looked_up else ()
                self.draft_calibration.observe(confidences[:k], verdict.num_accepted, looked_up)


def _slo_limits(
    policy: Policy, group: list[SpecRequest], ttft_limit: float | None, now: float
) -> dict[str, object]:
    """The SLO's step limits for a policy that plans by them; none when no request has an SLO,
    so that a step without one plans exactly as before."""
    if not policy.slo_aware:
        return {}
    limits: dict[str, object] = {}
    deadlines = tpot_deadlines(group, now)
    if any(d is not None for d in deadlines):
        limits["tpot_deadlines_s"] = deadlines
    if ttft_limit is not None:
        limits["max_step_time_s"] = ttft_limit
    return limits


def _prices_steps(policy: str) -> bool:
    """Whether a policy chooses k with the goodput model over the cost profile."""
    return policy.startswith("faser")
