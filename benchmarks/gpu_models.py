"""Random-weight Llama checkpoints of real sizes, written on the spot: the GPU check downloads
nothing. Weights are drawn on the device (fast for a 1B model) and saved as bf16 safetensors with
a transformers config.json, so the engine loads them like any Hugging Face checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @property
    def num_params(self) -> int:
        head_dim = self.hidden // self.heads
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp + 2 * self.hidden) + 2 * self.vocab * self.hidden


# Llama-3.2-1B-like (head_dim 64, GQA 4) and a draft of about 100M, both with a 32k vocabulary
TARGET_1B = ModelSpec("target-1b", 2048, 16, 32, 8, 8192, 32000)
DRAFT_100M = ModelSpec("draft-100m", 1024, 4, 16, 4, 4096, 32000)
TINY_TARGET = ModelSpec("tiny-target", 64, 2, 4, 2, 128, 512)
TINY_DRAFT = ModelSpec("tiny-draft", 32, 1, 2, 1, 64, 512)


def write_checkpoint(
    spec: ModelSpec, path: Path, seed: int, device: str, std: float = 0.02,
    max_position: int = 4096,
) -> Path:
    """config.json + model.safetensors of a random-weight Llama: weights ~ N(0, std), norms 1.
    Untied head: with a tied one, random weights make every model predict its input token."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, max_position_embeddings=max_position,
        tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in LlamaForCausalLM(config).state_dict().items()}
    gen = torch.Generator(device).manual_seed(seed)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=dtype)
        else:
            values = torch.randn(shape, generator=gen, device=device) * std
            tensors[name] = values.to(dtype).cpu()
    save_file(tensors, str(path / "model.safetensors"))
    return path


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=gen).tolist()
