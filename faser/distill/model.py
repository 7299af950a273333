"""The draft's construction for training and its export in the engine's draft format.

The draft is a short Llama decoder that starts from the target's first layers and final norm and
reads the target's own input embedding, frozen. Its output layer covers only the `V'` most
frequent target tokens (`token_map[j]` is the target id of draft output row `j`), because at
batch 1 on a CPU the full 49,152-row output layer would cost more than the layers themselves.

On disk (what `faser.models.loader` reads):
    config.json                  a Llama config with vocab_size = the target's (the input
                                 vocabulary), faser_output_vocab_size = V' and
                                 faser_tie_embedding_to_target = true
    model.safetensors            the layers, the final norm and lm_head [V', hidden], float16;
                                 no embedding: the engine lends the draft the target's at load time
    draft_token_map.safetensors  "token_map": [V'] int64 target ids
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from faser.models.loader import DRAFT_TOKEN_MAP, OUTPUT_VOCAB_KEY, TIE_TO_TARGET_KEY

PROVENANCE_FILE = "faser_distill.json"  # how the draft was made


class DraftLM(nn.Module):
    """A Hugging Face Llama body (trainable, no paged cache) plus a reduced output layer."""

    def __init__(self, config, output_vocab_size: int) -> None:
        super().__init__()
        from transformers import LlamaModel

        self.body = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, output_vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [batch, seq] target ids
        attention_mask: torch.Tensor,  # [batch, seq] 1 for real tokens
    ) -> torch.Tensor:  # [batch, seq, output_vocab]
        hidden = self.body(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        return self.lm_head(hidden)


def build_draft(target, layer_ids: list[int], token_map: torch.Tensor) -> DraftLM:
    """A draft from a Hugging Face target (LlamaForCausalLM): its layers `layer_ids`, its norm,
    its frozen input embedding, and its output rows for `token_map` ([V'] target ids)."""
    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = len(layer_ids)
    config.tie_word_embeddings = False
    config.layer_types = None
    draft = DraftLM(config, token_map.numel())
    src = target.model
    with torch.no_grad():
        draft.body.embed_tokens.weight = src.embed_tokens.weight
        draft.body.embed_tokens.weight.requires_grad_(False)
        for layer, source_id in zip(draft.body.layers, layer_ids, strict=True):
            layer.load_state_dict(src.layers[source_id].state_dict())
        draft.body.norm.load_state_dict(src.norm.state_dict())
        draft.lm_head.weight.copy_(target.lm_head.weight[token_map])
    return draft


def export_draft(
    draft: DraftLM,
    token_map: torch.Tensor,  # [V'] target ids
    out_dir: Path,
    provenance: dict,
    dtype: torch.dtype = torch.float16,
) -> None:
    """Writes the draft in the engine's format (module docstring); no embedding is stored."""
    tensors = {
        f"model.{name}": p.detach().to(dtype).contiguous()
        for name, p in draft.body.named_parameters()
        if not name.startswith("embed_tokens")
    }
    tensors["lm_head.weight"] = draft.lm_head.weight.detach().to(dtype).contiguous()
    config = draft_config(draft.body.config, draft.lm_head.out_features, dtype)
    write_draft(out_dir, tensors, token_map, config, provenance)


def draft_config(config, output_vocab: int, dtype: torch.dtype, **extra) -> dict:
    """The Llama config of a draft that reads its target's embedding, as config.json holds it."""
    config = config.to_dict()
    for key in ("layer_types", "_name_or_path"):  # the latter is a local path of the target
        config.pop(key, None)
    config.update(
        architectures=["LlamaForCausalLM"],
        tie_word_embeddings=False,
        dtype=str(dtype).removeprefix("torch."),
        **{OUTPUT_VOCAB_KEY: output_vocab, TIE_TO_TARGET_KEY: True},
        **extra,
    )
    return config


def write_draft(
    out_dir: Path, tensors: dict, token_map: torch.Tensor, config: dict, provenance: dict
) -> None:
    """The draft's files: weights, token map, config and how it was made."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    save_file({"token_map": token_map.long().contiguous()}, out_dir / DRAFT_TOKEN_MAP)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
