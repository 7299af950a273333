"""Load a Hugging Face checkpoint directory (config.json + safetensors) into the project's runner.

GGUF files and the embedded default are first turned into such a directory by the resolver."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from faser.models.registry import model_class
from faser_kernels import cpu_linear

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the attribute under which a bf16 model's linear layers keep their checkpoint's float32 values
# until they are packed (faser.runner.weights): a checkpoint dequantized from GGUF's blocks stays
# in them, which only the float32 values show
CHECKPOINT_FLOAT32 = "checkpoint_float32"
# config.json fields of the project's drafts (faser.distill): the number of output rows when it
# is smaller than the input vocabulary, and whether the input embedding is the target's own (not
# stored with the draft, lent by the target at load time)
OUTPUT_VOCAB_KEY = "faser_output_vocab_size"
TIE_TO_TARGET_KEY = "faser_tie_embedding_to_target"
DRAFT_TOKEN_MAP = "draft_token_map.safetensors"  # [draft_vocab] target ids of a reduced vocabulary


def load_token_map(draft_dir: str | Path) -> torch.Tensor | None:  # [draft_vocab] int64
    """The target ids of a draft's reduced output vocabulary; None for a full-vocabulary draft."""
    path = Path(draft_dir) / DRAFT_TOKEN_MAP
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    return load_file(path)["token_map"].long()


def load_hf_config(path: str | Path):
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model path {str(path)!r} has no config.json")
    return AutoConfig.from_pretrained(path)


def load_model(
    path: str | Path,
    device: str,
    dtype: str,
    max_position: int,
    target_embedding: nn.Embedding | None = None,
    float32_head: bool = False,
    float32_linears: bool = False,
) -> nn.Module:
    """target_embedding: the target's input embedding (on `device`, in `dtype`), lent to a draft
    whose config sets faser_tie_embedding_to_target; ignored for any other model. float32_head:
    keep the head's checkpoint values in float32 too (LlamaForCausalLM.keep_float32_head).
    float32_linears: keep the float32 checkpoint values of each linear layer that GGUF's blocks
    may hold beside it, under CHECKPOINT_FLOAT32, for packing (dropped with the layer)."""
    cfg = load_hf_config(path)
    model_cls = model_class(cfg)
    with torch.device("meta"):
        model = model_cls(cfg, max_position)
    borrowed = _borrowed_embedding(cfg, path, target_embedding)
    if borrowed is not None:
        model.embed_tokens = None  # not in the checkpoint: never allocated, never loaded
    # built on the meta device: no time spent on random init of weights about to be overwritten
    model = model.to_empty(device="cpu")
    model.rotary.reset_tables()
    _load_weights(model, Path(path))
    if model.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    head = model.lm_head.weight.detach().float().clone() if float32_head else None
    if float32_linears and DTYPES[dtype] != torch.float32:
        for module in model.modules():
            if isinstance(module, nn.Linear) and cpu_linear.may_hold_blocks(module.weight):
                # the float32 tensor itself: the conversion below gives the layer a new one
                setattr(module, CHECKPOINT_FLOAT32, module.weight.detach())
    model = model.to(device=device, dtype=DTYPES[dtype]).eval()
    if head is not None:
        model.keep_float32_head(head.to(device))
    if borrowed is not None:
        model.embed_tokens = borrowed
    return model


def _borrowed_embedding(cfg, path, target_embedding: nn.Embedding | None) -> nn.Embedding | None:
    if not getattr(cfg, TIE_TO_TARGET_KEY, False):
        return None
    if target_embedding is None:
        raise ValueError(
            f"model {str(path)!r} sets {TIE_TO_TARGET_KEY}: it is a draft that reads its "
            "target's embedding; load it as the draft_model of that target"
        )
    if tuple(target_embedding.weight.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(
            f"draft_model {str(path)!r} expects a [{cfg.vocab_size}, {cfg.hidden_size}] target "
            f"embedding, the target has {list(target_embedding.weight.shape)}"
        )
    return target_embedding


def _checkpoint_tensors(path: Path):
    index = path / "model.safetensors.index.json"
    files = (
        sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        if index.exists()
        else sorted(p for p in path.glob("*.safetensors") if p.name != DRAFT_TOKEN_MAP)
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
        _check_finite(hf_name, tensor, path)
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


def _check_finite(name: str, tensor: torch.Tensor, path: Path) -> None:
    """A NaN or an infinity in a weight is a damaged checkpoint. Refused here, since at serving
    time most of them fail every request, and one in a row of the head fails none and silently
    changes which token wins."""
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor.sum())):
        return  # a NaN or an infinity makes the sum one: one read, no mask of the tensor's size
    if not bool(torch.isfinite(tensor).all()):  # not merely a sum that overflowed
        raise ValueError(f"checkpoint {str(path)!r}: tensor {name!r} holds NaN or infinite "
                         "values (a damaged checkpoint)")


def _copy_shard(model: nn.Module, param: nn.Parameter, tensor: torch.Tensor, parts, shard) -> None:
    layer = model.get_submodule(".".join(parts[:-2]))
    if parts[-2] == "gate_proj" or parts[-2] == "up_proj":
        sizes = [layer.intermediate_size] * 2
    else:
        sizes = [layer.q_size, layer.kv_size, layer.kv_size]
    start = sum(sizes[:shard])
    param.data[start : start + sizes[shard]].copy_(tensor)
