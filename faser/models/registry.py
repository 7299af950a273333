"""Which Hugging Face architectures the runner can execute."""

from __future__ import annotations

from torch import nn

from faser.models.feature_draft import FeatureDraft, is_feature_draft
from faser.models.llama import LlamaForCausalLM

# model_type -> model class; all of these share the Llama layout (Qwen2 adds q/k/v biases, Qwen3
# per-head q/k norms, both handled inside the Llama modules)
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def model_class(hf_config) -> type[nn.Module]:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported architecture: model_type {model_type!r} "
            f"(supported: {sorted(MODEL_REGISTRY)})"
        )
    if is_feature_draft(hf_config):  # a draft that reads the target's features (EAGLE-style)
        return FeatureDraft
    return MODEL_REGISTRY[model_type]
