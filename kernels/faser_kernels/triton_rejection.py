"""Triton twin of `rejection_sample_torch` (rejection.py defines the vocabulary and the random
number contract): one program per request walks its draft tokens and stops at the first rejection.

Each request's k comes from cu_num_draft_tokens at run time and every size that varies per step
is a non-specialised argument, so no mix of k's ever compiles a new kernel. The vocabulary (up to
~150k) is scanned in blocks of BLOCK_V for the argmax, the residual's mass and its inverse CDF.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from faser_kernels.rejection import RejectionOutput


@triton.jit
def _row_argmax(row_ptr, vocab_size, BLOCK_V: tl.constexpr):
    """First index of the row's maximum, as torch.argmax (ties go to the lowest index)."""
    best = float("-inf")
    best_idx = 0
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, axis=0)
        block_idx = tl.min(tl.where(x == block_max, offs, vocab_size), axis=0)
        if block_max > best:  # strict: an equal later block keeps the earlier index
            best = block_max
            best_idx = block_idx
    return best_idx


@triton.jit
def _sample_inverse_cdf(
    p_ptr, q_ptr, uniform, vocab_size, USE_RESIDUAL: tl.constexpr, BLOCK_V: tl.constexpr
):
    """Token whose CDF interval holds `uniform` under max(0, p - q) (USE_RESIDUAL) or p, as
    `sample_inverse_cdf`; a residual with no mass (p == q) falls back to p. Only a token of
    positive weight can come out, whatever the rounding."""
    p_mass = 0.0
    residual_mass = 0.0
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab_size
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        p_mass += tl.sum(p, axis=0)
        if USE_RESIDUAL:
            q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            residual_mass += tl.sum(tl.maximum(p - q, 0.0), axis=0)
    use_residual = residual_mass > 0  # a plain False when not USE_RESIDUAL
    target = uniform * tl.where(use_residual, residual_mass, p_mass)

    carry = 0.0
    found = vocab_size  # first token whose CDF exceeds target
    last_nonzero = 0  # the fallback when rounding puts target at or past the total
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab_size
        w = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if use_residual:
            q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.maximum(w - q, 0.0)
        cdf = carry + tl.cumsum(w, axis=0)
        hit = (cdf > target) & (w > 0) & mask
        found = tl.minimum(found, tl.min(tl.where(hit, offs, vocab_size), axis=0))
        last_nonzero = tl.maximum(last_nonzero, tl.max(tl.where((w > 0) & mask, offs, 0), axis=0))
        carry += tl.sum(w, axis=0)
    return tl.where(found < vocab_size, found, last_nonzero)


