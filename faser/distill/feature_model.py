"""The feature draft (faser.models.feature_draft) for training, and its export in the engine's
format.

Training reads the target's features from the teacher pass (faser.distill.teacher), so the
frozen target never runs inside the training loop. Row p of the output guesses x_{p+1} from x_p
and the target's features at p - 1, the same alignment as the standalone draft's."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from faser.distill.model import draft_config, write_draft
from faser.models.feature_draft import FEATURE_DRAFT_KEY, FEATURE_LAYERS_KEY


class FeatureDraftLM(nn.Module):
    reads_features = True  # the trainer hands it the target's features

    def __init__(self, config, feature_layers: tuple[int, ...], output_vocab_size: int) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        hidden = config.hidden_size
        self.config, self.feature_layers = config, tuple(feature_layers)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.fuse = nn.Linear(len(feature_layers) * hidden, hidden, bias=False)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.rotary = LlamaRotaryEmbedding(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, output_vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [batch, seq] target ids
        attention_mask: torch.Tensor,  # [batch, seq] 1 for real tokens (right padding)
        features: torch.Tensor,  # [batch, seq, feature_dim] the target's at each position
    ) -> torch.Tensor:  # [passes * batch, seq, output_vocab]
        """In training, a second pass reads the first pass's own guesses in place of the
        target's features (as drafting past the first token does), and its logits follow the
        first pass's along dim 0; in eval, one pass."""
        before = _shift(features.float())
        if len(self.feature_layers) > 1:
            before = self.fuse(before)
        seq = input_ids.shape[1]
        first = self._inputs(input_ids, before)
        hidden = self._decode(first, torch.arange(seq), _causal_mask(seq))
        passes = [hidden]
        if self.training:
            second = self._inputs(input_ids, _shift(hidden))
            # the second pass sits beside the first, as a second drafted token sits in the
            # cache: it reads the first pass's keys before it (the target's features made
            # them) and its own, never other guesses' (see _second_pass_mask)
            both = self._decode(torch.cat((first, second), dim=1),
                                torch.arange(seq).repeat(2), _second_pass_mask(seq))
            passes.append(both[:, seq:])
        return self.lm_head(torch.cat(passes))

    def _inputs(self, input_ids: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat((self.embed_tokens(input_ids), before), dim=-1))

    def _decode(
        self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:  # [batch, rows, hidden]: guesses of the target's final state
        positions = positions[None].expand(hidden.shape[0], -1)
        rope = self.rotary(hidden, positions)
        for layer in self.layers:
            out = layer(hidden, attention_mask=mask, position_embeddings=rope,
                        position_ids=positions)
            hidden = out[0] if isinstance(out, tuple) else out
        return self.norm(hidden)


def _causal_mask(seq: int) -> torch.Tensor:
    """[1, 1, seq, seq]; padding sits after every real token, so the real rows never see it."""
    return torch.full((seq, seq), float("-inf")).triu(1)[None, None]


def _second_pass_mask(seq: int) -> torch.Tensor:
    """[1, 1, 2 seq, 2 seq] over [first pass; second pass]: first-pass rows are causal among
    themselves; second-pass row p sees first-pass rows before p and itself."""
    blocked = torch.full((seq, seq), float("-inf"))
    own = blocked.clone().fill_diagonal_(0.0)
    top = torch.cat((blocked.triu(1), blocked), dim=1)
    bottom = torch.cat((blocked.triu(0), own), dim=1)
    return torch.cat((top, bottom))[None, None]


def _shift(rows: torch.Tensor) -> torch.Tensor:
    """Position p reads the row of p - 1 (zeros at p = 0)."""
    return torch.cat((rows.new_zeros(rows.shape[0], 1, rows.shape[-1]), rows[:, :-1]), dim=1)


def build_feature_draft(
    target, feature_layers: tuple[int, ...], layer_ids: list[int], token_map: torch.Tensor
) -> FeatureDraftLM:
    """A feature draft for a Hugging Face target (LlamaForCausalLM): its decoder layers start
    from the target's `layer_ids`, its norm and output rows (`token_map`) from the target's; the
    fusion starts as "embedding + the final feature", and the input embedding is the target's,
    frozen."""
    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = len(layer_ids)
    config.tie_word_embeddings = False
    config.layer_types = None
    config._attn_implementation = "sdpa"  # the layers run outside a PreTrainedModel
    draft = FeatureDraftLM(config, feature_layers, token_map.numel())
    src, hidden = target.model, config.hidden_size
    with torch.no_grad():
        draft.embed_tokens.weight = src.embed_tokens.weight
        draft.embed_tokens.weight.requires_grad_(False)
        for layer, source_id in zip(draft.layers, layer_ids, strict=True):
            layer.load_state_dict(src.layers[source_id].state_dict())
        draft.norm.load_state_dict(src.norm.state_dict())
        draft.lm_head.weight.copy_(target.lm_head.weight[token_map])
        eye = torch.eye(hidden)
        draft.fuse.weight.zero_()
        draft.fuse.weight[:, -hidden:].copy_(eye)  # the final output is listed last
        draft.fc.weight.copy_(torch.cat((eye, eye), dim=1))
    return draft


def export_feature_draft(
    draft: FeatureDraftLM,
    token_map: torch.Tensor,  # [V'] target ids
    out_dir: Path,
    provenance: dict,
    dtype: torch.dtype = torch.float16,
) -> None:
    """Writes the draft in the engine's format (faser.models.feature_draft); no embedding."""
    tensors = {
        name: p.detach().to(dtype).contiguous()
        for name, p in draft.named_parameters()
        if not name.startswith("embed_tokens")
        and not (name.startswith("fuse.") and len(draft.feature_layers) == 1)
    }
    config = draft_config(
        draft.config, draft.lm_head.out_features, dtype,
        **{FEATURE_DRAFT_KEY: True, FEATURE_LAYERS_KEY: list(draft.feature_layers)},
    )
    write_draft(out_dir, tensors, token_map, config, provenance)
