"""Turns logits into what a request samples from: its logit bias, penalties, temperature, min-p,
top-k, top-p, and the raw logprobs of the tokens it gave.

The same processing is applied to the draft's and the target's logits, so that rejection sampling
reproduces exactly the distribution the request asked for. Every step is elementwise or reduces
along one row, so a row's result does not depend on the rows beside it. A row's penalties look at
its own history: the request's prompt, its committed output and the draft tokens before the row's
position (row m of a verification scores position m + 1, after d_1..d_m), so a verification row
gets the processing a plain decode would give it at that point."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from faser.outputs import TokenLogprob
from faser.sampling_params import SamplingParams
from faser_kernels import cpu_ops


def logits_to_probs(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    temperature: torch.Tensor,  # [num_rows] > 0
    top_k: torch.Tensor,  # [num_rows] int, 0 = off
    top_p: torch.Tensor,  # [num_rows] in (0, 1]
    min_p: torch.Tensor | None = None,  # [num_rows] in [0, 1], 0 = off
) -> torch.Tensor:  # [num_rows, vocab]
    # vLLM's order: temperature, then min-p, then top-k and top-p
    logits = logits / temperature[:, None]
    if min_p is not None and bool((min_p > 0).any()):
        logits = _apply_min_p(logits, min_p)
    if bool((top_k > 0).any()):
        logits = _apply_top_k(logits, top_k)
    if bool((top_p < 1.0).any()):
        logits = _apply_top_p(logits, top_p)
    return torch.softmax(logits, dim=-1)


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    prompt_mask: torch.Tensor,  # [num_rows, vocab] bool: the token is in the row's prompt
    output_counts: torch.Tensor,  # [num_rows, vocab] float32: times it is in the row's output
    repetition: torch.Tensor,  # [num_rows] > 0, 1 = off
    frequency: torch.Tensor,  # [num_rows], 0 = off
    presence: torch.Tensor,  # [num_rows], 0 = off
) -> torch.Tensor:  # [num_rows, vocab]
    """vLLM's penalties: the repetition penalty over prompt and output (dividing a positive logit,
    multiplying a negative one, so a seen token always becomes less likely for p > 1), then
    OpenAI's frequency and presence penalties over the output alone."""
    in_output = output_counts > 0
    rep = repetition[:, None]
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(prompt_mask | in_output, scaled, logits)
    return logits - frequency[:, None] * output_counts - presence[:, None] * in_output


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    max_k = int(k.max())
    kth = logits.topk(max_k, dim=-1).values.gather(1, (k - 1)[:, None])  # [num_rows, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # drop a token when the mass before it already reaches top_p; the top token always stays
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


@dataclass(frozen=True, slots=True)
class History:
    """The tokens a row's penalties look at."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]  # committed output, then the draft tokens before the row


def argmax(rows: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab] float32 -> [num_rows]
    """Each row's first maximum, as torch.argmax gives it (faser_kernels.cpu_ops.first_argmax)."""
    return cpu_ops.first_argmax(rows)


def request_probs(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    params: list[SamplingParams],
    histories: Sequence[History | None] | None = None,  # per row; needed by penalised rows
) -> torch.Tensor:  # [num_rows, vocab]
    """Rows of sampled requests become their distributions; rows of greedy requests stay logits
    (only their argmax is ever used), biased and penalised as the request asks."""
    logits = _penalised(_biased(logits, params), params, histories)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return logits
    out = logits.clone()
    device = logits.device
    rows = torch.tensor(sampled, device=device)
    chosen = [params[i] for i in sampled]
    out[rows] = logits_to_probs(
        logits[rows],
        torch.tensor([p.temperature for p in chosen], dtype=logits.dtype, device=device),
        torch.tensor([p.top_k for p in chosen], device=device),
        torch.tensor([p.top_p for p in chosen], dtype=logits.dtype, device=device),
        torch.tensor([p.min_p for p in chosen], dtype=logits.dtype, device=device),
    )
    return out


def _biased(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """OpenAI's logit_bias, added to the raw logits (before the penalties, as vLLM adds it)."""
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        ids, bias = zip(*params[i].logit_bias, strict=True)
        index = torch.tensor(ids, device=logits.device)
        out[i, index] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
    return out


def _penalised(
    logits: torch.Tensor, params: list[SamplingParams], histories
) -> torch.Tensor:  # [num_rows, vocab]
    rows = [i for i, p in enumerate(params) if p.penalised]
    if not rows:
        return logits
    if histories is None or any(histories[i] is None for i in rows):
        raise ValueError("a penalised row needs its history")
    vocab, device, dtype = logits.shape[-1], logits.device, logits.dtype
    chosen = [params[i] for i in rows]
    seen = token_counts([histories[i].prompt_ids for i in rows], vocab, device) > 0
    counts = token_counts([histories[i].output_ids for i in rows], vocab, device)
    out = logits.clone()
    index = torch.tensor(rows, device=device)
    out[index] = apply_penalties(
        logits[index], seen, counts,
        torch.tensor([p.repetition_penalty for p in chosen], dtype=dtype, device=device),
        torch.tensor([p.frequency_penalty for p in chosen], dtype=dtype, device=device),
        torch.tensor([p.presence_penalty for p in chosen], dtype=dtype, device=device),
    )
    return out


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab: int, device: torch.device | str = "cpu"
) -> torch.Tensor:  # [len(token_ids), vocab] float32
    """How often each token occurs in each list."""
    rows = [r for r, ids in enumerate(token_ids) for _ in ids]
    flat = [t for ids in token_ids for t in ids]
    counts = torch.zeros(len(token_ids), vocab)
    if flat:
        counts.index_put_((torch.tensor(rows), torch.tensor(flat)), torch.ones(len(flat)),
                          accumulate=True)
    return counts.to(device)


def token_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab] float32: the target's raw logits
    token_ids: list[int],  # [num_rows]: the token each row gave
    num_top: list[int],  # [num_rows]: alternatives wanted
) -> list[TokenLogprob]:
    """Each token's raw log-probability (vLLM's default "raw_logprobs": before penalties and
    temperature), computed per row in float32, so a row gives the same bits in a verification as
    in a plain decode."""
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [num_rows, vocab]
    index = torch.tensor(token_ids, device=logits.device)[:, None]
    chosen = logprobs.gather(1, index)[:, 0].tolist()
    max_top = max(num_top)
    top_values, top_ids = logprobs.topk(max_top, dim=-1) if max_top else (logprobs[:, :0],) * 2
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(token, lp, tuple(zip(top_ids[r][:n], top_values[r][:n], strict=True)))
        for r, (token, lp, n) in enumerate(zip(token_ids, chosen, num_top, strict=True))
    ]
