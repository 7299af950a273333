"""The draft model proposes k_i tokens per request over a ragged batch.

Iteration 0 feeds each request every token its draft cache lacks (usually the newest one or two,
the whole prompt after a prefill) and iteration j > 0 feeds the previous draft token; request i
leaves after k_i tokens, or, greedy, earlier when the draft's cumulative confidence in its own
guesses falls below a threshold (the guesses past that point would almost surely be rejected; a
sampled request's confidence is the chance of a token drawn at its temperature, low whatever the
chance that the target accepts it). A seeded request's draft token is its race winner over q
with the noise the target's race at that position uses (faser.layers.race).

A feature draft (faser.models.feature_draft) also reads, for each committed token it is fed, the
target's hidden state before it (from the target's feature cache, by slot), and for each of its
own guesses its own output of the previous iteration. The cache rows it wrote from its own guesses
are not trusted past the step: the next proposal feeds the accepted tokens again, with the
target's features.

With prompt lookup on (faser.spec_decode.lookup), a greedy request's guess is replaced by the
token that followed its newest tokens earlier in its context, when that is likelier to be right
than the draft's own guess; the draft still reads the token, so its next guess follows it. Sampled
requests keep the draft's tokens: their verification needs the draft's distribution, which a
looked-up token does not come from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from faser.layers.race import race_scores
from faser.layers.sampler import argmax, request_probs
from faser.runner.batch import Chunk
from faser.runner.model_runner import ModelRunner
from faser.spec_decode.lookup import MAX_N, PRIOR_PRECISION
from faser.spec_decode.request import SpecRequest, history
from faser_kernels.rejection import sample_inverse_cdf


@dataclass(slots=True)
class Proposal:
    draft_token_ids: list[list[int]]  # per request, k_i tokens (target vocabulary)
    draft_probs: list[torch.Tensor | None]  # per request [k_i, target_vocab]; None when greedy
    confidences: list[list[float]]  # the draft's probability of each of its own tokens
    # per request and token: the n-gram length of a prompt-lookup guess, 0 for the draft's own
    # token (empty: none tracked)
    looked_up: list[list[int]] = field(default_factory=list)
    # tokens fed to each draft forward, a catch-up's included: what the drafting cost
    forward_rows: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, num_requests: int) -> Proposal:
        return cls([[] for _ in range(num_requests)], [None] * num_requests,
                   [[] for _ in range(num_requests)])

    def truncate(self, k: list[int]) -> None:
        for i, k_i in enumerate(k):
            del self.draft_token_ids[i][k_i:], self.confidences[i][k_i:]
            if self.looked_up:
                del self.looked_up[i][k_i:]
            probs = self.draft_probs[i]
            if probs is not None:
                self.draft_probs[i] = probs[:k_i]


class Proposer:
    def __init__(
        self,
        runner: ModelRunner,
        target_vocab_size: int,
        token_map: torch.Tensor | None = None,
        prompt_lookup: bool = False,
        calibration: Callable[[float], float] | None = None,
        lookup_precision: Callable[[int], float] | None = None,
    ) -> None:
        # token_map: [draft_vocab] target ids, for drafts whose output layer covers only the
        # target's most frequent tokens
        if token_map is not None:
            token_map = token_map.to(runner.device)
        self.runner, self.target_vocab_size, self.token_map = runner, target_vocab_size, token_map
        self.prompt_lookup = prompt_lookup
        # the draft's confidence -> how often such tokens are accepted (None: taken at its word);
        # an n-gram length -> how often lookup guesses from such n-grams are (None: the prior)
        self.calibration = calibration
        self.lookup_precision = lookup_precision

    def propose(
        self, seqs: list[SpecRequest], max_k: list[int], stop_confidence: float | None = None
    ) -> Proposal:
        proposal = Proposal([[] for _ in seqs], [None] * len(seqs), [[] for _ in seqs],
                            [[] for _ in seqs])
        q_rows: list[list[torch.Tensor]] = [[] for _ in seqs]
        cumulative = [1.0] * len(seqs)
        active = [i for i, k in enumerate(max_k) if k > 0]
        committed = {i: seqs[i].num_tokens for i in active}
        # prompt lookup: each request's committed tokens indexed once per proposal, their newest
        tails = None
        if self.prompt_lookup:
            tails = dict(zip(active, _index_committed([seqs[i] for i in active]), strict=True))
        guesses: dict[int, torch.Tensor] = {}  # a feature draft's own last output per request
        step = 0
        while active:
            chunks = [
                self._chunk(seqs[i], step, proposal.draft_token_ids[i], guesses.get(i))
                for i in active
            ]
            logits, hidden = self.runner.forward_hidden(chunks)  # [num_active, draft_vocab]
            fed = [len(c.token_ids) for c in chunks]
            proposal.forward_rows.append(sum(fed))
            if self.runner.reads_features:
                ends = torch.tensor(fed).cumsum(0) - 1
                guesses = dict(zip(active, hidden[ends.to(hidden.device)], strict=True))
            # the draft's own tokens so far are the output its penalties look at
            histories = [history(seqs[i], proposal.draft_token_ids[i]) for i in active]
            tokens, confidences, rows = self._picks(
                [seqs[i] for i in active], logits, histories,
                [seqs[i].num_tokens + step for i in active])
            looked_up = [0] * len(active)
            if tails is not None:
                contexts = [tails[i] + proposal.draft_token_ids[i] for i in active]
                looked_up = prefer_lookup([seqs[i] for i in active], contexts, tokens,
                                          confidences, self.calibration, self.lookup_precision)
            for row, i in enumerate(active):
                proposal.looked_up[i].append(looked_up[row])
                proposal.draft_token_ids[i].append(tokens[row])
                proposal.confidences[i].append(confidences[row])
                cumulative[i] *= proposal.confidences[i][-1]
                if not seqs[i].params.by_argmax:  # rejection sampling reads its q rows
                    q_rows[i].append(rows[row])
            step += 1
            active = [
                i for i in active
                if step < max_k[i] and cumulative[i] >= (stop_for(seqs[i], stop_confidence) or 0.0)
            ]
        for i, q in enumerate(q_rows):
            if q:
                proposal.draft_probs[i] = torch.stack(q)
        if self.runner.reads_features:
            for i, n in committed.items():  # rows from its own guesses are redone next time
                seqs[i].mark_draft_cached(n)
        return proposal

    def extend(
        self, seqs: list[SpecRequest], contexts: list[list[int]]
    ) -> list[tuple[int, torch.Tensor | None, float]]:
        """One draft forward: the next token after each context (committed tokens, then any
        drafts assumed to follow them), with its q row (sampled requests; [target_vocab]) and
        its confidence. The draft cache must hold contexts[i][:seqs[i].num_draft_cached]; the
        rest is fed in one chunk (the newest token is fed again when nothing is missing).
        Not for feature drafts, which cannot guess past what the target has read."""
        if self.runner.reads_features:
            raise ValueError("a feature draft cannot draft ahead of the target (no overlap)")
        chunks = []
        for seq, context in zip(seqs, contexts, strict=True):
            start = min(seq.num_draft_cached, len(context) - 1)
            seq.mark_draft_cached(len(context))
            chunks.append(Chunk(context[start:], start, seq.block_table, num_logits=1))
        logits = self.runner.forward(chunks)  # [num_seqs, draft_vocab]
        histories = [history(seq, context[seq.num_tokens :])
                     for seq, context in zip(seqs, contexts, strict=True)]
        tokens, confidences, rows = self._picks(seqs, logits, histories,
                                                [len(context) for context in contexts])
        if self.prompt_lookup:
            _index_committed(seqs)
            tails = [context[-MAX_N:] for context in contexts]
            prefer_lookup(seqs, tails, tokens, confidences, self.calibration,
                          self.lookup_precision)
        return [
            (token, None if seq.params.by_argmax else rows[row].clone(), conf)
            for row, (seq, token, conf) in enumerate(zip(seqs, tokens, confidences, strict=True))
        ]

    def _chunk(
        self, seq: SpecRequest, step: int, drafted: list[int], guess: torch.Tensor | None
    ) -> Chunk:
        features = None  # a feature draft's committed tokens read the target's cache
        if step == 0:
            start = seq.num_draft_cached
            tokens = seq.token_ids[start:]
        else:
            start = seq.num_tokens + step - 1
            tokens = [drafted[-1]]
            if guess is not None:
                features = guess[None]
        seq.mark_draft_cached(start + len(tokens))
        return Chunk(tokens, start, seq.block_table, num_logits=1, features=features)

    def _picks(
        self, seqs: list[SpecRequest], logits: torch.Tensor, histories, positions: list[int]
    ) -> tuple[list[int], list[float], torch.Tensor | None]:
        """Each row's token, the draft's confidence in it and the rows over the target's
        vocabulary they were picked from (None when every row is plain greedy: the argmax and
        its probability are read off the draft's own vocabulary, and no row over the target's,
        three times wider, is built). logits: [num_rows, draft_vocab]; positions: of the token
        each row proposes."""
        params = [seq.params for seq in seqs]
        if all(p.greedy and p.plain for p in params):
            # softmax, not exp(max - logsumexp): right after the draft's forward, logsumexp's
            # several passes cost twice softmax's
            index = argmax(logits)
            confidence = torch.softmax(logits, dim=-1).amax(dim=-1)
            if self.token_map is not None:
                index = self.token_map[index]
            return index.tolist(), confidence.tolist(), None
        rows, confidence = self._request_rows(logits, params, histories)
        return (*self._pick_rows(seqs, rows, confidence, positions), rows)

    def _request_rows(
        self, logits: torch.Tensor, params, histories
    ) -> tuple[torch.Tensor, torch.Tensor]:  # both [num_rows, target_vocab]
        """`request_probs` rows over the target's vocabulary (the histories' token ids are the
        target's), and the confidence of each token. Where the draft has no token, a greedy
        row's logit is -inf and a sampled row's probability 0. The q row stored for a draft
        token is exactly the row it was drawn from."""
        if self.token_map is not None and not all(p.plain for p in params):
            logits = self._to_target_vocab(logits, float("-inf"))
            probs = request_probs(logits, params, histories)
            return probs, self._confidence(logits, probs, params)
        probs = request_probs(logits, params, histories)
        rows = self._to_target_vocab(probs, float("-inf"))
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if self.token_map is not None and sampled:
            rows[sampled] = self._to_target_vocab(probs[sampled], 0.0)
        return rows, self._to_target_vocab(self._confidence(logits, probs, params), 0.0)

    def _to_target_vocab(self, rows: torch.Tensor, fill: float) -> torch.Tensor:
        if self.token_map is None:
            return rows
        out = rows.new_full((rows.shape[0], self.target_vocab_size), fill)
        return out.index_copy_(1, self.token_map, rows)  # [num_rows, target_vocab]

    @staticmethod
    def _confidence(
        logits: torch.Tensor,  # [num_rows, draft_vocab]
        probs: torch.Tensor,  # request_probs(logits, params): distributions of sampled rows
        params,
    ) -> torch.Tensor:  # [num_rows, draft_vocab]
        # the probability the request's own distribution gives each token; greedy requests have
        # none, so the draft's plain softmax stands in for it
        greedy = [p.greedy for p in params]
        if not any(greedy):
            return probs
        softmax = torch.softmax(logits, dim=-1)
        if all(greedy):
            return softmax
        mask = torch.tensor(greedy, device=logits.device)[:, None]
        return torch.where(mask, softmax, probs)

    @classmethod
    def _pick_rows(
        cls,
        seqs: list[SpecRequest],
        rows: torch.Tensor,  # [num_rows, target_vocab]: logits (greedy) or probabilities
        confidence: torch.Tensor,  # [num_rows, target_vocab]
        positions: list[int],
    ) -> tuple[list[int], list[float]]:
        """Each row's token and the draft's confidence in it, read back from the device in one
        copy each (per-row reads would each wait for the device on CUDA)."""
        greedy = any(seq.params.greedy for seq in seqs)
        argmax = rows.argmax(dim=-1).tolist() if greedy else []
        tokens = [
            argmax[r] if seq.params.greedy else cls._pick(seq, rows[r], positions[r])
            for r, seq in enumerate(seqs)
        ]
        index = torch.tensor(tokens, device=rows.device)[:, None]
        return tokens, confidence.gather(1, index)[:, 0].tolist()

    @staticmethod
    def _pick(seq: SpecRequest, row: torch.Tensor, position: int) -> int:
        """A sampled row's token: its race winner when seeded, else drawn from its generator."""
        if seq.params.seeded:
            return int(argmax(race_scores(row[None], seq.params.seed, position)))
        return sample_inverse_cdf(row, float(torch.rand(1, generator=seq.generator)))


