"""Per-request rows of processed logits, shared by the proposer and the verifier."""

from __future__ import annotations

import torch

from faser.layers.sampler import logits_to_probs
from faser.sampling_params import SamplingParams


def request_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Rows of sampled requests become their distributions; rows of greedy requests stay logits
    (only their argmax is ever used). logits: [num_rows, vocab], one row per entry of params."""
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
    )
    return out