@triton.jit(do_not_specialize=["vocab_size", "stride_out"])
def _rejection_kernel(
    out_ptr, num_accepted_ptr,
    draft_token_ids_ptr, cu_num_draft_tokens_ptr, draft_probs_ptr, target_probs_ptr,
    is_greedy_ptr, uniform_accept_ptr, uniform_sample_ptr,
    vocab_size, stride_out,
    stride_draft, stride_target,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    req = tl.program_id(0)
    start = tl.load(cu_num_draft_tokens_ptr + req).to(tl.int64)
    k = tl.load(cu_num_draft_tokens_ptr + req + 1).to(tl.int64) - start
    greedy = tl.load(is_greedy_ptr + req) != 0
    uniform = tl.load(uniform_sample_ptr + req).to(tl.float32)
    out_row = out_ptr + req.to(tl.int64) * stride_out
    target_row0 = target_probs_ptr + (start + req) * stride_target  # request's k + 1 rows

    rejected = False
    num_accepted = k
    for j in range(0, k):
        if not rejected:
            draft = tl.load(draft_token_ids_ptr + start + j)
            p_row = target_row0 + j * stride_target
            q_row = draft_probs_ptr + (start + j) * stride_draft
            if greedy:
                token = _row_argmax(p_row, vocab_size, BLOCK_V).to(tl.int64)
                rejected = token != draft
            else:
                p_tok = tl.load(p_row + draft).to(tl.float64)
                q_tok = 1.0
                if HAS_DRAFT_PROBS:
                    q_tok = tl.load(q_row + draft).to(tl.float64)
                u = tl.load(uniform_accept_ptr + start + j).to(tl.float64)
                # in float64 the product of two float32s is exact, as in the twin's Python floats
                rejected = ((q_tok > 0) & (u * q_tok < p_tok)) == 0
                token = draft.to(tl.int64)
                if rejected:
                    token = _sample_inverse_cdf(
                        p_row, q_row, uniform, vocab_size, HAS_DRAFT_PROBS, BLOCK_V
                    ).to(tl.int64)
            tl.store(out_row + j, token)
            if rejected:
                num_accepted = j
    if not rejected:  # all k survived: the bonus token from the extra row
        p_row = target_row0 + k * stride_target
        if greedy:
            bonus = _row_argmax(p_row, vocab_size, BLOCK_V)
        else:
            bonus = _sample_inverse_cdf(p_row, p_row, uniform, vocab_size, False, BLOCK_V)
        tl.store(out_row + k, bonus.to(tl.int64))
    tl.store(num_accepted_ptr + req, num_accepted)


def rejection_sample_triton(
    draft_token_ids: torch.Tensor,  # [num_draft_tokens] int64
    cu_num_draft_tokens: torch.Tensor,  # [num_reqs + 1] int64
    draft_probs: torch.Tensor | None,  # [num_draft_tokens, vocab]; None when all are greedy
    target_probs: torch.Tensor,  # [num_draft_tokens + num_reqs, vocab]: k_i + 1 rows a request
    is_greedy: torch.Tensor,  # [num_reqs] bool; greedy rows of target_probs may hold logits
    uniform_accept: torch.Tensor,  # [num_draft_tokens] float in [0, 1)
    uniform_sample: torch.Tensor,  # [num_reqs] float in [0, 1)
) -> RejectionOutput:
    num_reqs = cu_num_draft_tokens.shape[0] - 1
    vocab_size = target_probs.shape[-1]
    _check_inputs(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, is_greedy)
    # the output's width is the batch's max k: the one host sync, as in the twin
    k = cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]
    max_k = int(k.max()) if num_reqs else 0
    if draft_probs is None and bool(((k > 0) & ~is_greedy).any()):
        raise ValueError("draft_probs is None but a sampled request has draft tokens")
    device = target_probs.device
    out = torch.full((num_reqs, max_k + 1), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(num_reqs, dtype=torch.long, device=device)
    if num_reqs == 0:
        return RejectionOutput(out, num_accepted)
    has_draft = draft_probs is not None
    _rejection_kernel[(num_reqs,)](
        out, num_accepted,
        draft_token_ids, cu_num_draft_tokens,
        draft_probs if has_draft else target_probs, target_probs,
        is_greedy, uniform_accept, uniform_sample,
        vocab_size, out.stride(0),
        draft_probs.stride(0) if has_draft else 0, target_probs.stride(0),
        HAS_DRAFT_PROBS=has_draft,
        BLOCK_V=min(4096, triton.next_power_of_2(vocab_size)),
    )
    return RejectionOutput(out, num_accepted)


def _check_inputs(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    is_greedy: torch.Tensor,
) -> None:
    num_draft, num_reqs = draft_token_ids.shape[0], cu_num_draft_tokens.shape[0] - 1
    if target_probs.shape[0] != num_draft + num_reqs:
        raise ValueError(
            f"target_probs has {target_probs.shape[0]} rows, expected num_draft_tokens + "
            f"num_reqs = {num_draft + num_reqs}"
        )
    if draft_probs is not None and draft_probs.shape != (num_draft, target_probs.shape[1]):
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)} must be [{num_draft}, vocab]")
    if is_greedy.shape[0] != num_reqs:
        raise ValueError(f"is_greedy has {is_greedy.shape[0]} entries for {num_reqs} requests")
    for name, t in (("target_probs", target_probs), ("draft_probs", draft_probs)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in vocab")
