"""The target verifies draft tokens in frontiers, with early pruning.

Request i feeds x_0 = its newest committed token and x_m = d_m, its m-th draft token; the target's
row m scores position m + 1, so it checks d_{m+1} (and row k_i gives the bonus token). Frontier j
feeds x[j*f : (j+1)*f] of every request still alive, then rejection-samples what it scored. A
request with a rejection is done for the step: its later positions are never computed (early
pruning). With one frontier (f > max k) this is classic draft-then-verify, and with k_i = 0 it is
plain decoding. Prefill chunks ride along in frontier 0 and sample when they complete a prompt.
A seeded request's rows become race scores (faser.layers.race) and are judged by the greedy rule:
its tokens are its races' winners, whatever was drafted.

A row that is not finite (the model's own NaN or overflow, which no sampler can draw from) fails
its request with finish_reason "error" only where plain decoding would meet it: the request
commits what its rows before it accept, and fails if they accept every draft token up to it; a
row past a rejection is never read. The others in the forward go on."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from faser.layers.race import race_scores
from faser.layers.sampler import History, argmax, request_probs, token_logprobs
from faser.runner.batch import Chunk
from faser.runner.model_runner import ModelRunner
from faser.sampling_params import SamplingParams
from faser.spec_decode.proposer import Proposal
from faser.spec_decode.request import SpecRequest, history
from faser_kernels import rejection_sample
from faser_kernels.rejection import greedy_tokens


@dataclass(slots=True)
class Verdict:
    """The outcome for one decoding request: its committed tokens this step."""

    token_ids: list[int] = field(default_factory=list)
    num_accepted: int = 0
    num_pruned: int = 0  # target positions never computed thanks to a rejection
    done: bool = False


@dataclass(slots=True)
class _Entry:
    """One request's share of a frontier's rejection sampling."""

    checked: list[int]  # draft tokens this frontier scores
    rows: torch.Tensor  # [len(checked) + 1, vocab] target logits; the last is the bonus row
    q: torch.Tensor | None  # [len(checked), vocab] draft distribution of sampled requests
    u_accept: torch.Tensor  # [len(checked)]
    u_sample: torch.Tensor  # [1]
    params: SamplingParams
    final: bool  # the bonus row is real (the frontier reaches the last draft token)
    seq: SpecRequest
    history: History | None  # its first row's (penalised requests); row r adds checked[:r]
    first_position: int  # of the token its first row scores
    cut_short: bool = False  # the frontier's next row is not finite: accepting all reaches it

    def histories(self) -> list[History | None]:
        if self.history is None:
            return [None] * self.rows.shape[0]
        h = self.history
        return [History(h.prompt_ids, h.output_ids + self.checked[:r])
                for r in range(self.rows.shape[0])]


class Verifier:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def verify(
        self,
        seqs: list[SpecRequest],
        proposal: Proposal,
        prefills: list[tuple[SpecRequest, int]],
        frontier_size: int | None = None,
    ) -> tuple[list[Verdict], list[int | None]]:
        """A verdict per decoding request and, per prefill chunk, the token sampled when the
        chunk completed its prompt (None otherwise)."""
        drafts = proposal.draft_token_ids
        num_inputs = max((len(d) + 1 for d in drafts), default=1)
        f = num_inputs if frontier_size is None else max(1, frontier_size)
        verdicts = [Verdict() for _ in seqs]
        uniforms = [_uniforms(s, len(d)) for s, d in zip(seqs, drafts, strict=True)]
        starts = [s.num_cached for s in seqs]
        prefill_tokens: list[int | None] = [None] * len(prefills)
        for j in range(0, num_inputs, f):
            alive = [i for i, v in enumerate(verdicts) if not v.done and j <= len(drafts[i])]
            riders = prefills if j == 0 else []
            if not alive and not riders:
                break
            items = [
                _frontier_item(seqs[i], proposal, i, starts[i], j, f, uniforms[i], verdicts[i])
                for i in alive
            ]
            self.verify_items(items, riders, prefill_tokens)
        for i, verdict in enumerate(verdicts):
            verdict.num_pruned = len(drafts[i]) + 1 - (seqs[i].num_cached - starts[i])
        return verdicts, prefill_tokens

    def verify_items(
        self,
        items: list[FrontierItem],
        prefills: list[tuple[SpecRequest, int]],
        prefill_tokens: list[int | None],
    ) -> None:
        """One target forward over frontiers of different requests, each at its own offset (the
        overlapped step verifies a request as soon as its drafts exist), plus prefill riders;
        updates each item's verdict and fills `prefill_tokens` as `verify` does."""
        fed = [it.seq for it in items] + [seq for seq, _ in prefills]
        # a feature draft reads what the target computed (its feature cache), also in the steps
        # its request does not draft; policy `off`'s requests never draft, and a step of theirs
        # alone skips computing them (their requests then know which positions lack them)
        keep = bool(self.runner.feature_layers) and any(s.spec_state.policy != "off" for s in fed)
        chunks = [_verify_chunk(it.seq, it.draft, it.start, it.offset, it.size, keep)
                  for it in items]
        chunks += [_prefill_chunk(seq, n, keep) for seq, n in prefills]
        logits, _ = self.runner.forward_hidden(chunks, features=keep)
        broken = _broken_rows(logits)
        entries: list[_Entry] = []
        owners: list = []
        row = 0
        for it in items:
            start, row = row, row + _num_inputs(it)
            cut = min((r - start for r in broken if start <= r < row), default=None)
            if cut == 0:  # its very first row: nothing of this frontier can be committed
                it.seq.finish_reason = "error"
                it.verdict.done = True
                continue
            entries.append(_decode_entry(it, logits[start:row], cut))
            owners.append(it.verdict)
        for p, ((seq, _), chunk) in enumerate(zip(prefills, chunks[len(items):], strict=True)):
            rows = logits[row : row + chunk.num_logits]
            row += chunk.num_logits
            if broken and _fails(seq, broken, row - chunk.num_logits, row):
                continue
            if chunk.num_logits == len(chunk.token_ids) and seq.params.prompt_logprobs is not None:
                _score_prompt(seq, chunk, rows)
            if seq.num_cached == seq.num_tokens:
                entries.append(_prefill_entry(seq, rows[-1:]))
                owners.append(p)
        if entries:
            self._judge(entries, owners, prefill_tokens)

    @staticmethod
    def _judge(entries: list[_Entry], owners: list, prefill_tokens: list[int | None]) -> None:
        if all(e.params.greedy and e.params.plain for e in entries):
            out, num_accepted = _greedy_outcomes(entries)
        else:
            out, num_accepted = _sampled_outcomes(entries)
        committed = []
        for g, (entry, owner) in enumerate(zip(entries, owners, strict=True)):
            accepted = num_accepted[g]
            if isinstance(owner, int):
                prefill_tokens[owner] = out[g][0]
                committed.append(out[g][:1])
                continue
            rejected = accepted < len(entry.checked)
            # past a non-final frontier with no rejection, the "bonus" is a placeholder
            committed.append(out[g][: accepted + int(rejected or entry.final)])
            owner.token_ids += committed[-1]
            owner.num_accepted += accepted
            owner.done = rejected or entry.final or entry.cut_short
            if entry.cut_short and not rejected:  # after its tokens (a stop among them wins)
                entry.seq.finish_reason = "error"
        _record_logprobs(entries, committed)


