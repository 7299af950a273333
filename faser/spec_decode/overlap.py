"""The overlapped step (mode `overlap`): the draft and the target run at once on two lanes, so that
a step's latency tends to max(draft, verify) per tick instead of their sum.

- Ticks: in each, the target lane verifies the next frontier of every request whose drafts exist
  (prefill chunks ride the first) while the draft lane drafts ahead; the lanes meet at the end,
  where the next tick is planned, so no batch depends on which lane finishes first.
- Pre-verify: a frontier is verified as soon as its drafts exist, while the next one is drafted.
- Post-verify: a request keeps drafting past its k_i while those drafts are likely to be used
  (MIN_POST_SURVIVAL); when all k_i are accepted and the bonus token equals the draft's own guess,
  the drafts past it are carried into the next step.
- A request whose verification ended starts drafting its next step at once from its committed
  tokens, while the target verifies the others.
- Lossless and reproducible: verification is the verifier's own, a carried draft is used only when
  its context equals the committed tokens, and a request's generator is drawn by the draft lane
  during ticks and by the main thread between them, never by both.
- KV: the draft lane writes past the verified tokens only into slots `reserve` grew from free
  blocks (never preempting), and a carry's tokens are fed again, in one chunk, in the next step's
  first draft forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from faser.runner.lanes import Lanes
from faser.spec_decode.proposer import Proposal, Proposer, stop_for
from faser.spec_decode.request import SpecRequest
from faser.spec_decode.verifier import FrontierItem, Verdict, Verifier, frontier_checks

Reserve = Callable[[SpecRequest, int], bool]
# post-verify drafts are made only while the chance that they are used, alpha^(k+t), stays above
# this: on a CPU whose cores are shared, wasted drafts slow the target down
MIN_POST_SURVIVAL = 0.05


@dataclass(slots=True)
class DraftLine:
    """Draft tokens that continue `base` (committed tokens, then none, or all assumed)."""

    base: list[int]
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor | None] = field(default_factory=list)  # q rows [target_vocab]
    confidences: list[float] = field(default_factory=list)
    survival: float = 1.0  # the product of the confidences
    stopped: bool = False  # the survival fell below the stop threshold: drafting ends here

    def context(self) -> list[int]:
        return self.base + self.tokens

    def append(self, token: int, q: torch.Tensor | None, confidence: float,
               stop: float | None) -> None:
        self.tokens.append(token)
        self.probs.append(q)
        self.confidences.append(confidence)
        self.survival *= confidence
        self.stopped = stop is not None and self.survival < stop

    def rebase(self, committed: list[int], stop: float | None) -> DraftLine:
        """The line once `committed` is appended to the base: the drafts past it when it is the
        line's own beginning (post-verify work kept), else an empty line."""
        n = len(committed)
        line = DraftLine(self.base + committed)
        if self.tokens[:n] == committed:
            for token, q, c in zip(self.tokens[n:], self.probs[n:], self.confidences[n:],
                                   strict=True):
                line.append(token, q, c, stop)
                if line.stopped:
                    break
        return line


@dataclass(slots=True)
class _Request:
    seq: SpecRequest
    k: int  # drafts to verify; shrinks when the draft's confidence stops the line first
    lookahead: int  # drafts worth making for the next step (the request's max_k)
    post: int  # drafts worth making past k_i before the verdict (see MIN_POST_SURVIVAL)
    line: DraftLine
    start: int  # seq.num_cached when the step began
    verdict: Verdict = field(default_factory=Verdict)
    offset: int = 0  # the next frontier feeds x[offset : offset + size]
    drafted: DraftLine = field(default_factory=lambda: DraftLine([]))  # as it was verified

    def ready(self, size: int) -> bool:
        return not self.verdict.done and len(self.line.tokens) >= min(self.offset + size, self.k)


@dataclass(slots=True)
class OverlapStats:
    steps: int = 0
    exposed_draft_forwards: int = 0  # in ticks where the target had nothing to do
    carried_tokens: int = 0  # drafts made in an earlier step and verified in this one


