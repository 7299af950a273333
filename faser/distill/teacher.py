"""The target's top-k next-token distribution at every answer position, computed once (one
batched forward pass per group of sequences, far cheaper per token than decoding) and cached;
for a feature draft also the target's features at every position (the same pass)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm


@dataclass(slots=True)
class TeacherLabels:
    """For one sequence prompt + answer, the positions that predict the answer's tokens."""

    token_ids: torch.Tensor  # [seq] int64: prompt then answer
    first: int  # position predicting the answer's first token (len(prompt) - 1)
    top_ids: torch.Tensor  # [num_positions, k] int32 target ids, best first
    top_logprobs: torch.Tensor  # [num_positions, k] float16, log-softmax over the full vocab
    # [seq, len(feature_layers) * hidden] float16: what a feature draft reads (see
    # LlamaForCausalLM.forward_features); None for a standalone draft
    features: torch.Tensor | None = None


def teacher_labels(
    target,
    records: list[dict],
    top_k: int,
    cache: Path,
    batch_tokens: int = 2048,
    feature_layers: tuple[int, ...] = (),
) -> list[TeacherLabels]:
    """Labels for every record. Records only ever get appended, so `cache` holds the labels of a
    prefix of them and only the rest are computed (and the cache extended)."""
    done: list[TeacherLabels] = torch.load(cache, weights_only=False) if cache.is_file() else []
    done = done[: len(records)]
    todo = records[len(done) :]
    order = sorted(range(len(todo)), key=lambda i: _length(todo[i]))
    new: list[TeacherLabels | None] = [None] * len(todo)
    with tqdm(total=len(todo), desc="distill: target top-k labels") as bar:
        for group in _groups(order, todo, batch_tokens):
            group_labels = _label_group(target, [todo[i] for i in group], top_k, feature_layers)
            for i, label in zip(group, group_labels, strict=True):
                new[i] = label
            bar.update(len(group))
    labels = done + new  # type: ignore[operator]
    if todo:
        torch.save(labels, cache)
    return labels


@torch.inference_mode()
def _label_group(
    target, records: list[dict], top_k: int, feature_layers: tuple[int, ...]
) -> list[TeacherLabels]:
    seqs = [torch.tensor(r["prompt_ids"] + r["response_ids"]) for r in records]
    width = max(s.numel() for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : s.numel()], mask[row, : s.numel()] = s, 1
    outputs = target.model(
        input_ids=ids, attention_mask=mask, use_cache=False,
        output_hidden_states=bool(feature_layers),
    )
    hidden = outputs.last_hidden_state
    features = _features(outputs.hidden_states, feature_layers) if feature_layers else None
    out = []
    for row, (r, s) in enumerate(zip(records, seqs, strict=True)):
        first = len(r["prompt_ids"]) - 1
        logits = target.lm_head(hidden[row, first : s.numel() - 1]).float()  # [n, vocab]
        top = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)
        row_features = None if features is None else features[row, : s.numel()].half()
        out.append(TeacherLabels(s, first, top.indices.int(), top.values.half(), row_features))
    return out


def _features(hidden_states: tuple, layers: tuple[int, ...]) -> torch.Tensor:
    """As LlamaForCausalLM.forward_features computes them in the engine: inner layers RMS-scaled,
    the last (Hugging Face's final entry, already normed) as is."""
    from faser.layers.norm import rms_scale

    last = len(hidden_states) - 1
    return torch.cat(
        [hidden_states[i] if i == last else rms_scale(hidden_states[i]) for i in layers], dim=-1
    )


def _groups(order: list[int], records: list[dict], batch_tokens: int) -> list[list[int]]:
    groups: list[list[int]] = [[]]
    for i in order:
        width = _length(records[i])
        if groups[-1] and width * (len(groups[-1]) + 1) > batch_tokens:
            groups.append([])
        groups[-1].append(i)
    return [g for g in groups if g]


def _length(record: dict) -> int:
    return len(record["prompt_ids"]) + len(record["response_ids"])
