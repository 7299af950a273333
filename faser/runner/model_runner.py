"""Runs one model over a flat batch with its own paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from faser.runner.batch import Chunk, build_batch
from faser.runner.cuda_graphs import DecodeGraphs
from faser.runner.kv_cache import allocate_kv_cache


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """How the forward runs (EngineConfig.compile / cuda_graphs)."""

    compile: bool = False  # torch.compile the model's forward, dynamic shapes
    cuda_graphs: bool = False  # replay graphs of one-token-per-request batches (CUDA only)
    max_graph_batch: int = 64  # the largest such batch captured (the engine's max_num_seqs)
    max_blocks_per_seq: int = 0  # block-table width the graphs hold (a request's longest table)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        num_blocks: int,
        block_size: int,
        device: str,
        options: RunnerOptions | None = None,
    ) -> None:
        self.model, self.block_size, self.device = model, block_size, device
        dtype = next(model.parameters()).dtype
        self.kv_caches = allocate_kv_cache(
            len(model.layers), num_blocks, block_size, model.num_kv_heads, model.head_dim,
            dtype, device,
        )
        self.num_positions_computed = 0  # tokens this model has run over, for pruning figures
        options = options or RunnerOptions()
        self.options = options
        self._forward = torch.compile(model, dynamic=True) if options.compile else model
        self.graphs: DecodeGraphs | None = None
        if options.cuda_graphs:
            if not str(device).startswith("cuda"):
                raise ValueError(f"cuda_graphs needs a CUDA device, got device={device!r}")
            self.graphs = DecodeGraphs(
                self._forward, self.kv_caches, options.max_graph_batch,
                options.max_blocks_per_seq, device,
            )

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:  # [num_logits, vocab] float32
        batch = build_batch(chunks, self.block_size, self.device)
        self.num_positions_computed += batch.input_ids.numel()
        if self.graphs is not None and self.graphs.fits(batch):
            hidden = self.graphs.run(batch)
        else:
            hidden = self._forward(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        return self.model.compute_logits(hidden[batch.logit_indices])

    def synchronize(self) -> None:
        """Waits for the device's queued work (CUDA runs asynchronously): before reading a clock."""
        if str(self.device).startswith("cuda"):
            torch.cuda.synchronize(self.device)
