"""`faser distill`: prompts -> the target's answers -> its top-k labels -> a trained draft.
Real text that ships with Python (faser.distill.corpus), labelled the same way, can join the
answers; `init_from` resumes training from a draft already written (faser.distill.warm_start).

The draft (engine format, see faser.distill.model) lands in --out; the answers and labels in the
work directory (--work-dir, default <out>/_work), so a rerun resumes and an interrupted one
still leaves the best draft exported so far."""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from faser.distill.corpus import corpus_records
from faser.distill.feature_model import build_feature_draft, export_feature_draft
from faser.distill.generate import GenerationConfig, generate_data
from faser.distill.model import build_draft, export_draft
from faser.distill.teacher import teacher_labels
from faser.distill.train import TrainConfig, select_token_map, train_draft
from faser.distill.warm_start import load_weights, read_provenance, read_token_map

HELD_OUT_EVERY = 10  # every 10th greedy answer is kept out of training, to measure agreement
FILES_SPLIT = "prompt files"  # the name the prompt files' held-out split is reported under


@dataclass(frozen=True, slots=True)
class DistillConfig:
    target: str
    out: Path
    generation: GenerationConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    layer_ids: tuple[int, ...] = (0, 1)  # target layers the draft's layers start from
    # non-empty: a feature draft (EAGLE-style) reading these target layers' outputs (Hugging
    # Face hidden_states numbering; the target's layer count is its final output)
    feature_layers: tuple[int, ...] = ()
    output_vocab: int = 8192
    top_k: int = 32
    num_threads: int = 2
    work_dir: Path | None = None  # None: <out>/_work
    corpus_tokens: int = 0  # real-text tokens labelled beside the answers (faser.distill.corpus)
    corpus_width: int = 1024  # tokens per real-text sequence
    init_from: Path | None = None  # a written draft to resume from (its token map and weights)

    def __post_init__(self) -> None:
        if not self.layer_ids:
            raise ValueError("layer_ids must name at least one target layer")
        if self.output_vocab < 2 or self.top_k < 1:
            raise ValueError("output_vocab must be >= 2 and top_k >= 1")
        if self.corpus_tokens < 0 or self.corpus_width < 2:
            raise ValueError("corpus_tokens must be >= 0 and corpus_width >= 2")


def distill(config: DistillConfig) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from faser.models.resolver import resolve_model

    torch.set_num_threads(config.num_threads)
    torch.set_flush_denormal(True)  # denormal activations slow CPU matmuls many times over
    started = time.monotonic()
    work = config.work_dir or config.out / "_work"
    work.mkdir(parents=True, exist_ok=True)
    records = generate_data(config.generation, work / "answers.jsonl")
    generation_s = time.monotonic() - started
    target_dir = resolve_model(config.target)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    if max(config.layer_ids) >= target.config.num_hidden_layers:
        raise ValueError(f"layer_ids: the target has {target.config.num_hidden_layers} layers")
    num_layers = target.config.num_hidden_layers
    if any(not 1 <= i <= num_layers for i in config.feature_layers):
        raise ValueError(f"feature_layers: the target has layers 1..{num_layers}")
    suffix = "".join(f"-f{i}" for i in config.feature_layers)
    labels = teacher_labels(
        target, records, config.top_k, work / f"top{config.top_k}{suffix}.pt",
        feature_layers=config.feature_layers,
    )
    split = held_out_split(records)
    held = set(split.files) | set(split.others)
    train_set = [x for i, x in enumerate(labels) if i not in held]
    if config.init_from is not None:
        token_map = read_token_map(config.init_from)
    else:  # the tokens the answers need most: they, not the real text, are what drafts guess
        eos = {int(t) for t in [target.config.eos_token_id] if t is not None}
        token_map = select_token_map(train_set, config.output_vocab, target.config.vocab_size, eos)
    corpus = corpus_records(
        AutoTokenizer.from_pretrained(target_dir), config.corpus_tokens, config.corpus_width,
        config.generation.seed,
    )
    if corpus:
        name = f"corpus{config.corpus_tokens}-w{config.corpus_width}-top{config.top_k}{suffix}.pt"
        train_set += teacher_labels(
            target, corpus, config.top_k, work / name, feature_layers=config.feature_layers
        )
    if config.feature_layers:
        draft = build_feature_draft(
            target, config.feature_layers, list(config.layer_ids), token_map
        )
        write = export_feature_draft
    else:
        draft, write = build_draft(target, list(config.layer_ids), token_map), export_draft
    if config.init_from is not None:
        load_weights(draft, config.init_from)
    del target
    provenance = _provenance(config, records, corpus, generation_s)

    def export(summary: dict) -> None:
        info = {**provenance, "training": summary, "elapsed_s": time.monotonic() - started}
        write(draft, token_map, config.out, info)

    reported = {FILES_SPLIT: [labels[i] for i in split.files]} if split.files else {}
    summary = train_draft(
        draft, train_set, [labels[i] for i in sorted(held)], token_map, config.train, export,
        reported=reported,
    )
    tqdm.write(f"distill: draft written to {config.out} in {time.monotonic() - started:.0f} s")
    return summary


class HeldOutSplit(NamedTuple):
    files: list[int]  # records of the prompt files' held-out prompts
    others: list[int]  # every HELD_OUT_EVERY-th greedy record of the other prompts


def held_out_split(records: list[dict]) -> HeldOutSplit:
    """The records kept out of training. A prompt file's record says whether it is held out (its
    file's split, fixed by line); of the others, every tenth greedy answer is."""
    files = [i for i, r in enumerate(records) if r.get("held_out")]
    others = [i for i, r in enumerate(records) if "held_out" not in r and not r["sampled"]]
    return HeldOutSplit(files, others[::HELD_OUT_EVERY])


def _provenance(
    config: DistillConfig, records: list[dict], corpus: list[dict], generation_s: float
) -> dict:
    categories: dict[str, int] = {}
    for r in records:
        categories[r["category"]] = categories.get(r["category"], 0) + len(r["response_ids"])
    return {
        "command": "faser distill",
        "config": {
            "target": config.target,
            "generation": asdict(config.generation),
            "train": asdict(config.train),
            "layer_ids": list(config.layer_ids),
            "feature_layers": list(config.feature_layers),
            "output_vocab": config.output_vocab,
            "top_k": config.top_k,
            "corpus_tokens": config.corpus_tokens,
            "corpus_width": config.corpus_width,
            "init_from": None if config.init_from is None else str(config.init_from),
        },
        "python": platform.python_version(),  # the corpus is this Python's standard library
        "num_corpus_tokens": {
            c: sum(len(r["response_ids"]) + 1 for r in corpus if r["category"] == c)
            for c in sorted({r["category"] for r in corpus})
        },
        # the draft this one resumed from, as it was made
        "init_from_provenance": None if config.init_from is None
        else read_provenance(config.init_from),
        "num_answers": len(records),
        "num_prompt_file_answers": sum("held_out" in r for r in records),
        "num_held_out_prompt_file_answers": sum(bool(r.get("held_out")) for r in records),
        "num_sampled_answers": sum(r["sampled"] for r in records),
        "num_answer_tokens": sum(len(r["response_ids"]) for r in records),
        "answer_tokens_by_category": categories,
        "generation_s": generation_s,
    }
