from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.tiny import make_checkpoint, make_noisy_copy


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Targets of several shapes, each with a draft that agrees with it only partly."""
    root = tmp_path_factory.mktemp("tiny")
    models = {}
    for shape in ("gqa_tied", "mha_untied", "qwen2_bias"):
        target = make_checkpoint(root / shape, shape)
        models[shape] = target
        models[f"{shape}_draft"] = make_noisy_copy(target, root / f"{shape}_draft", noise=0.12)
    models["small_draft"] = make_checkpoint(root / "small_draft", "draft")
    return models


@pytest.fixture(scope="session")
def hf_greedy(tiny_models):
    """Hugging Face transformers' own greedy generate: the oracle."""
    from transformers import AutoModelForCausalLM

    cache: dict = {}

    def generate(shape: str, prompt: list[int], max_tokens: int) -> list[int]:
        key = (shape, tuple(prompt), max_tokens)
        if key not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_models[shape])
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False,
            )
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]

    return generate
