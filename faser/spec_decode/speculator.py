"""One speculative step over the scheduled batch: plan -> propose -> trim -> verify -> observe.

- Each request follows its own policy (its override, else the engine's); every policy in the batch
  plans its own requests over the shared acceptance estimator and cost model.
- A step in which nobody drafts runs as policy `off` does: no draft forward and, while the faser
  controller is off, no planning; only the target still writes its features into the feature
  cache (one copy per forward, faser.runner.model_runner), which the draft reads when it drafts
  again.
- A sequential step teaches the cost model its phases' times; a step whose plan is `overlap`
  runs on the engine's lanes (faser.spec_decode.overlap).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import NamedTuple

import torch

from faser.config import SpecConfig
from faser.outputs import SpecStats
from faser.runner.block_manager import BlockManager
from faser.runner.lanes import Lanes
from faser.runner.model_runner import ModelRunner
from faser.runner.profiler import CostProfile
from faser.spec_decode.cost_model import CostModel
from faser.spec_decode.estimator import AcceptanceEstimator
from faser.spec_decode.overlap import OverlapStep
from faser.spec_decode.planner import NO_LIMITS, Limits
from faser.spec_decode.policy import FaserPolicy, LoadView, Policy, StepPlan, make_policy
from faser.spec_decode.proposer import Proposal, Proposer
from faser.spec_decode.request import SpecRequest
from faser.spec_decode.slo import tpot_deadlines, ttft_step_limit
from faser.spec_decode.trace import DecisionTrace
from faser.spec_decode.verifier import Verdict, Verifier


class _Group(NamedTuple):
    """The requests of one policy in a step (rows of the batch), their limits and their plan."""

    policy: Policy
    rows: list[int]
    limits: Limits
    plan: StepPlan


class Speculator:
    def __init__(self, config: SpecConfig, target: ModelRunner, draft: ModelRunner | None,
                 token_map: torch.Tensor | None, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.estimator = AcceptanceEstimator(config.alpha_prior)
        self.verifier = Verifier(target)
        self.proposer = None
        if draft is not None:
            self.proposer = Proposer(draft, target.vocab_size, token_map, config.prompt_lookup,
                                     self.estimator.calibrated, self.estimator.lookup_precision)
        self.overlap: OverlapStep | None = None  # set by use_lanes
        self.cost: CostModel | None = None  # set by use_cost_profile
        self._policies: dict[str, Policy] = {}
        self.mode = "off" if config.policy == "off" else "prune"
        self.stats = SpecStats()
        self.trace = DecisionTrace(config.trace_path)
        self.num_steps = 0

    @property
    def has_draft(self) -> bool:
        return self.proposer is not None

    def use_cost_profile(self, profile: CostProfile) -> None:
        """The measured step costs that the faser policies plan with."""
        self.cost = CostModel(profile)
        for name in [n for n, p in self._policies.items() if isinstance(p, FaserPolicy)]:
            del self._policies[name]  # made again over the new costs

    def use_lanes(self, lanes: Lanes | None) -> None:
        """Two lanes on which the steps a faser plan marks `overlap` run the draft and the target
        at once (faser/spec_decode/overlap.py); None keeps every step sequential. A feature draft
        never overlaps: its next guesses need the features the target is still computing."""
        if self.overlap is not None:
            self.overlap.lanes.close()
        self.overlap = None
        if lanes is not None and self.proposer is not None:
            if self.proposer.runner.reads_features:
                lanes.close()
            else:
                self.overlap = OverlapStep(self.proposer, self.verifier, lanes)
        self._policies.clear()

    def policy(self, name: str) -> Policy:
        if name not in self._policies:
            config = replace(self.config, policy=name)
            self._policies[name] = make_policy(config, self.estimator, self.cost,
                                               self.overlap is not None)
        return self._policies[name]

    def run(
        self, decodes: list[SpecRequest], prefills: list[tuple[SpecRequest, int]], load: LoadView
    ) -> tuple[list[Verdict], list[int | None]]:
        start = time.perf_counter()
        self.estimator.tick()
        limits = self._limits(decodes, prefills, start)
        rows: dict[str, list[int]] = {}
        for i, seq in enumerate(decodes):
            rows.setdefault(seq.spec_state.policy, []).append(i)
        groups = {name: self._plan(name, decodes, r, load, limits) for name, r in rows.items()}
        max_k = self._fit(decodes, groups, load.token_budget)
        frontier = self.config.frontier_size or min(
            (g.plan.frontier_size for g in groups.values() if g.plan.frontier_size), default=None)
        overlapped = any(g.plan.overlap for g in groups.values())
        draft_start, verify_start, trimmed = time.perf_counter(), None, []
        if self.overlap is not None and any(max_k) and overlapped:
            proposal, verdicts, prefill_tokens = self.overlap.run(
                decodes, prefills, max_k, frontier, self._stop(groups), self._reserve,
                self._draft_budget(decodes, prefills, max_k, frontier),
            )
        else:
            proposal, trimmed, verdicts, prefill_tokens, verify_start = self._sequential(
                decodes, prefills, max_k, frontier, groups, load)
        self._observe(decodes, proposal, verdicts, trimmed)
        ks = [len(d) for d in proposal.draft_token_ids]
        end = time.perf_counter()
        if verify_start is not None and self.cost is not None and not prefills and frontier is None:
            self.cost.observe(len(decodes), ks, proposal.forward_rows, verify_start - draft_start,
                              end - verify_start)
        self._record(groups, ks, verdicts, frontier, end - start, limits, prefills, load)
        return verdicts, prefill_tokens

    def _sequential(self, decodes, prefills, max_k, frontier, groups, load):
        """Draft, trim, then verify; returns the trimmed drafts' confidences per request and
        when verification began. The two phases, split there, cover the step from its first
        draft forward on (trimming with the draft, the bookkeeping after verification with it):
        the cost model learns what a step costs, not only its forwards. Planning is left out, as
        every planned step pays it whatever it decides: charged to drafting, it priced each draft
        token dearer than it is. Only a decode-only step in one frontier teaches the model: a
        prefill's or several frontiers' time is priced apart."""
        if self.overlap is not None:
            self.overlap.forget()
        proposal, trimmed = Proposal.empty(len(decodes)), []
        if any(max_k):
            proposal = self.proposer.propose(decodes, max_k, self._stop(groups))
            ks = self._trim(decodes, proposal, groups, load)
            trimmed = [c[k:] for c, k in zip(proposal.confidences, ks, strict=True)]
            proposal.truncate(ks)
        verify_start = time.perf_counter()
        verdicts, prefill_tokens = self.verifier.verify(decodes, proposal, prefills, frontier)
        return proposal, trimmed, verdicts, prefill_tokens, verify_start

    # -- planning ---------------------------------------------------------------------------

    def _plan(self, name: str, decodes, rows: list[int], load: LoadView, limits: Limits) -> _Group:
        policy, seqs = self.policy(name), [decodes[i] for i in rows]
        if limits.tpot_deadlines_s is not None:
            mine = tuple(limits.tpot_deadlines_s[i] for i in rows)
            given = any(d is not None for d in mine)
            limits = replace(limits, tpot_deadlines_s=mine if given else None)
        # only the planner prices a draft's catch-up: static and off policies skip the loop
        lags = [_priced_lag(s) for s in seqs] if isinstance(policy, FaserPolicy) else []
        plan = policy.plan([s.spec_state for s in seqs], load, limits, lags)
        if name == self.config.policy:
            self.mode = plan.mode
        return _Group(policy, rows, limits, plan)

    def _limits(self, decodes, prefills, now: float) -> Limits:
        """The SLO's step limits over the whole batch: the TTFT of the prefills ending in this
        step, the TPOT deadline of every decoding request that has one."""
        deadlines = tpot_deadlines(decodes, now)
        return Limits(
            max_step_time_s=ttft_step_limit(prefills, now),
            tpot_deadlines_s=tuple(deadlines) if any(d is not None for d in deadlines) else None,
        )

    def _fit(self, decodes, groups: dict[str, _Group], budget: int) -> list[int]:
        """Caps each request's k by its plan, the tokens it has left, the token budget and the
        free KV blocks (never preempting anyone for speculation). A request with n tokens left
        drafts at most n - 1: the bonus token is its n-th, and a draft past it would be verified
        for nothing."""
        cursors = {name: iter(g.plan.max_k) for name, g in groups.items()}
        max_k = []
        for seq in decodes:
            left = seq.params.max_tokens - len(seq.output_token_ids) - 1
            k = min(next(cursors[seq.spec_state.policy]), seq.spec_state.max_k, budget, left)
            k = max(0, k)
            if k > 0 and (self.proposer is None or not self._reserve(seq, seq.num_tokens + k)):
                k = 0
            budget -= k
            max_k.append(k)
        return max_k

    def _reserve(self, seq: SpecRequest, num_slots: int) -> bool:
        return self.blocks.allocate(seq.request_id, seq.block_table, num_slots)

    def _stop(self, groups: dict[str, _Group]) -> float | None:
        """The draft's own stop rule (a line whose cumulative confidence fell below the
        threshold is cut while drafting) for the policies that trim by confidence."""
        faser = any(isinstance(g.policy, FaserPolicy) for g in groups.values())
        return self.config.draft_stop_confidence if faser else None

    def _trim(self, decodes, proposal: Proposal, groups: dict[str, _Group], load: LoadView):
        ks = [len(d) for d in proposal.draft_token_ids]
        for g in groups.values():
            states = [decodes[i].spec_state for i in g.rows]
            confidences = [proposal.confidences[i] for i in g.rows]
            trimmed = g.policy.trim(g.plan, states, confidences, load, g.limits)
            for i, k in zip(g.rows, trimmed, strict=True):
                ks[i] = min(ks[i], max(0, k))
        return ks

    def _draft_budget(self, decodes, prefills, max_k: list[int], frontier) -> int | None:
        """Draft forwards that fit in one target forward of this step, by the cost model."""
        if self.cost is None:
            return None
        size = frontier or max(max_k) + 1
        tokens = sum(min(size, k + 1) for k in max_k) + sum(n for _, n in prefills)
        profile = self.cost.profile
        draft_s = profile.draft_time(len(decodes))
        return max(1, int(profile.target_time(tokens) / draft_s)) if draft_s > 0 else None

    # -- after verification -------------------------------------------------------------------

    def _observe(self, decodes, proposal: Proposal, verdicts: list[Verdict],
                 trimmed: list[list[float]]) -> None:
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
            looked_up = proposal.looked_up[row] if proposal.looked_up else ()
            self.estimator.observe(seq.spec_state, confidences[:k], verdict.num_accepted,
                                   looked_up, trimmed[row] if trimmed else ())
            if k > 0:
                self.policy(seq.spec_state.policy).observe(seq.spec_state, k,
                                                           verdict.num_accepted)

    def _record(self, groups: dict[str, _Group], ks: list[int], verdicts, frontier,
                elapsed: float, limits: Limits, prefills, load: LoadView) -> None:
        self.num_steps += 1
        if not self.trace.enabled or not verdicts:
            return
        name = self.config.policy if self.config.policy in groups else next(iter(groups))
        plan = groups[name].plan
        choice, cost = plan.choice, self.cost
        slo = {}
        if limits != NO_LIMITS:
            slo = {"slo_max_step_time_s": limits.max_step_time_s,
                   "slo_tpot_deadlines_s": limits.tpot_deadlines_s,
                   "slo_met_predicted": choice.meets_limits if choice else None}
        self.trace.record(
            self.num_steps, plan.mode, ks, frontier,
            predicted_accepted=list(choice.expected_accepted) if choice else None,
            realised_accepted=[v.num_accepted for v in verdicts],
            predicted_time_s=choice.step_time_s if choice else None,
            measured_time_s=elapsed, planned_k=list(plan.max_k), cluster_load=load.cluster_load,
            policy=name, target_scale=cost.target_scale if cost else None,
            decode_scale=cost.decode_scale if cost else None,
            draft_scale=cost.draft_scale if cost else None,
            first_draft_scale=cost.first_draft_scale if cost else None,
            prefill_tokens=sum(n for _, n in prefills), **slo,
        )


def _priced_lag(seq: SpecRequest) -> float:
    """The draft rows a request's next first draft token pays for: the token it drafts from, and
    every token its draft missed (the prompt after a prefill, the steps it did not draft), spread
    over the tokens the request has left, since the catch-up serves all of its later steps."""
    missed = seq.num_tokens - seq.num_draft_cached - 1
    left = max(1, seq.params.max_tokens - len(seq.output_token_ids))
    return 1.0 + max(0, missed) / left
