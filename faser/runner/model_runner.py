"""Runs one model over a flat batch with its own paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from faser.runner.batch import Chunk, build_batch
from faser.runner.cuda_graphs import DecodeGraphs
from faser.runner.kv_cache import allocate_feature_cache, allocate_kv_cache
from faser_kernels.backend import attention_backend


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
        self.num_blocks = num_blocks
        dtype = next(model.parameters()).dtype
        self.kv_caches = allocate_kv_cache(
            len(model.layers), num_blocks, block_size, model.num_kv_heads, model.head_dim,
            dtype, device,
        )
        group = model.layers[0].self_attn.num_heads // model.num_kv_heads
        self.attention_backend = attention_backend(device, dtype, model.head_dim, group)
        self.num_positions_computed = 0  # tokens this model has run over, for pruning figures
        # the target of a feature draft: the layers whose output the draft reads (see
        # LlamaForCausalLM.forward_features) and the cache their rows go to (keep_features); a
        # feature draft: the cache it reads them from (read_features)
        self.feature_layers: tuple[int, ...] = ()
        self.feature_cache: torch.Tensor | None = None
        options = options or RunnerOptions()
        self.options = options
        # the layers in one C call per forward where the CPU kernels take them all (its reason
        # otherwise); not under torch.compile, which traces the layers themselves
        self.unfused_reason = "torch.compile" if options.compile else "no fused path"
        if not options.compile and hasattr(model, "fuse_layers"):
            self.unfused_reason = model.fuse_layers()
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

    @property
    def reads_features(self) -> bool:
        """The model is a feature draft: each fed token also reads a feature row."""
        return getattr(self.model, "reads_features", False)

    def keep_features(self, layers: tuple[int, ...]) -> torch.Tensor:
        """From now on, a forward asked for features (forward_hidden) takes the residual stream
        after `layers` and writes each fed token's row into the feature cache at its KV slot: one
        copy per forward, whatever the batch. Returns the cache, for the draft to read."""
        dim = len(layers) * self.model.config.hidden_size
        dtype = next(self.model.parameters()).dtype
        self.feature_layers = layers
        self.feature_cache = allocate_feature_cache(self.num_blocks, self.block_size, dim, dtype,
                                                    self.device)
        return self.feature_cache

    def read_features(self, cache: torch.Tensor) -> None:
        """A feature draft's tokens, where a chunk carries no features of its own, read the row
        of the position before theirs from the target's feature cache."""
        self.feature_cache = cache

    def forward(self, chunks: list[Chunk]) -> torch.Tensor:  # [num_logits, vocab] float32
        return self.forward_hidden(chunks)[0]

    @torch.inference_mode()
    def forward_hidden(
        self, chunks: list[Chunk], features: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits [num_logits, vocab] and a row per fed token: the features a feature draft
        reads when `feature_layers` names some (the target of such a draft) and `features` asks
        for them, which also go to the feature cache, else the last hidden state (for a feature
        draft, its guess of the target's). Forwards that read or return features run eagerly:
        the captured CUDA graphs return the hidden state only."""
        reads = self.feature_cache if self.reads_features else None
        batch = build_batch(chunks, self.block_size, self.device, reads,
                            plan_gather=self.attention_backend == "torch")
        if self.reads_features and batch.features is None:
            raise ValueError("a feature draft's chunks carry no features and it reads no "
                             "target's feature cache (read_features)")
        self.num_positions_computed += batch.input_ids.numel()
        args = (batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        if batch.features is not None:
            hidden = rows = self._forward(*args, batch.features)
        elif self.feature_layers and features:
            hidden, rows = self.model.forward_features(*args, self.feature_layers)
            self.feature_cache.index_copy_(0, batch.meta.slot_mapping, rows)
        elif self.graphs is not None and self.graphs.fits(batch):
            hidden = rows = self.graphs.run(batch)
        else:
            hidden = rows = self._forward(*args)
        return self.model.compute_logits(hidden[batch.logit_indices]), rows

    def synchronize(self) -> None:
        """Waits for the device's queued work (CUDA runs asynchronously): before reading a clock."""
        if str(self.device).startswith("cuda"):
            torch.cuda.synchronize(self.device)
