"""Tiny random-weight checkpoints written with transformers, for engine tests."""

from __future__ import annotations

from pathlib import Path

import torch

SHAPES = {
    # name: (model_type, hidden, layers, heads, kv_heads, tie)
    "gqa_tied": ("llama", 64, 2, 4, 2, True),
    "mha_untied": ("llama", 48, 3, 3, 3, False),  # odd head count
    "qwen2_bias": ("qwen2", 64, 2, 4, 1, False),
    "draft": ("llama", 32, 1, 2, 1, True),
}


def make_checkpoint(path: Path, shape: str, vocab_size: int = 97, seed: int = 0) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, hidden, layers, heads, kv_heads, tie = SHAPES[shape]
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tie,
        max_position_embeddings=256,
        initializer_range=0.2,  # sharper logits than the default, so outputs vary with context
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_noisy_copy(target: Path, path: Path, noise: float, seed: int = 1) -> Path:
    """A draft that agrees with the target only partly: the target's weights plus noise."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    model.save_pretrained(path, safe_serialization=True)
    return path


def poison_token(engine, token: int) -> None:
    """Token `token`'s embedding in a loaded engine's target set to NaN: the model's output for
    any request that feeds it is NaN, as a model's own overflow would make it, and finite for
    the others. In memory, since the loader refuses a checkpoint that holds a NaN."""
    with torch.no_grad():
        engine.pair.target.embed_tokens.weight[token] = float("nan")


def write_nan(path: Path, token: int) -> Path:
    """The checkpoint with token `token`'s embedding NaN on disk (a damaged checkpoint)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.get_input_embeddings().weight[token] = float("nan")
    model.save_pretrained(path, safe_serialization=True)
    return path
