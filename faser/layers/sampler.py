"""Turns logits into the distribution a request samples from: penalties, temperature, min-p,
top-k, top-p.

The same processing is applied to the draft's and the target's logits, so that rejection sampling
reproduces exactly the distribution the request asked for. Every step is elementwise or reduces
along one row, so a row's result does not depend on the rows beside it."""

from __future__ import annotations

import torch


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
