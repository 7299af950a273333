"""Teacher-forced agreement of a feature draft with the target on the target's own answers to the
Spec-Bench prompts: `python -m benchmarks.draft_agreement`.

Distillation measures greedy agreement on held-out answers to its built-in prompts
(faser.distill.train); this measures the same on the benchmark's prompts (first turn, chat
template, the target's greedy answer from the engine), per category:
- first: the draft's token equals the target's, reading the target's features (a k = 1 draft
  without prompt lookup: what `benchmarks.draft` reports as alpha, there with lookup);
- second | first: the next token too, reading its own guess in place of the target's features,
  counted where the first was right (as drafting a second token is).
Held-out agreement well above `first` means the training prompts, not the engine, limit the
draft; `first` well above the engine's k = 1 acceptance without lookup means the engine feeds
the draft differently from training. Usage:
  python -m benchmarks.draft_agreement [--draft DIR] [--num-prompts 26] [--max-tokens 64]
      [--threads 2] [--json OUT]"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.common import DEFAULT_PROMPTS, chat_ids, print_table
from benchmarks.draft import load_prompts
from faser import LLM, SamplingParams, SpecConfig
from faser.distill.feature_model import build_feature_draft
from faser.distill.teacher import TeacherLabels, teacher_labels
from faser.distill.warm_start import load_weights, read_token_map
from faser.models.loader import load_hf_config
from faser.models.resolver import resolve_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="default-draft", help="a feature draft: name or directory")
    ap.add_argument("--data", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--num-prompts", type=int, default=26)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def target_answers(args, prompts: list[list[int]]) -> list[dict]:
    """The target's greedy answers, as distillation's records."""
    llm = LLM(args.target, spec=SpecConfig(policy="off"), num_threads=args.threads,
              max_num_seqs=len(prompts), max_num_batched_tokens=2048)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    return [{"prompt_ids": list(p), "response_ids": list(o.token_ids)}
            for p, o in zip(prompts, outputs, strict=True)]


def load_feature_draft(target, draft_dir: Path):
    config = load_hf_config(draft_dir)
    feature_layers = tuple(getattr(config, "faser_feature_layers", None) or ())
    if not feature_layers:
        raise ValueError(f"{draft_dir} is not a feature draft (no faser_feature_layers)")
    token_map = read_token_map(draft_dir)
    # the layer ids only seed a fresh draft's layers; the written weights replace them
    draft = build_feature_draft(
        target, feature_layers, list(range(config.num_hidden_layers)), token_map
    )
    load_weights(draft, draft_dir)
    return draft, feature_layers, token_map


@torch.inference_mode()
def agreement(draft, label: TeacherLabels, to_draft: torch.Tensor) -> tuple[int, int, int]:
    """(positions, first right, second right where the first was) for one answer."""
    draft.train()  # the training forward: a second pass that reads the draft's own guesses
    ids = label.token_ids[None]
    logits = draft(ids, torch.ones_like(ids), label.features.float()[None])  # [2, seq, vocab]
    span = slice(label.first, label.token_ids.numel() - 1)
    want = label.top_ids[:, 0].long()
    inside = want < to_draft.numel()
    want = torch.where(inside, to_draft[want.clamp_max(to_draft.numel() - 1)], -1)
    first = logits[0, span].argmax(-1) == want
    second = logits[1, span].argmax(-1) == want
    # the second drafted token at p + 1 follows the first at p
    return want.numel(), int(first.sum()), int((first[:-1] & second[1:]).sum())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    picked = load_prompts(args.data, args.num_prompts)
    target_dir = resolve_model(args.target)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    records = target_answers(args, [chat_ids(tokenizer, text) for _, text in picked])
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft_dir = Path(resolve_model(args.draft, kind="draft"))
    draft, feature_layers, token_map = load_feature_draft(target, draft_dir)
    with tempfile.TemporaryDirectory() as tmp:
        labels = teacher_labels(target, records, 1, Path(tmp) / "labels.pt",
                                feature_layers=feature_layers)
    to_draft = torch.full((int(token_map.max()) + 1,), -1, dtype=torch.long)
    to_draft[token_map] = torch.arange(token_map.numel())
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for (category, _), label in zip(picked, labels, strict=True):
        for name in ("overall", category):
            counts[name] = [a + b for a, b in zip(counts[name], agreement(draft, label, to_draft),
                                                  strict=True)]
    table = {
        name: {"positions": n, "first": first / max(1, n),
               "second_given_first": second / max(1, first)}
        for name, (n, first, second) in sorted(counts.items(), key=lambda kv: kv[0] != "overall")
    }
    print_table(
        f"Teacher-forced agreement of {args.draft} on the target's answers "
        f"({len(picked)} prompts, {args.max_tokens} tokens)",
        ["category", "positions", "first", "second | first"],
        [[name, e["positions"], round(e["first"], 3), round(e["second_given_first"], 3)]
         for name, e in table.items()],
    )
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