def _greedy_outcomes(entries: list[_Entry]) -> tuple[list[list[int]], list[int]]:
    """Each entry's tokens and accepted count when every row is plain greedy: the target's argmax
    is the whole verdict (rejection sampling's greedy rule, without building its inputs)."""
    # one read of the argmaxes (each read waits for the device on CUDA), no copy of the rows
    tokens = torch.cat([argmax(e.rows) for e in entries]).tolist()
    out, row = [], 0
    for e in entries:
        out.append(greedy_tokens(e.checked, tokens[row : row + e.rows.shape[0]]))
        row += e.rows.shape[0]
    return out, [len(t) - 1 for t in out]


def _sampled_outcomes(entries: list[_Entry]) -> tuple[list[list[int]], list[int]]:
    """Each entry's tokens and accepted count by rejection sampling (faser_kernels.rejection); a
    seeded entry's rows are race scores, judged by the greedy rule."""
    logits = torch.cat([e.rows for e in entries])  # [num_rows, vocab]
    vocab = logits.shape[-1]
    params = [e.params for e in entries for _ in range(e.rows.shape[0])]
    cu = [0]
    for e in entries:
        cu.append(cu[-1] + len(e.checked))
    # every input on the logits' device (the Triton kernel reads them all on CUDA); the
    # uniforms come from the requests' CPU generators
    device = logits.device
    histories = [h for e in entries for h in e.histories()]
    probs = request_probs(logits, params, histories)
    row = 0
    for e in entries:
        if e.params.seeded:
            rows = slice(row, row + e.rows.shape[0])
            probs[rows] = race_scores(probs[rows], e.params.seed, e.first_position)
        row += e.rows.shape[0]
    has_q = any(e.q is not None for e in entries)
    result = rejection_sample(
        torch.tensor([t for e in entries for t in e.checked], dtype=torch.long, device=device),
        torch.tensor(cu, dtype=torch.long, device=device),
        torch.cat([e.q if e.q is not None
                   else torch.zeros(len(e.checked), vocab, device=device)
                   for e in entries]) if has_q else None,
        probs,
        torch.tensor([e.params.by_argmax for e in entries], device=device),
        torch.cat([e.u_accept for e in entries]).to(device),
        torch.cat([e.u_sample for e in entries]).to(device),
    )
    # one read each, not one per request
    return result.output_token_ids.tolist(), result.num_accepted.tolist()


