"""Knowledge distillation of the draft from the target's labels.

Loss at every answer position: half cross-entropy on the target's greedy token (what greedy
speculation must guess), half soft cross-entropy on the target's top-k distribution (how sure the
target is, which carries more signal per token and steadies sampled speculation). Both live in the
draft's reduced output vocabulary; target tokens outside it are dropped from the soft labels and
count as a miss for the greedy one. Greedy agreement on held-out answers (the teacher-forced
per-token acceptance rate) is measured after every epoch and the best draft is exported."""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from faser.distill.teacher import TeacherLabels


@dataclass(frozen=True, slots=True)
class TrainConfig:
    epochs: int = 8
    lr: float = 5e-4
    warmup_steps: int = 10
    batch_tokens: int = 1024  # padded tokens per optimiser step
    hard_weight: float = 0.5  # the rest goes to the soft top-k term
    time_budget_s: float = 1200.0
    seed: int = 0


def select_token_map(
    labels: list[TeacherLabels], output_vocab: int, target_vocab: int, always: set[int]
) -> torch.Tensor:  # [output_vocab] int64 target ids
    """The target's most frequent tokens: counted over its greedy tokens and top-k candidates,
    then, for the rest, by id (byte-pair merges come roughly in order of frequency)."""
    counts: Counter[int] = Counter()
    for label in labels:
        counts.update(label.top_ids[:, 0].tolist())
        counts.update(label.top_ids[:, 0].tolist())  # the greedy token weighs twice
        counts.update(label.top_ids[:, 1:].flatten().tolist())
    ranked = sorted(always) + [t for t, _ in counts.most_common() if t not in always]
    seen = set(ranked)
    ranked += [t for t in range(target_vocab) if t not in seen]
    return torch.tensor(sorted(ranked[:output_vocab]), dtype=torch.long)


