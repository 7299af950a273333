"""Load a Hugging Face checkpoint directory (config.json + safetensors) into the project's runner.

GGUF files and the embedded default are first turned into such a directory by the resolver."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from faser.models.registry import model_class

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_config(path: str | Path):
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model path {str(path)!r} has no config.json")
    return AutoConfig.from_pretrained(path)


def load_model(path: str | Path, device: str, dtype: str, max_position: int) -> nn.Module:
    cfg = load_hf_config(path)
    model_cls = model_class(cfg)
    with torch.device("meta"):
        model = model_cls(cfg, max_position)
    # built on the meta device: no time spent on random init of weights about to be overwritten
    model = model.to_empty(device="cpu")
    model.rotary.reset_tables()
    _load_weights(model, Path(path))
    if model.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(device=device, dtype=DTYPES[dtype]).eval()


def _checkpoint_tensors(path: Path):
    index = path / "model.safetensors.index.json"
    files = (
        sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        if index.exists()
        else sorted(path.glob("*.safetensors"))
    )
    if not files:
        raise ValueError(f"model path {str(path)!r} has no .safetensors weights")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


# Hugging Face parameter -> (our parameter, shard index) for the fused projections
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _load_weights(model: nn.Module, path: Path) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, tensor in _checkpoint_tensors(path):
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name:
            continue
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, shard = _FUSED[parts[-2]]
            target = ".".join([*parts[:-2], fused, parts[-1]])
            _copy_shard(model, params[target], tensor, parts, shard)
            loaded.add(target)
            continue
        if name == "lm_head.weight" and model.tie_word_embeddings:
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
        params[name].data.copy_(tensor)
        loaded.add(name)
    if model.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks tensors: {sorted(missing)[:5]}")


def _copy_shard(model: nn.Module, param: nn.Parameter, tensor: torch.Tensor, parts, shard) -> None:
    layer = model.get_submodule(".".join(parts[:-2]))
    if parts[-2] == "gate_proj" or parts[-2] == "up_proj":
        sizes = [layer.intermediate_size] * 2
    else:
        sizes = [layer.q_size, layer.kv_size, layer.kv_size]
    start = sum(sizes[:shard])
    param.data[start : start + sizes[shard]].copy_(tensor)
