"""A draft that reads the target's features (EAGLE-style).

A standalone draft must understand the context with its own few layers; this one is handed the
target's understanding. At position p it reads the token x_p and the target's features at p - 1:
the residual stream after the target layers its config lists (`faser_feature_layers`, Hugging
Face's hidden_states numbering; the last layer means the final normed output, the row the
target's output layer turned into x_p). Several layers are fused into one hidden-size row by a
linear layer; the row and the token's embedding are fused by another and run through a few Llama
decoder layers over the paged cache. The output is the draft's guess of the target's final hidden
state at p, which its output layer turns into a guess of x_{p+1}; drafting further, the draft
feeds that guess where the target's features are not known yet.

On disk: a Llama config with `faser_feature_draft = true`, `faser_feature_layers` and the
standalone drafts' `faser_output_vocab_size` / `faser_tie_embedding_to_target`; weights
`fuse.weight` [hidden, len(feature_layers) * hidden] (more than one layer only), `fc.weight`
[hidden, 2 * hidden], `layers.*`, `norm.weight`, `lm_head.weight`; the embedding is the target's."""

from __future__ import annotations

import torch
from torch import nn

from faser.layers.attention import AttentionMetadata
from faser.models.llama import KVCaches, LlamaForCausalLM
from faser_kernels import cpu_decoder, cpu_ops

FEATURE_DRAFT_KEY = "faser_feature_draft"
FEATURE_LAYERS_KEY = "faser_feature_layers"


def is_feature_draft(hf_config) -> bool:
    return bool(getattr(hf_config, FEATURE_DRAFT_KEY, False))


class FeatureDraft(LlamaForCausalLM):
    """A Llama decoder (layers, norm, reduced output layer) whose input is fused from each token's
    embedding and a feature row."""

    reads_features = True  # ModelRunner hands it a feature row per fed token

    def __init__(self, cfg, max_position: int) -> None:
        super().__init__(cfg, max_position)
        hidden = cfg.hidden_size
        self.feature_layers = tuple(int(i) for i in getattr(cfg, FEATURE_LAYERS_KEY, None) or ())
        if not self.feature_layers:
            raise ValueError(f"a feature draft's config must list {FEATURE_LAYERS_KEY}")
        self.feature_dim = len(self.feature_layers) * hidden
        if len(self.feature_layers) > 1:
            self.fuse = nn.Linear(self.feature_dim, hidden, bias=False)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        features: torch.Tensor,  # [num_tokens, feature_dim] the target's, or [.., hidden] ours
    ) -> torch.Tensor:  # [num_tokens, hidden]: the guesses of the target's final hidden state
        if (prologue := self._prologue(input_ids, features)) is not None:
            x = torch.empty(input_ids.numel(), self.config.hidden_size,
                            dtype=self.embed_tokens.weight.dtype)
            return self._run_fused(x, self.rotary(positions), kv_caches, meta, (), prologue)[0]
        embeds = self.embed_tokens(input_ids)
        features = features.to(embeds.dtype)
        if features.shape[-1] != embeds.shape[-1]:  # the target's, several layers: fuse them
            features = self.fuse(features)
        hidden = self.fc(torch.cat((embeds, features), dim=-1))
        return self.run_layers(hidden, positions, kv_caches, meta)[0]

    def _prologue(
        self, input_ids: torch.Tensor, features: torch.Tensor
    ) -> cpu_decoder.Prologue | None:
        """The input fusions as the layers' C call takes them, where that call runs and they are
        packed for it; None: the torch path above, their twin."""
        embed = self.embed_tokens.weight
        fuse = getattr(self, "fuse", None) if features.shape[-1] != embed.shape[-1] else None
        packed = [getattr(m, "packed", None) for m in (self.fc, fuse) if m is not None]
        if self.fused_layers is None or not cpu_ops.runs_on(embed) or None in packed:
            return None
        return cpu_decoder.Prologue(
            input_ids.contiguous(), embed, features.to(embed.dtype).contiguous(),
            packed[1] if fuse is not None else None, packed[0],
        )
