"""The target, the optional draft and the tokenizer, loaded and checked against each other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from faser.config import EngineConfig
from faser.models.loader import DRAFT_TOKEN_MAP, load_hf_config, load_model, load_token_map
from faser.runner.model_runner import RunnerOptions
from faser.runner.weights import pack_weights, resolve_draft_weights, resolve_weight_format


@dataclass
class ModelPair:
    target: nn.Module
    draft: nn.Module | None
    tokenizer: object | None
    token_map: torch.Tensor | None  # [draft_vocab] int64
    model_name: str
    max_model_len: int
    eos_token_ids: frozenset[int]
    target_dir: Path
    draft_dir: Path | None
    runner_options: RunnerOptions  # how both models' forwards run (compile, CUDA graphs)
    weight_format: str = "dense"  # the layout both models' weights were packed in ("auto" decided)
    draft_weights: str = "same"  # "int8" or "q8_0" when the draft's weights are quantized


def resolve(path: str | None, kind: str) -> Path:
    if path is not None and (Path(path) / "config.json").is_file():
        return Path(path)
    from faser.models.resolver import resolve_model

    return Path(resolve_model(path, kind=kind))


def load_pair(config: EngineConfig, max_k: int) -> ModelPair:
    target_dir = resolve(config.model, "target")
    draft_name = config.draft_model
    if config.model is None and draft_name is None:
        draft_name = "default-draft"
    hf_config = load_hf_config(target_dir)
    max_len = config.max_model_len or int(getattr(hf_config, "max_position_embeddings", 4096))
    # rotary tables must also cover draft and verify positions past the last committed token
    max_position = max_len + max_k + 2
    # a bf16 target's head rescores its leading candidates in float32 (only where memory is
    # plentiful: the float32 copy of the head is the size of the vocabulary's embedding)
    float32_head = config.dtype == "bfloat16" and config.device == "cpu"
    weight_format = resolve_weight_format(config.weight_format, config.device, config.dtype)
    # a bf16 target keeps GGUF's blocks too: a decode at low load streams 0.375-0.56x the bf16
    # panels' bytes, and larger calls dequantize each panel once for all their rows
    keep_blocks = weight_format == "packed"
    target = load_model(target_dir, config.device, config.dtype, max_position,
                        float32_head=float32_head, float32_linears=keep_blocks)
    draft, token_map, draft_dir = None, None, None
    if draft_name is not None:
        draft_dir = resolve(draft_name, "draft")
        draft = load_model(
            draft_dir, config.device, config.dtype, max_position, target.embed_tokens
        )
        token_map = load_token_map(draft_dir)
        check_vocab(target, draft, token_map)
        check_features(target, draft)
    draft_weights = resolve_draft_weights(config.draft_weights, weight_format, config.dtype)
    pack_weights(target, weight_format, config.device)
    if draft is not None:
        pack_weights(draft, weight_format, config.device, draft_weights)
    tokenizer = _load_tokenizer(target_dir)
    return ModelPair(
        target, draft, tokenizer, token_map, config.model or "smollm2-135m-instruct", max_len,
        _eos_ids(hf_config, tokenizer, target_dir), target_dir, draft_dir,
        runner_options(config, max_position), weight_format,
        draft_weights if draft is not None else "same",
    )


def runner_options(config: EngineConfig, max_position: int) -> RunnerOptions:
    # a request's block table never covers more than its longest context plus its drafts
    return RunnerOptions(
        compile=config.compile,
        cuda_graphs=config.cuda_graphs,
        max_graph_batch=config.max_num_seqs,
        max_blocks_per_seq=-(-max_position // config.block_size) + 1,
    )


def check_vocab(target: nn.Module, draft: nn.Module, token_map: torch.Tensor | None) -> None:
    """The draft reads target ids, so its input vocabulary is the target's; its output rows are
    the target's vocabulary, or the target ids listed in its token map."""
    target_vocab = target.config.vocab_size
    if draft.config.vocab_size != target_vocab:
        raise ValueError(
            f"draft_model vocabulary ({draft.config.vocab_size}) does not match the target's "
            f"({target_vocab})"
        )
    output_vocab = draft.lm_head.out_features
    if token_map is None and output_vocab != target_vocab:
        raise ValueError(
            f"draft_model predicts {output_vocab} tokens but has no {DRAFT_TOKEN_MAP} naming them"
        )
    if token_map is not None and (
        token_map.numel() != output_vocab
        or int(token_map.min()) < 0
        or int(token_map.max()) >= target_vocab
    ):
        raise ValueError("draft_model token map does not fit the target's vocabulary")


def check_features(target: nn.Module, draft: nn.Module) -> None:
    """A feature draft reads target layers that exist, at the target's width."""
    if not getattr(draft, "reads_features", False):
        return
    if draft.config.hidden_size != target.config.hidden_size:
        raise ValueError(
            f"draft_model reads the target's features at width {draft.config.hidden_size}; "
            f"the target's hidden size is {target.config.hidden_size}"
        )
    num_layers = len(target.layers)
    if any(not 1 <= i <= num_layers for i in draft.feature_layers):
        raise ValueError(
            f"draft_model reads target layers {list(draft.feature_layers)}; the target has "
            f"layers 1..{num_layers}"
        )


def _load_tokenizer(path: Path):
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _eos_ids(hf_config, tokenizer, path: Path) -> frozenset[int]:
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        sources.append(GenerationConfig.from_pretrained(path).eos_token_id)
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return frozenset(ids)
