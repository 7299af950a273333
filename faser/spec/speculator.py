"""One speculative step over the scheduled batch: choose k -> propose -> verify by frontiers.

The speculator owns the policies, the proposer and the verifier; the engine hands it the
scheduled requests and commits what it returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from faser.config import SpecConfig
from faser.outputs import SpecStats
from faser.runner.model_runner import ModelRunner
from faser.spec.plan import LoadView, StepPlan
from faser.spec.policy import Policy, make_policy
from faser.spec.proposer import Proposal, Proposer
from faser.spec.request import SpecRequest
from faser.spec.verifier import Verdict, Verifier

# grows a request's block table to cover n slots; False when no block is free
Reserve = Callable[[SpecRequest, int], bool]


class Speculator:
    def __init__(
        self,
        config: SpecConfig,
        target: ModelRunner,
        draft: ModelRunner | None,
        token_map: torch.Tensor | None,
    ) -> None:
        self.config = config
        self.verifier = Verifier(target)
        vocab = target.vocab_size
        self.proposer = Proposer(draft, vocab, token_map) if draft is not None else None
        self._policies: dict[str, Policy] = {}
        self.cluster_load: float | None = None
        self.mode = "off" if config.policy == "off" else "prune"
        self.stats = SpecStats()

    @property
    def has_draft(self) -> bool:
        return self.proposer is not None

    def policy(self, name: str) -> Policy:
        if name not in self._policies:
            self._policies[name] = make_policy(replace(self.config, policy=name))
        return self._policies[name]

    def run(
        self,
        decodes: list[SpecRequest],
        prefills: list[tuple[SpecRequest, int]],
        load: LoadView,
        reserve: Reserve,
    ) -> tuple[list[Verdict], list[int | None]]:
        plans = self._plan(decodes, load)
        max_k = self._fit(decodes, plans, load.token_budget, reserve)
        proposal = self._propose(decodes, max_k, plans)
        frontier = self.config.frontier_size or min(
            (p.frontier_size for p in plans.values() if p.frontier_size), default=None
        )
        verdicts, prefill_tokens = self.verifier.verify(decodes, proposal, prefills, frontier)
        self._observe(decodes, proposal, verdicts)
        return verdicts, prefill_tokens

    def _plan(self, decodes: list[SpecRequest], load: LoadView) -> dict[str, StepPlan]:
        """One plan per policy present in the batch (requests may override the engine's)."""
        plans: dict[str, StepPlan] = {}
        for name in {s.spec_state.policy for s in decodes}:
            group = [s.spec_state for s in decodes if s.spec_state.policy == name]
            plans[name] = self.policy(name).plan(group, load)
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
        early = any(getattr(self.policy(name), "early_stop", False) for name in plans)
        stop = self.config.draft_stop_confidence if early else None
        proposal = self.proposer.propose(decodes, max_k, stop)
        proposal.truncate(self._trim(decodes, proposal, plans))
        return proposal

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
        for seq, drafted, verdict in zip(decodes, proposal.draft_token_ids, verdicts, strict=True):
            k = len(drafted)
            for stats in (seq.stats, self.stats):
                stats.num_steps += 1
                stats.num_drafts += int(k > 0)
                stats.num_draft_tokens += k
                stats.num_accepted_tokens += verdict.num_accepted
                stats.num_pruned_positions += verdict.num_pruned
            self.policy(seq.spec_state.policy).observe(seq.spec_state, k, verdict.num_accepted)
