"""CUDA graphs of a model's one-token-per-request forwards.

A decode step of a 1B model launches some 250 kernels whose launch cost, at small batches, is
larger than their work. Plain decodes and the draft's autoregressive steps feed exactly one token
per request, so their flat batch is determined by its size alone: those are captured once per
padded batch size and replayed. Verifications and prefill chunks (ragged) run eagerly.

Padding rows write no cache slot (slot -1, which store_kvcache skips), attend to one key of block
0 (whatever it holds; their output is dropped) and so never touch a live request's cache. The
Triton kernels need no host sync, so they can be captured; the PyTorch twins cannot."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from faser.layers.attention import AttentionMetadata
from faser.runner.batch import FlatBatch

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# model(input_ids, positions, kv_caches, meta) -> [num_tokens, hidden]
Forward = Callable[..., torch.Tensor]


def graph_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes captured: powers of two, then steps of a half, up to max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_graph_batch must be >= 1, got {max_batch}")
    return [s for s in GRAPH_BATCH_SIZES if s < max_batch] + [max_batch]


class DecodeGraphs:
    """Static input buffers shared by all sizes (a size-s graph reads their first s rows) and one
    captured graph per size. `capture=False` keeps the padding but runs eagerly: for tests on a
    machine without CUDA (under Triton's interpreter)."""

    def __init__(
        self,
        forward: Forward,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        max_blocks_per_seq: int,
        device: str | torch.device,
        capture: bool = True,
    ) -> None:
        if capture and os.environ.get("FASER_KERNELS") == "torch":
            raise ValueError("cuda_graphs needs the Triton kernels; FASER_KERNELS=torch is set")
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
        self.forward, self.kv_caches, self.capture = forward, kv_caches, capture
        self.sizes = graph_sizes(max_batch)
        n = self.sizes[-1]

        def buffer(fill: int, dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.full(shape or (n,), fill, dtype=dtype, device=device)

        self.input_ids = buffer(0, torch.int64)
        self.positions = buffer(0, torch.int64)
        self.slot_mapping = buffer(-1, torch.int64)
        self.seq_lens = buffer(1, torch.int32)
        self.block_tables = buffer(0, torch.int32, n, max_blocks_per_seq)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    def fits(self, batch: FlatBatch) -> bool:
        num_tokens, num_seqs = batch.input_ids.shape[0], batch.meta.seq_lens.shape[0]
        return (
            num_tokens == num_seqs <= self.sizes[-1]
            and batch.meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(self, batch: FlatBatch) -> torch.Tensor:  # [num_tokens, hidden]
        n = batch.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self._load(batch, size)
        if not self.capture:
            return self._forward(size)[:n]
        graph, out = self.graphs[size]
        graph.replay()
        # a view of the graph's output: valid until the next replay of this runner's graphs
        return out[:n]

    def _load(self, batch: FlatBatch, size: int) -> None:
        meta, n = batch.meta, batch.input_ids.shape[0]
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        # rows n..size may hold an earlier batch's slots: they must write nothing now
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(1)

    def _forward(self, size: int) -> torch.Tensor:  # [size, hidden]
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
        )
        return self.forward(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # largest first, so the smaller graphs reuse the pool's blocks
        for size in reversed(self.sizes):
            # warm up on a side stream (Triton's JIT, cuBLAS workspaces), as torch's docs ask;
            # every slot is -1 here, so the warm-up writes no cache
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
