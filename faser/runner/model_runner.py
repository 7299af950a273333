"""Runs one model over a flat batch with its own paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from faser.runner.batch import Chunk, build_batch
from faser.runner.kv_cache import allocate_kv_cache


class ModelRunner:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, device: str) -> None:
        self.model, self.block_size, self.device = model, block_size, device
        dtype = next(model.parameters()).dtype
        self.kv_caches = allocate_kv_cache(
            len(model.layers), num_blocks, block_size, model.num_kv_heads, model.head_dim,
            dtype, device,
        )
        self.num_positions_computed = 0  # tokens this model has run over, for pruning figures

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:  # [num_logits, vocab] float32
        batch = build_batch(chunks, self.block_size, self.device)
        self.num_positions_computed += batch.input_ids.numel()
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        return self.model.compute_logits(hidden[batch.logit_indices])
