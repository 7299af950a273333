"""The target's top-k next-token distribution at every answer position, computed once (one
batched forward pass per group of sequences, far cheaper per token than decoding) and cached."""

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


def teacher_labels(
    target, records: list[dict], top_k: int, cache: Path, batch_tokens: int = 2048
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
            for i, label in zip(group, _label_group(target, [todo[i] for i in group], top_k),
                                strict=True):
                new[i] = label
            bar.update(len(group))
    labels = done + new  # type: ignore[operator]
    if todo:
        torch.save(labels, cache)
    return labels


@torch.inference_mode()
def _label_group(target, records: list[dict], top_k: int) -> list[TeacherLabels]:
    seqs = [torch.tensor(r["prompt_ids"] + r["response_ids"]) for r in records]
    width = max(s.numel() for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : s.numel()], mask[row, : s.numel()] = s, 1
    hidden = target.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    out = []
    for row, (r, s) in enumerate(zip(records, seqs, strict=True)):
        first = len(r["prompt_ids"]) - 1
        logits = target.lm_head(hidden[row, first : s.numel() - 1]).float()  # [n, vocab]
        top = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)
        out.append(TeacherLabels(s, first, top.indices.int(), top.values.half()))
    return out


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
