"""Speculative rejection sampling over a ragged batch.

Vocabulary (as vLLM's): request i proposes `k_i` draft tokens; the target scores them and gives
one more row after the last. Walking left to right, a draft token is *accepted* when it survives;
at the first rejection a *recovered* token is sampled from the residual norm(max(0, p - q)) and the
request stops; when all k_i survive, a *bonus* token is sampled from the extra row.

Greedy requests accept a draft token iff it equals the target's argmax, and recover / take bonus
as the argmax. Sampled requests accept with probability min(1, p / q). Random numbers come in as
arguments, drawn per request from its own generator, so a request's output does not depend on who
shares its batch. One uniform per request samples its recovered or bonus token by inverse CDF.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from faser_kernels import cpu_ops
from faser_kernels.backend import use_triton


class RejectionOutput(NamedTuple):
    output_token_ids: torch.Tensor  # [num_reqs, max_k + 1] int64, -1 past the committed tokens
    num_accepted: torch.Tensor  # [num_reqs] int64: accepted draft tokens (committed = this + 1)


def sample_inverse_cdf(probs: torch.Tensor, uniform: float) -> int:
    """Token whose CDF interval holds `uniform`; probs need not be normalised."""
    cdf = torch.cumsum(probs, dim=0)
    idx = int(torch.searchsorted(cdf, uniform * cdf[-1], right=True))
    # rounding can land past the last non-zero entry: fall back to the last token with mass
    if idx >= probs.numel() or probs[idx] <= 0:
        idx = int(torch.nonzero(probs > 0)[-1])
    return idx


def rejection_sample_torch(
    draft_token_ids: torch.Tensor,  # [num_draft_tokens] int64
    cu_num_draft_tokens: torch.Tensor,  # [num_reqs + 1] int64
    draft_probs: torch.Tensor | None,  # [num_draft_tokens, vocab]; None when all are greedy
    target_probs: torch.Tensor,  # [num_draft_tokens + num_reqs, vocab]: k_i + 1 rows a request
    is_greedy: torch.Tensor,  # [num_reqs] bool; greedy rows of target_probs may hold logits
    uniform_accept: torch.Tensor,  # [num_draft_tokens] float in [0, 1)
    uniform_sample: torch.Tensor,  # [num_reqs] float in [0, 1)
) -> RejectionOutput:
    cu = cu_num_draft_tokens.tolist()
    num_reqs = len(cu) - 1
    max_k = max((cu[i + 1] - cu[i] for i in range(num_reqs)), default=0)
    out = torch.full((num_reqs, max_k + 1), -1, dtype=torch.long)
    num_accepted = torch.zeros(num_reqs, dtype=torch.long)
    draft = draft_token_ids.tolist()
    greedy = is_greedy.tolist()
    argmax = cpu_ops.first_argmax(target_probs).tolist() if any(greedy) else []
    for i in range(num_reqs):
        start, k = cu[i], cu[i + 1] - cu[i]
        row0 = start + i  # the target rows of request i start here
        if greedy[i]:
            tokens = greedy_tokens(draft[start : start + k], argmax[row0 : row0 + k + 1])
        else:
            tokens = _sampled_one(
                draft[start : start + k],
                draft_probs[start : start + k] if draft_probs is not None else None,
                target_probs[row0 : row0 + k + 1],
                uniform_accept[start : start + k],
                float(uniform_sample[i]),
            )
        out[i, : len(tokens)] = torch.tensor(tokens)
        num_accepted[i] = len(tokens) - 1
    return RejectionOutput(out.to(target_probs.device), num_accepted.to(target_probs.device))


def greedy_tokens(draft: list[int], argmax: list[int]) -> list[int]:
    """A greedy request's committed tokens: its drafts up to the first that is not the target's
    argmax, then the argmax there (recovered) or after the last draft (bonus)."""
    tokens = []
    for j, token in enumerate(draft):
        tokens.append(argmax[j])
        if token != argmax[j]:
            return tokens  # the last one is the recovered token
    tokens.append(argmax[len(draft)])  # bonus
    return tokens


def _sampled_one(
    draft: list[int],
    q: torch.Tensor | None,  # [k, vocab]
    p: torch.Tensor,  # [k + 1, vocab]
    uniform_accept: torch.Tensor,  # [k]
    uniform_sample: float,
) -> list[int]:
    tokens = []
    for j, token in enumerate(draft):
        p_tok, q_tok = float(p[j, token]), float(q[j, token])
        if q_tok > 0 and float(uniform_accept[j]) * q_tok < p_tok:  # u < p / q
            tokens.append(token)
            continue
        residual = torch.clamp(p[j] - q[j], min=0.0)
        if float(residual.sum()) <= 0:  # p == q exactly: any rejection is measure-zero
            residual = p[j]
        tokens.append(sample_inverse_cdf(residual, uniform_sample))
        return tokens
    tokens.append(sample_inverse_cdf(p[len(draft)], uniform_sample))
    return tokens


def rejection_sample(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    is_greedy: torch.Tensor,
    uniform_accept: torch.Tensor,
    uniform_sample: torch.Tensor,
) -> RejectionOutput:
    if use_triton(target_probs):
        from faser_kernels.triton_rejection import rejection_sample_triton

        return rejection_sample_triton(
            draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, is_greedy,
            uniform_accept, uniform_sample,
        )
    return rejection_sample_torch(
        draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, is_greedy,
        uniform_accept, uniform_sample,
    )