def stop_for(seq: SpecRequest, stop: float | None) -> float | None:
    """The cumulative confidence below which `seq`'s draft line stops: greedy requests only."""
    return stop if seq.params.greedy else None


def prefer_lookup(
    seqs: list[SpecRequest],
    tails: list[list[int]],  # per row, the newest tokens of the context it drafts from
    tokens: list[int],
    confidences: list[float],
    calibration: Callable[[float], float] | None = None,
    lookup_precision: Callable[[int], float] | None = None,
) -> list[int]:
    """In place: greedy rows take the looked-up token when it is likelier to be right than the
    draft's, as `lookup_precision` rates the guess and `calibration` the draft's confidence (a
    draft can be right yet unsure: one identical to the target but with random weights is never
    sure); returns, per row, the n-gram length of the guess it took (0: none). Each request's
    index must hold its committed tokens (`_index_committed`)."""
    taken = [0] * len(seqs)
    for row, (seq, tail) in enumerate(zip(seqs, tails, strict=True)):
        if not seq.params.greedy:
            continue
        found = seq.lookup.guess(tail)
        if found is None:
            continue
        token, n = found
        precision = lookup_precision(n) if lookup_precision else PRIOR_PRECISION
        draft = calibration(confidences[row]) if calibration else confidences[row]
        if token == tokens[row]:
            confidences[row] = max(confidences[row], precision)
        elif precision > draft:
            tokens[row], confidences[row], taken[row] = token, precision, n
    return taken


def _index_committed(seqs: list[SpecRequest]) -> list[list[int]]:
    """Adds the greedy requests' new committed tokens to their lookup index; returns each
    request's newest MAX_N committed tokens (token_ids builds a list: once per proposal, not
    once per drafted position)."""
    tails = []
    for seq in seqs:
        token_ids = seq.token_ids
        if seq.params.greedy:
            seq.lookup.extend(token_ids)
        tails.append(token_ids[-MAX_N:])
    return tails