def train_draft(
    draft,
    labels: list[TeacherLabels],
    held_out: list[TeacherLabels],
    token_map: torch.Tensor,  # [output_vocab] target ids
    config: TrainConfig,
    export: Callable[[dict], None],
    reported: dict[str, list[TeacherLabels]] | None = None,
) -> dict:
    """Trains `draft` in place; calls export(summary) whenever held-out agreement improves.
    `reported` names subsets of `held_out` whose agreement is also reported at every epoch."""
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    to_draft = torch.full((int(token_map.max()) + 1,), -1, dtype=torch.long)
    to_draft[token_map] = torch.arange(token_map.numel())
    batches = _batches(labels, config.batch_tokens)
    total_steps = config.epochs * len(batches)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(config, total_steps))
    before = _agreement(draft, held_out, to_draft, config.batch_tokens)
    splits = {name: [] for name in reported or {}}
    summary = {"held_out_agreement": [before], "held_out_agreement_by_split": splits}
    best, deadline, step = -1.0, time.monotonic() + config.time_budget_s, 0
    tqdm.write(f"distill: held-out greedy agreement before training {before:.3f}")
    _report_splits(draft, reported or {}, splits, to_draft, config.batch_tokens)
    for epoch in range(config.epochs):
        rng.shuffle(batches)
        bar = tqdm(batches, desc=f"distill: epoch {epoch + 1}/{config.epochs}")
        draft.train()
        for batch in bar:
            loss = _loss(draft, batch, to_draft, config.hard_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if time.monotonic() > deadline:
                break
        agreement = _agreement(draft, held_out, to_draft, config.batch_tokens)
        summary["held_out_agreement"].append(agreement)
        summary["epochs_run"], summary["steps"] = epoch + 1, step
        tqdm.write(f"distill: epoch {epoch + 1} held-out greedy agreement {agreement:.3f}")
        _report_splits(draft, reported or {}, splits, to_draft, config.batch_tokens)
        if agreement > best:
            best = agreement
            export({**summary, "best_held_out_agreement": best})
        if time.monotonic() > deadline:
            break
    return {**summary, "best_held_out_agreement": best}


def _report_splits(
    draft, reported: dict[str, list[TeacherLabels]], splits: dict[str, list[float]],
    to_draft: torch.Tensor, batch_tokens: int,
) -> None:
    for name, labels in reported.items():
        splits[name].append(_agreement(draft, labels, to_draft, batch_tokens))
        tqdm.write(f"distill:   of which {name} ({len(labels)} answers): {splits[name][-1]:.3f}")


def _lr_lambda(config: TrainConfig, total_steps: int) -> Callable[[int], float]:
    def scale(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        decay_steps = max(1, total_steps - config.warmup_steps)
        progress = min(1.0, (step - config.warmup_steps) / decay_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return scale


def _batches(labels: list[TeacherLabels], batch_tokens: int) -> list[list[TeacherLabels]]:
    batches: list[list[TeacherLabels]] = [[]]
    for label in sorted(labels, key=lambda x: x.token_ids.numel()):
        if batches[-1] and label.token_ids.numel() * (len(batches[-1]) + 1) > batch_tokens:
            batches.append([])
        batches[-1].append(label)
    return [b for b in batches if b]


def _answer_logits(draft, batch: list[TeacherLabels]) -> torch.Tensor:  # [positions, out_vocab]
    width = max(x.token_ids.numel() for x in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, x in enumerate(batch):
        ids[row, : x.token_ids.numel()], mask[row, : x.token_ids.numel()] = x.token_ids, 1
    if getattr(draft, "reads_features", False):  # a feature draft also reads the target's
        logits = draft(ids, mask, _padded_features(batch, width))
    else:
        logits = draft(ids, mask)  # [batch, width, out_vocab]
    # a feature draft in training adds passes that read its own guesses, stacked along dim 0
    passes = logits.shape[0] // len(batch)
    rows = [
        logits[p * len(batch) + row, x.first : x.token_ids.numel() - 1]
        for p in range(passes)
        for row, x in enumerate(batch)
    ]
    return torch.cat(rows)  # [passes * positions, out_vocab]


def _padded_features(batch: list[TeacherLabels], width: int) -> torch.Tensor:
    if any(x.features is None for x in batch):
        raise ValueError("a feature draft trains on labels with the target's features")
    dim = batch[0].features.shape[-1]
    out = torch.zeros(len(batch), width, dim)
    for row, x in enumerate(batch):
        out[row, : x.token_ids.numel()] = x.features.float()
    return out  # [batch, width, feature_dim]


def _loss(draft, batch: list[TeacherLabels], to_draft: torch.Tensor, hard_weight: float):
    logq = torch.log_softmax(_answer_logits(draft, batch).float(), dim=-1)  # [n, out_vocab]
    top_ids = torch.cat([x.top_ids for x in batch]).long()  # [positions, k] target ids
    top_p = torch.cat([x.top_logprobs for x in batch]).float().exp()  # [positions, k]
    passes = logq.shape[0] // top_ids.shape[0]
    top_ids, top_p = top_ids.repeat(passes, 1), top_p.repeat(passes, 1)  # [n, k]
    idx = _lookup(to_draft, top_ids)  # [n, k] draft rows, -1 outside the draft's vocabulary
    hard = F.nll_loss(logq, idx[:, 0], ignore_index=-1)
    inside = idx >= 0
    p = torch.where(inside, top_p, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    soft = -(p * logq.gather(1, idx.clamp_min(0))).sum(-1).mean()
    return hard_weight * hard + (1.0 - hard_weight) * soft


def _lookup(to_draft: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    inside = target_ids < to_draft.numel()
    return torch.where(inside, to_draft[target_ids.clamp_max(to_draft.numel() - 1)], -1)


@torch.no_grad()
def _agreement(draft, labels: list[TeacherLabels], to_draft, batch_tokens: int) -> float:
    """How often the draft's greedy token is the target's, along the target's own answers."""
    draft.eval()
    hits = total = 0
    for batch in _batches(labels, batch_tokens):
        guess = _answer_logits(draft, batch).argmax(-1)  # [n] draft rows
        want = _lookup(to_draft, torch.cat([x.top_ids[:, 0] for x in batch]).long())
        hits += int((guess == want).sum())
        total += want.numel()
    return hits / max(1, total)