def _record_logprobs(entries: list[_Entry], committed: list[list[int]]) -> None:
    """Appends to each request that asks for them the logprobs of the tokens it committed: the
    token committed at an entry's position r was scored by the entry's row r."""
    rows, tokens, num_top, owners = [], [], [], []
    start = 0
    for entry, token_ids in zip(entries, committed, strict=True):
        if entry.params.logprobs is not None:
            rows += range(start, start + len(token_ids))
            tokens += token_ids
            num_top += [entry.params.logprobs] * len(token_ids)
            owners += [entry.seq] * len(token_ids)
        start += entry.rows.shape[0]
    if not rows:
        return
    logits = torch.cat([e.rows for e in entries])
    index = torch.tensor(rows, device=logits.device)
    for seq, logprob in zip(owners, token_logprobs(logits[index], tokens, num_top), strict=True):
        seq.logprobs.append(logprob)


def _score_prompt(seq: SpecRequest, chunk: Chunk, rows: torch.Tensor) -> None:
    """Prompt logprobs from a prefill chunk's rows ([len(chunk.token_ids), vocab]: row i scores
    position start + i + 1); positions already scored (before a preemption) are skipped."""
    if not seq.prompt_logprobs:
        seq.prompt_logprobs.append(None)  # nothing predicts the first token
    first = len(seq.prompt_logprobs)  # the next position to score
    end = min(chunk.start_pos + len(chunk.token_ids) + 1, len(seq.prompt_token_ids))
    if end <= first:
        return
    index = torch.arange(first, end) - chunk.start_pos - 1
    scored = token_logprobs(rows[index.to(rows.device)], seq.prompt_token_ids[first:end],
                            [seq.params.prompt_logprobs] * (end - first))
    seq.prompt_logprobs.extend(scored)


def _broken_rows(logits: torch.Tensor) -> set[int]:
    """The rows whose logits are not finite. Each logit sums over the whole final hidden state,
    so a NaN or an infinity the model made reaches all of its row, and one column shows it."""
    bad = ~torch.isfinite(logits[:, 0])
    if not bool(bad.any()):  # one read of a flag, not of the rows
        return set()
    return set(torch.nonzero(bad).flatten().tolist())


def _fails(seq: SpecRequest, broken: set[int], start: int, end: int) -> bool:
    """Whether one of the request's rows start..end-1 is broken; ends the request if so (its
    cache then holds the NaN too, so no later step of it could do better)."""
    if broken.isdisjoint(range(start, end)):
        return False
    seq.finish_reason = "error"
    return True


