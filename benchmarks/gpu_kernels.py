"""The GPU check's kernel sections: each Triton kernel against its PyTorch twin on the same
inputs (parity), and both timed at the shapes a 1B target's step has (decode, verification,
prefill chunk; rejection over a 32k vocabulary)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from faser_kernels.attention import paged_attention_torch
from faser_kernels.cache import store_kvcache_torch
from faser_kernels.rejection import rejection_sample_torch


@dataclass(frozen=True, slots=True)
class AttnShape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]  # cached tokens before this step's queries
    block_size: int = 16


@dataclass(frozen=True, slots=True)
class RejShape:
    name: str
    ks: tuple[int, ...]
    greedy: tuple[bool, ...]
    vocab: int


def attention_inputs(s: AttnShape, dtype: torch.dtype, device: str, seed: int) -> tuple:
    """(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale); each
    request's blocks are scattered over the cache, whose every slot holds random keys."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(s.ctx_lens, s.q_lens, strict=True)]
    counts = [max(1, -(-n // s.block_size)) for n in seq_lens]
    num_blocks = sum(counts) + 1
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, at = [], 0
    for c in counts:
        tables.append(order[at : at + c])
        at += c
    width = max(counts)
    tables = [t + [0] * (width - len(t)) for t in tables]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    cache_shape = (num_blocks, s.block_size, s.kv_heads, s.head_dim)
    cu = [0]
    for q in s.q_lens:
        cu.append(cu[-1] + q)
    return (
        randn(cu[-1], s.heads, s.head_dim), randn(*cache_shape), randn(*cache_shape),
        torch.tensor(tables, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        torch.tensor(cu, dtype=torch.int32, device=device),
        1.0 / math.sqrt(s.head_dim),
    )


def store_inputs(num_tokens: int, kv_heads: int, head_dim: int, dtype, device, seed) -> tuple:
    """(key, value, key_cache, value_cache, slot_mapping): distinct random slots."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size = -(-num_tokens // 16) * 2 + 1, 16
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    kv = [torch.randn(num_tokens, kv_heads, head_dim, generator=gen) for _ in range(2)]
    caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim) for _ in range(2)]
    return (*(t.to(device=device, dtype=dtype) for t in kv + caches), slots.to(device))


def rejection_inputs(s: RejShape, device: str, seed: int) -> tuple:
    """Draft tokens that the target agrees with most of the time, so both paths walk past a few
    accepted tokens before a rejection; sampled requests have q rows, greedy ones logits."""
    gen = torch.Generator().manual_seed(seed)
    num_draft, num_reqs = sum(s.ks), len(s.ks)
    q = torch.softmax(torch.randn(num_draft, s.vocab, generator=gen) * 3, dim=-1)
    target_rows, drafts, at = [], [], 0
    for k, greedy in zip(s.ks, s.greedy, strict=True):
        noise = torch.softmax(torch.randn(k + 1, s.vocab, generator=gen) * 3, dim=-1)
        rows = noise.clone()
        rows[:k] = 0.8 * q[at : at + k] + 0.2 * noise[:k]
        if greedy:
            rows = torch.log(rows)  # greedy rows hold logits
            tokens = rows[:k].argmax(dim=-1)
            miss = torch.rand(k, generator=gen) < 0.2
            tokens = torch.where(miss, torch.randint(0, s.vocab, (k,), generator=gen), tokens)
        else:
            tokens = torch.multinomial(q[at : at + k], 1, generator=gen)[:, 0] if k else (
                torch.zeros(0, dtype=torch.long))
        target_rows.append(rows)
        drafts.append(tokens)
        at += k
    cu = torch.tensor([0, *torch.tensor(s.ks).cumsum(0).tolist()])
    args = (
        torch.cat(drafts).long(), cu, q, torch.cat(target_rows), torch.tensor(s.greedy),
        torch.rand(num_draft, generator=gen), torch.rand(num_reqs, generator=gen),
    )
    return tuple(a.to(device) for a in args)


def time_call(fn: Callable[[], object], device: str, iters: int, warmup: int = 2) -> float:
    """Seconds a call, launches and host syncs included, averaged over `iters` back-to-back
    calls after `warmup` (Triton compiles on the first)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- parity ----------------------------------------------------------------------------------


def attention_parity(shapes: list[AttnShape], dtypes, device: str) -> list[dict]:
    from faser_kernels.triton_attention import paged_attention_triton

    rows = []
    for s in shapes:
        for dtype in dtypes:
            args = attention_inputs(s, dtype, device, seed=len(rows))
            want = paged_attention_torch(*args).float()
            got = paged_attention_triton(*args).float()
            err = float((got - want).abs().max())
            tol = 2e-4 if dtype == torch.float32 else 3e-2
            rows.append({"kernel": "paged_attention", "case": s.name, "dtype": _name(dtype),
                         "max_abs_err": err, "tol": tol, "ok": err <= tol})
    return rows


def store_parity(cases: list[tuple[int, int, int]], dtypes, device: str) -> list[dict]:
    from faser_kernels.triton_cache import store_kvcache_triton

    rows = []
    for num_tokens, kv_heads, head_dim in cases:
        for dtype in dtypes:
            args = store_inputs(num_tokens, kv_heads, head_dim, dtype, device, seed=len(rows))
            twin = [t.clone() for t in args]
            store_kvcache_torch(*twin)
            store_kvcache_triton(*args)
            same = torch.equal(args[2], twin[2]) and torch.equal(args[3], twin[3])
            # a padding token (slot -1) writes nothing
            padded = list(args)
            padded[4] = torch.full_like(args[4], -1)
            before = args[2].clone()
            store_kvcache_triton(*padded)
            skips = torch.equal(args[2], before)
            rows.append({"kernel": "store_kvcache", "case": f"{num_tokens}x{kv_heads}x{head_dim}",
                         "dtype": _name(dtype), "exact": same, "pad_skipped": skips,
                         "ok": same and skips})
    return rows


def rejection_parity(shapes: list[RejShape], device: str, seeds: int) -> list[dict]:
    """Requests whose committed tokens differ; sampled ones may, rarely, where a uniform falls
    within float32 rounding of a CDF boundary (kernels/README.md)."""
    from faser_kernels.triton_rejection import rejection_sample_triton

    rows = []
    for s in shapes:
        diff_greedy = diff_sampled = 0
        for seed in range(seeds):
            args = rejection_inputs(s, device, seed)
            want = rejection_sample_torch(*args)
            got = rejection_sample_triton(*args)
            same = (want.output_token_ids == got.output_token_ids).all(dim=1)
            same &= want.num_accepted == got.num_accepted
            greedy = args[4]
            diff_greedy += int((~same & greedy).sum())
            diff_sampled += int((~same & ~greedy).sum())
        total = seeds * len(s.ks)
        rows.append({"kernel": "rejection_sample", "case": s.name, "requests": total,
                     "greedy_differ": diff_greedy, "sampled_differ": diff_sampled,
                     "ok": diff_greedy == 0 and diff_sampled <= max(1, total // 200)})
    return rows


# -- timing ----------------------------------------------------------------------------------


def kernel_times(attn: list[AttnShape], store: list[tuple[int, int, int]],
                 rej: list[RejShape], dtype: torch.dtype, device: str, iters: int,
                 warmup: int = 2) -> list[dict]:
    from faser_kernels.triton_attention import paged_attention_triton
    from faser_kernels.triton_cache import store_kvcache_triton
    from faser_kernels.triton_rejection import rejection_sample_triton

    pairs: list[tuple[str, str, tuple, Callable, Callable]] = []
    for s in attn:
        args = attention_inputs(s, dtype, device, seed=0)
        pairs.append(("paged_attention", s.name, args, paged_attention_torch,
                      paged_attention_triton))
    for n, h, d in store:
        args = store_inputs(n, h, d, dtype, device, seed=0)
        pairs.append(("store_kvcache", f"{n} tokens", args, store_kvcache_torch,
                      store_kvcache_triton))
    for s in rej:
        args = rejection_inputs(s, device, seed=0)
        pairs.append(("rejection_sample", s.name, args, rejection_sample_torch,
                      rejection_sample_triton))
    rows = []
    for kernel, case, args, twin, triton in pairs:
        t_twin = time_call(lambda f=twin, a=args: f(*a), device, iters, warmup)
        t_triton = time_call(lambda f=triton, a=args: f(*a), device, iters, warmup)
        rows.append({"kernel": kernel, "case": case, "dtype": _name(dtype),
                     "twin_us": t_twin * 1e6, "triton_us": t_triton * 1e6,
                     "speedup": t_twin / t_triton})
    return rows


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
