"""Continuous batching under a token budget.

Each step, running requests that decode come first (one token each, plus whatever speculation the
policy adds later from the budget left), then chunks of prefills, oldest first. When KV blocks run
out, the newest running request is preempted: its blocks are freed and it is recomputed later from
its prompt and the tokens it already has, so memory pressure never fails a request. With prefix
caching, a request's first chunk starts past the leading full blocks that the cache holds for its
tokens (all but the last, whose logits it needs), and each step registers the full blocks the
running requests have computed."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from faser.config import EngineConfig
from faser.engine.sequence import Sequence, SequenceStatus
from faser.runner.block_manager import BlockManager


@dataclass(slots=True)
class SchedulerOutput:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (request, chunk length)
    token_budget_left: int = 0
    num_preempted: int = 0

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 drafts_from_features: bool = False) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.blocks = block_manager
        self.drafts_from_features = drafts_from_features  # a feature draft reads the target's
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(token_budget_left=self.max_num_batched_tokens)
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.is_decoding:
                if self._reserve_decode(seq, out):
                    out.decodes.append(seq)
                    out.token_budget_left -= 1
            else:
                self._schedule_prefill(seq, out)
        while self.waiting and len(self.running) < self.max_num_seqs and out.token_budget_left:
            seq = self.waiting[0]
            if not self._schedule_prefill(seq, out):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return out

    def _reserve_decode(self, seq: Sequence, out: SchedulerOutput) -> bool:
        while not self.blocks.allocate(seq.request_id, seq.block_table, seq.num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _schedule_prefill(self, seq: Sequence, out: SchedulerOutput) -> bool:
        if min(seq.num_uncached, out.token_budget_left) <= 0:
            return False
        shared = not seq.block_table and self._share_prefix(seq)
        chunk = min(seq.num_uncached, out.token_budget_left)
        if not self.blocks.allocate(seq.request_id, seq.block_table, seq.num_cached + chunk):
            if shared:  # a waiting request holds no blocks
                self.blocks.free(seq.block_table)
                seq.reset_caches()
            return False
        out.prefills.append((seq, chunk))
        out.token_budget_left -= chunk
        return True

    def _share_prefix(self, seq: Sequence) -> bool:
        """Whether the cache held leading blocks of a request about to start (or restart) its
        prefill; they are then its own first blocks, computed. A request that asks for prompt
        logprobs computes every position, as those need each one's logits; one that may draft
        from the target's features shares only blocks that hold them."""
        if not self.blocks.prefix_caching or seq.params.prompt_logprobs is not None:
            return False
        featured = self.drafts_from_features and seq.spec_state.policy != "off"
        shared = self.blocks.share(seq.token_ids[: seq.num_tokens - 1], seq.prefix_digests,
                                   featured)
        if not shared.blocks:
            return False
        size = self.blocks.block_size
        seq.block_table.extend(shared.blocks)
        seq.mark_target_cached(shared.num_featured * size)  # the lead whose features are there
        seq.mark_target_cached(len(shared.blocks) * size, featured=False)
        seq.mark_draft_cached(shared.num_draft_ready * size)
        seq.num_draft_marked = shared.num_draft_ready
        seq.num_cached_prompt_tokens = max(seq.num_cached_prompt_tokens,
                                           min(seq.num_cached, len(seq.prompt_token_ids)))
        return True

    def cache_prefix(self, seq: Sequence) -> None:
        """Registers the full blocks the request's caches hold by now (prefix caching)."""
        size = self.blocks.block_size
        num_full, num_draft_full = seq.num_cached // size, seq.num_draft_cached // size
        if not self.blocks.prefix_caching or (
            num_full <= len(seq.prefix_digests)
            and min(num_full, num_draft_full) <= seq.num_draft_marked
        ):
            return
        seq.num_draft_marked = self.blocks.register(
            seq.block_table, seq.token_ids, seq.prefix_digests, seq.num_cached,
            seq.num_draft_cached, seq.num_draft_marked, seq.num_featured)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.cache_prefix(seq)  # its recompute reads back what is still cached
        self.blocks.free(seq.block_table)
        seq.reset_caches()
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        if seq in out.decodes:
            out.decodes.remove(seq)
            out.token_budget_left += 1
        for item in [p for p in out.prefills if p[0] is seq]:
            out.prefills.remove(item)
            out.token_budget_left += item[1]
        out.num_preempted += 1
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
