"""The draft model proposes k_i tokens per request over a ragged batch.

Iteration 0 feeds each request every token its draft cache lacks (usually the newest one or two,
the whole prompt after a prefill) and iteration j > 0 feeds the previous draft token; request i
leaves after k_i tokens, or earlier when the draft's cumulative confidence in its own guesses
falls below a threshold (the guesses past that point would almost surely be rejected)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from faser.runner.batch import Chunk
from faser.runner.model_runner import ModelRunner
from faser.spec.request import SpecRequest
from faser.spec.sampling import request_probs
from faser_kernels.rejection import sample_inverse_cdf


@dataclass(slots=True)
class Proposal:
    draft_token_ids: list[list[int]]  # per request, k_i tokens (target vocabulary)
    draft_probs: list[torch.Tensor | None]  # per request [k_i, target_vocab]; None when greedy
    confidences: list[list[float]]  # the draft's probability of each of its own tokens

    def truncate(self, k: list[int]) -> None:
        for i, k_i in enumerate(k):
            del self.draft_token_ids[i][k_i:], self.confidences[i][k_i:]
            probs = self.draft_probs[i]
            if probs is not None:
                self.draft_probs[i] = probs[:k_i]


class Proposer:
    def __init__(
        self, runner: ModelRunner, target_vocab_size: int, token_map: torch.Tensor | None = None
    ) -> None:
        # token_map: [draft_vocab] target ids, for drafts whose output layer covers only the
        # target's most frequent tokens
        self.runner, self.target_vocab_size, self.token_map = runner, target_vocab_size, token_map

    def propose(
        self, seqs: list[SpecRequest], max_k: list[int], stop_confidence: float | None = None
    ) -> Proposal:
        proposal = Proposal([[] for _ in seqs], [None] * len(seqs), [[] for _ in seqs])
        q_rows: list[list[torch.Tensor]] = [[] for _ in seqs]
        cumulative = [1.0] * len(seqs)
        active = [i for i, k in enumerate(max_k) if k > 0]
        step = 0
        while active:
            chunks = [self._chunk(seqs[i], step, proposal.draft_token_ids[i]) for i in active]
            logits = self.runner.forward(chunks)  # [num_active, draft_vocab]
            params = [seqs[i].params for i in active]
            rows = self._to_target_vocab(request_probs(logits, params), float("-inf"))
            confidence = self._to_target_vocab(self._confidence(logits, params), 0.0)
            for row, i in enumerate(active):
                token = self._pick(seqs[i], rows[row])
                proposal.draft_token_ids[i].append(token)
                proposal.confidences[i].append(float(confidence[row, token]))
                cumulative[i] *= proposal.confidences[i][-1]
                if not seqs[i].params.greedy:
                    q_rows[i].append(rows[row])
            step += 1
            active = [
                i for i in active
                if step < max_k[i] and (stop_confidence is None or cumulative[i] >= stop_confidence)
            ]
        for i, q in enumerate(q_rows):
            if q:
                proposal.draft_probs[i] = torch.stack(q)
        return proposal

    @staticmethod
    def _chunk(seq: SpecRequest, step: int, drafted: list[int]) -> Chunk:
        if step == 0:
            start = seq.num_draft_cached
            tokens = seq.token_ids[start:]
        else:
            start = seq.num_tokens + step - 1
            tokens = [drafted[-1]]
        seq.num_draft_cached = start + len(tokens)
        return Chunk(tokens, start, seq.block_table, num_logits=1)

    def _to_target_vocab(self, rows: torch.Tensor, fill: float) -> torch.Tensor:
        if self.token_map is None:
            return rows
        out = rows.new_full((rows.shape[0], self.target_vocab_size), fill)
        return out.index_copy_(1, self.token_map, rows)  # [num_rows, target_vocab]

    @staticmethod
    def _confidence(logits: torch.Tensor, params) -> torch.Tensor:  # [num_rows, draft_vocab]
        # the probability the request's own distribution gives each token; greedy requests have
        # none, so the draft's plain softmax stands in for it
        probs = torch.softmax(logits, dim=-1)
        sampled = request_probs(logits, params)
        greedy = torch.tensor([p.greedy for p in params])[:, None]
        return torch.where(greedy, probs, sampled)

    @staticmethod
    def _pick(seq: SpecRequest, row: torch.Tensor) -> int:
        if seq.params.greedy:
            return int(row.argmax())
        return sample_inverse_cdf(row, float(torch.rand(1, generator=seq.generator)))
