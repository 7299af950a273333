"""Turns logits into the distribution a request samples from: temperature, top-k, top-p.

The same processing is applied to the draft's and the target's logits, so that rejection sampling
reproduces exactly the distribution the request asked for."""

from __future__ import annotations

import torch


def logits_to_probs(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    temperature: torch.Tensor,  # [num_rows] > 0
    top_k: torch.Tensor,  # [num_rows] int, 0 = off
    top_p: torch.Tensor,  # [num_rows] in (0, 1]
) -> torch.Tensor:  # [num_rows, vocab]
    logits = logits / temperature[:, None]
    if bool((top_k > 0).any()):
        logits = _apply_top_k(logits, top_k)
    if bool((top_p < 1.0).any()):
        logits = _apply_top_p(logits, top_p)
    return torch.softmax(logits, dim=-1)


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
