"""Inputs for the kernel tests: paged attention batches and ragged rejection batches, seeded."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionCase:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    q_lens: tuple[int, ...]  # queries this step: 1 decode, k + 1 verify, a prefill chunk
    context_lens: tuple[int, ...]  # tokens cached before this step
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    keys: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_dim], contiguous
    values: list[torch.Tensor]

    def args(self, scale: float) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.cu_seqlens_q, scale)


def paged_batch(case: AttentionCase, seed: int, device: str = "cpu") -> PagedBatch:
    """Each request's K/V land in shuffled blocks (a spare block or two stay unused), with a
    partial last block whenever seq_len is not a multiple of block_size."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(case.context_lens, case.q_lens, strict=True)]
    blocks_per_seq = [-(-n // case.block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    key_cache = torch.randn(shape, generator=gen).to(case.dtype)
    value_cache = torch.randn(shape, generator=gen).to(case.dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    keys, values = [], []
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        own = torch.tensor([perm.pop() for _ in range(nb)])
        block_tables[i, :nb] = own
        keys.append(key_cache[own].flatten(0, 1)[:n])
        values.append(value_cache[own].flatten(0, 1)[:n])
    num_tokens = sum(case.q_lens)
    query = torch.randn(num_tokens, case.num_heads, case.head_dim, generator=gen).to(case.dtype)
    cu = torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()], dtype=torch.int32)
    to = lambda t: t.to(device)
    return PagedBatch(
        to(query), to(key_cache), to(value_cache), to(block_tables),
        to(torch.tensor(seq_lens, dtype=torch.int32)), to(cu),
        [to(k) for k in keys], [to(v) for v in values],
    )


@dataclass(frozen=True)
class RejectionBatch:
    draft_token_ids: torch.Tensor  # [num_draft_tokens] int64
    cu_num_draft_tokens: torch.Tensor  # [num_reqs + 1] int64
    draft_probs: torch.Tensor | None  # [num_draft_tokens, vocab]
    target_probs: torch.Tensor  # [num_draft_tokens + num_reqs, vocab]
    is_greedy: torch.Tensor  # [num_reqs] bool
    uniform_accept: torch.Tensor  # [num_draft_tokens]
    uniform_sample: torch.Tensor  # [num_reqs]

    def args(self) -> tuple:
        return (self.draft_token_ids, self.cu_num_draft_tokens, self.draft_probs,
                self.target_probs, self.is_greedy, self.uniform_accept, self.uniform_sample)

    def to(self, device: str) -> RejectionBatch:
        move = lambda t: None if t is None else t.to(device)
        return RejectionBatch(*(move(t) for t in self.args()))


def rejection_batch(
    ks: list[int], greedy: list[bool], vocab_size: int, seed: int, agreement: float = 2.0
) -> RejectionBatch:
    """Draft tokens drawn from q; p shares q's logits (times `agreement`) plus noise, so that
    some drafts survive and some do not. Greedy requests carry raw logits in their target rows,
    and some of their drafts are the target's argmax, so greedy acceptance happens too."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs, num_draft = len(ks), sum(ks)
    cu = torch.tensor([0, *torch.tensor(ks, dtype=torch.long).cumsum(0).tolist()])
    draft_logits = torch.randn(num_draft, vocab_size, generator=gen) * 2
    draft_probs = torch.softmax(draft_logits, dim=-1)
    draft_token_ids = torch.multinomial(draft_probs, 1, generator=gen).view(-1)
    target_logits = torch.randn(num_draft + num_reqs, vocab_size, generator=gen) * 2
    target_probs = torch.softmax(target_logits, dim=-1)
    for i in range(num_reqs):
        drafts = slice(int(cu[i]), int(cu[i + 1]))
        rows = slice(drafts.start + i, drafts.stop + i)  # the k_i rows that score drafts
        mixed = agreement * draft_logits[drafts] + 0.5 * target_logits[rows]  # [k_i, vocab]
        target_probs[rows] = torch.softmax(mixed, dim=-1)
        if greedy[i]:
            target_probs[rows] = mixed
            target_probs[rows.stop] = target_logits[rows.stop]  # the bonus row, as logits
            draft_token_ids[drafts] = _mostly_argmax(mixed, draft_token_ids[drafts], gen)
    return RejectionBatch(
        draft_token_ids, cu, draft_probs, target_probs, torch.tensor(greedy),
        torch.rand(num_draft, generator=gen), torch.rand(num_reqs, generator=gen),
    )


def _mostly_argmax(
    logits: torch.Tensor,  # [k, vocab]
    drafts: torch.Tensor,  # [k]
    gen: torch.Generator,
) -> torch.Tensor:  # [k]
    """The argmax with probability 3/4 a position, else the sampled draft (usually a miss)."""
    keep = torch.rand(drafts.shape[0], generator=gen) < 0.75
    return torch.where(keep, logits.argmax(dim=-1), drafts)