def _uniforms(seq: SpecRequest, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if seq.params.by_argmax:
        return torch.zeros(k), torch.zeros(1)
    u = torch.rand(k + 1, generator=seq.generator)
    return u[:k], u[k:]


def _verify_chunk(seq: SpecRequest, draft: list[int], start: int, j: int, f: int,
                  featured: bool) -> Chunk:
    inputs = ([seq.last_token_id] + draft)[j : j + f]
    seq.mark_target_cached(start + j + len(inputs), featured)
    return Chunk(inputs, start + j, seq.block_table, num_logits=len(inputs))


def _prefill_chunk(seq: SpecRequest, n: int, featured: bool) -> Chunk:
    start = seq.num_cached
    seq.mark_target_cached(start + n, featured)
    completes = seq.num_cached == seq.num_tokens
    # prompt logprobs read every position's logits (until all are scored, as a preempted
    # request's prefill may come again); sampling reads only the last one's
    scores = (seq.params.prompt_logprobs is not None
              and len(seq.prompt_logprobs) < len(seq.prompt_token_ids))
    num_logits = n if scores else int(completes)
    return Chunk(seq.token_ids[start : start + n], start, seq.block_table, num_logits)


def _num_inputs(it: FrontierItem) -> int:
    return min(it.size, len(it.draft) + 1 - it.offset)


def _decode_entry(it: FrontierItem, logits: torch.Tensor, cut: int | None) -> _Entry:
    """The item's share of the frontier: `logits` are its rows. With a `cut`, the rows from
    that one on are not finite: the entry checks the draft tokens before it and no more."""
    n_inputs = _num_inputs(it) if cut is None else cut
    final = cut is None and it.offset + n_inputs == len(it.draft) + 1
    checked = it.draft[it.offset : it.offset + n_inputs - int(final)]  # the last row: the bonus
    rows = logits[:n_inputs]
    if not final:  # no bonus row in this frontier: repeat the last row; its sample is unused
        rows = torch.cat([rows, rows[-1:]])
    q = None if it.q is None else it.q[it.offset : it.offset + len(checked)]
    u_accept, u_sample = it.uniforms
    return _Entry(checked, rows, q, u_accept[: len(checked)], u_sample, it.seq.params, final,
                  it.seq, history(it.seq, it.draft[: it.offset]), it.seq.num_tokens + it.offset,
                  cut_short=cut is not None)


def _prefill_entry(seq: SpecRequest, rows: torch.Tensor) -> _Entry:
    u = torch.zeros(1) if seq.params.by_argmax else torch.rand(1, generator=seq.generator)
    return _Entry([], rows, None, torch.zeros(0), u, seq.params, True, seq, history(seq),
                  seq.num_tokens)


@dataclass(slots=True)
class FrontierItem:
    """One request's frontier in `Verifier.verify_items`."""

    seq: SpecRequest
    draft: list[int]  # its draft tokens so far (at most k_i), through this frontier's checks
    q: torch.Tensor | None  # [len(draft), vocab] draft distribution of a sampled request
    start: int  # seq.num_cached when the step began
    offset: int  # the frontier feeds x[offset : offset + size]
    size: int
    uniforms: tuple[torch.Tensor, torch.Tensor]  # accept [checked tokens], sample [1]
    verdict: Verdict


def _frontier_item(seq, proposal: Proposal, i: int, start: int, j: int, f: int, uniforms,
                   verdict: Verdict) -> FrontierItem:
    draft = proposal.draft_token_ids[i]
    checks = frontier_checks(len(draft), j, f)
    u_accept, u_sample = uniforms
    return FrontierItem(seq, draft, proposal.draft_probs[i], start, j, f,
                        (u_accept[j : j + checks], u_sample), verdict)


def frontier_checks(num_drafts: int, offset: int, size: int) -> int:
    """Draft tokens a frontier checks (its last row is the bonus when it reaches the end)."""
    n_inputs = min(size, num_drafts + 1 - offset)
    return n_inputs - int(offset + n_inputs == num_drafts + 1)
