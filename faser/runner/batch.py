"""The flat ragged batch of one forward pass.

Each request contributes a chunk: consecutive tokens starting at some position (a prefill chunk, a
single decode token, or the last token plus k draft tokens to verify). Chunks are concatenated into
one [num_tokens] batch; `cu_seqlens_q` marks the boundaries and `slot_mapping` the cache slot each
token writes, so requests with different k share the pass with no padding. A draft that reads the
target's features (faser.models.feature_draft) also gets one feature row per token: the chunk's
own, or the target's row of the position before it from the feature cache, which is indexed by
the same slots as the KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from faser.layers.attention import AttentionMetadata
from faser_kernels.attention import plan_kv_gather


@dataclass(frozen=True, slots=True)
class Chunk:
    token_ids: list[int]  # tokens fed, at positions start_pos, start_pos + 1, ...
    start_pos: int
    block_table: list[int]
    num_logits: int  # logits wanted for the chunk's last num_logits tokens (0 .. len)
    # [len(token_ids), hidden]: the feature each token reads (feature drafts only; None reads
    # the target's feature cache)
    features: torch.Tensor | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class FlatBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logit_indices: torch.Tensor  # [num_logits] int64: rows of the flat batch whose logits we want
    features: torch.Tensor | None = None  # [num_tokens, feature_dim] when asked for


def build_batch(
    chunks: list[Chunk],
    block_size: int,
    device: str,
    feature_cache: torch.Tensor | None = None,  # a feature draft's: the target's rows by slot
    plan_gather: bool = True,  # the PyTorch twin's attention plan (the kernels need none)
) -> FlatBatch:
    """The flat batch. With `feature_cache`, chunks without features of their own (all of the
    batch's, or none) read, for the token at position p, the row of p - 1's slot (the cache's
    last, zero row for p = 0)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    reads: list[int] = []  # the feature cache's rows the chunks without features read
    logit_indices: list[int] = []
    cu_seqlens = [0]
    seq_lens = []
    for chunk in chunks:
        n = len(chunk.token_ids)
        pos = range(chunk.start_pos, chunk.start_pos + n)
        input_ids += chunk.token_ids
        positions += pos
        table = chunk.block_table
        slots += [table[p // block_size] * block_size + p % block_size for p in pos]
        if feature_cache is not None and chunk.features is None:
            p = chunk.start_pos - 1
            first = table[p // block_size] * block_size + p % block_size if p >= 0 else -1
            reads += [first] + slots[len(slots) - n : -1]
        end = cu_seqlens[-1] + n
        logit_indices += range(end - chunk.num_logits, end)
        cu_seqlens.append(end)
        seq_lens.append(chunk.start_pos + n)
    max_blocks = max(len(c.block_table) for c in chunks)
    tables = [c.block_table + [0] * (max_blocks - len(c.block_table)) for c in chunks]

    def tensor(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=device)

    block_tables = tensor(tables, torch.int32)
    seq_lens_t = tensor(seq_lens, torch.int32)
    cu_seqlens_q = tensor(cu_seqlens, torch.int32)
    gather = None
    if plan_gather:
        gather = plan_kv_gather(block_tables, seq_lens_t, cu_seqlens_q, block_size)
    meta = AttentionMetadata(tensor(slots), block_tables, seq_lens_t, cu_seqlens_q, gather)
    features = None
    own = [c.features is not None for c in chunks]
    if any(own):
        if not all(own):
            raise ValueError("a feature draft's batch mixes chunks with and without features")
        features = torch.cat([c.features.to(device=device, dtype=torch.float32) for c in chunks])
    elif reads:
        features = feature_cache[tensor(reads)]  # -1, as an index, is the cache's zero row
    return FlatBatch(tensor(input_ids), tensor(positions), meta, tensor(logit_indices), features)