class OverlapStep:
    def __init__(self, proposer: Proposer, verifier: Verifier, lanes: Lanes) -> None:
        self.proposer, self.verifier, self.lanes = proposer, verifier, lanes
        self.block_size = proposer.runner.block_size
        self.carries: dict[str, DraftLine] = {}
        self.stats = OverlapStats()

    def forget(self) -> None:
        """Drops the carries (a step ran without overlap; they could not match anyway)."""
        self.carries.clear()

    def run(
        self, decodes: list[SpecRequest], prefills: list[tuple[SpecRequest, int]],
        max_k: list[int], frontier_size: int | None, stop: float | None, reserve: Reserve,
        draft_budget: int | None = None,
    ) -> tuple[Proposal, list[Verdict], list[int | None]]:
        """`draft_budget`: draft forwards that fit in one target forward (from the cost profile),
        which caps the look-ahead of a tick; None: as many as the frontier has positions."""
        reqs = [self._request(seq, k) for seq, k in zip(decodes, max_k, strict=True)]
        size = max(1, frontier_size) if frontier_size else max(max_k, default=0) + 1
        prefill_tokens: list[int | None] = [None] * len(prefills)
        riders = list(prefills)
        while riders or any(not r.verdict.done for r in reqs):
            items = [self._item(r, size) for r in reqs if r.ready(size)]
            target_busy = bool(items or riders)
            budget = min(size, draft_budget or size) if target_busy else 0
            plan = self._draft_plan(reqs, size, budget, reserve)
            if not target_busy and not plan:
                raise RuntimeError("overlapped step stalled: nothing to verify or draft")
            self._tick(items, riders, prefill_tokens, plan, stop)
            riders = []
            self._settle(reqs, items, size, stop)
        self.carries = {r.seq.request_id: r.line for r in reqs if r.line.tokens}
        self.stats.steps += 1
        return self._proposal(reqs), [r.verdict for r in reqs], prefill_tokens

    # -- planning, at the meeting point -----------------------------------------------------

    def _request(self, seq: SpecRequest, k: int) -> _Request:
        carry = self.carries.get(seq.request_id)
        line = DraftLine(list(seq.token_ids))
        if k > 0 and carry is not None and carry.base == line.base:
            line = carry
            self.stats.carried_tokens += min(k, len(carry.tokens))
        if line.stopped:
            k = min(k, len(line.tokens))
        lookahead = seq.spec_state.max_k if k > 0 else 0
        alpha = min(1.0, max(0.0, seq.spec_state.alpha))
        post = sum(alpha ** (k + t) >= MIN_POST_SURVIVAL for t in range(1, lookahead + 2))
        return _Request(seq, k, lookahead, post, line, seq.num_cached)

    def _item(self, r: _Request, size: int) -> FrontierItem:
        draft = r.line.tokens[: r.k]
        checks = frontier_checks(len(draft), r.offset, size)
        by_argmax = r.seq.params.by_argmax
        q = torch.stack(r.line.probs[: len(draft)]) if draft and not by_argmax else None
        u = (torch.zeros(checks + 1) if by_argmax
             else torch.rand(checks + 1, generator=r.seq.generator))
        return FrontierItem(r.seq, draft, q, r.start, r.offset, size, (u[:checks], u[checks:]),
                            r.verdict)

    def _draft_plan(
        self, reqs: list[_Request], size: int, budget: int, reserve: Reserve
    ) -> list[tuple[_Request, int]]:
        """(request, drafts to make this tick). The drafts the next frontiers need come first;
        past them, look-ahead (post-verify, or the next step's drafts once verified) fills the
        tick up to `budget` draft forwards (0 when the target has nothing to do: the step waits
        on the draft alone then, so it drafts only what a frontier needs)."""
        plan = []
        for r in reqs:
            if r.lookahead == 0 or r.line.stopped:
                continue
            have = len(r.line.tokens)
            if r.verdict.done:
                required, cap = 0, r.lookahead
            else:
                ahead = 2 if r.ready(size) else 1  # verified this tick: prepare the next one
                required = max(0, min(r.offset + ahead * size, r.k) - have)
                cap = r.k + r.post
            want = self._reserve(r, max(required, min(budget, max(0, cap - have))), reserve)
            if want > 0:
                plan.append((r, want))
        return plan

    def _reserve(self, r: _Request, want: int, reserve: Reserve) -> int:
        """Drafts that fit in the request's slots, grown from free blocks only."""
        length = len(r.line.base) + len(r.line.tokens)
        if want == 0 or reserve(r.seq, length + want - 1):
            return want
        return max(0, len(r.seq.block_table) * self.block_size - length + 1)

    # -- the tick: both lanes at once -------------------------------------------------------

    def _tick(self, items, riders, prefill_tokens, plan, stop) -> None:
        target = None
        if items or riders:
            target = self.lanes.target.submit(self.verifier.verify_items, items, riders,
                                              prefill_tokens)
        draft = self.lanes.draft.submit(self._draft, plan, stop) if plan else None
        forwards = draft.result() if draft is not None else 0
        if target is not None:
            target.result()
        else:
            self.stats.exposed_draft_forwards += forwards

    def _draft(self, plan: list[tuple[_Request, int]], stop: float | None) -> int:
        """Runs on the draft lane: up to `want` draft forwards per request, batched."""
        forwards = 0
        while active := [r for r, want in plan if forwards < want and not r.line.stopped]:
            contexts = [r.line.context() for r in active]
            drafted = self.proposer.extend([r.seq for r in active], contexts)
            for r, (token, q, confidence) in zip(active, drafted, strict=True):
                r.line.append(token, q, confidence, stop_for(r.seq, stop))
            forwards += 1
        return forwards

    def _settle(self, reqs: list[_Request], items: list[FrontierItem], size: int, stop) -> None:
        """After a tick: advance the verified requests; rebase the finished ones on their
        committed tokens, so that the draft lane can start their next step."""
        verified = {id(it.seq) for it in items}
        for r in reqs:
            if r.line.stopped and not r.verdict.done:
                r.k = min(r.k, len(r.line.tokens))
            if id(r.seq) not in verified:
                continue
            r.offset += size
            if r.verdict.done:
                self._finish(r, stop)

    def _finish(self, r: _Request, stop: float | None) -> None:
        line, n = r.line, min(r.k, len(r.line.tokens))
        r.drafted = DraftLine(line.base, line.tokens[:n], line.probs[:n], line.confidences[:n])
        r.verdict.num_pruned = r.k + 1 - (r.seq.num_cached - r.start)
        old = line.context()
        r.line = line.rebase(r.verdict.token_ids, stop_for(r.seq, stop))
        # the draft cache holds old[:num_draft_cached]; keep only what the new line shares
        new = r.line.context()
        same = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b),
                    min(len(old), len(new)))
        r.seq.mark_draft_cached(min(r.seq.num_draft_cached, same))

    @staticmethod
    def _proposal(reqs: list[_Request]) -> Proposal:
        lines = [r.drafted for r in reqs]
        probs = [torch.stack(d.probs) if d.tokens and d.probs[0] is not None else None
                 for d in lines]
        return Proposal([d.tokens for d in lines], probs, [d.confidences for d in lines])
