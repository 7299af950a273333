"""How well the draft guesses the target: `python -m benchmarks.draft`.

On the Spec-Bench dev prompts (first turn, chat template, greedy), in the project's engine:
- alpha: per-token greedy acceptance, from speculation with k = 1 (every drafted token sits on
  the target's own greedy path, so this is the probability that the draft's next token is the
  target's);
- mean acceptance length (tokens committed per target step) at k = 2, 4, 6 (policy fixed:k);
- coverage: the share of the target's greedy tokens that the draft's output vocabulary holds (a
  draft with a reduced vocabulary never guesses the others; prompt lookup still may);
- the draft's decode step time over the target's at batch 1 (same engine, same context);
overall and per category. Prints a table; --json writes the figures."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoTokenizer

from benchmarks.common import DEFAULT_PROMPTS, chat_ids
from faser import LLM, SamplingParams, SpecConfig
from faser.models.resolver import resolve_model
from faser.runner.batch import Chunk
from faser.runner.weights import DRAFT_WEIGHTS

K_VALUES = (2, 4, 6)


def load_prompts(path: Path, num_prompts: int) -> list[tuple[str, str]]:
    """(category, first turn), categories taken in turn so that a few prompts cover them all."""
    by_category: dict[str, list[str]] = defaultdict(list)
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_category[row["category"]].append(row["turns"][0])
    queues = [[(c, t) for t in turns] for c, turns in sorted(by_category.items())]
    picked: list[tuple[str, str]] = []
    while len(picked) < num_prompts and any(queues):
        for queue in queues:
            if queue and len(picked) < num_prompts:
                picked.append(queue.pop(0))
    return picked


def run_fixed(args, k: int, prompts: list[list[int]]) -> tuple[list, torch.Tensor | None]:
    """Greedy generation with a fixed k, one batch of all prompts: the outputs, and the draft's
    output vocabulary as target ids (None: the whole of the target's)."""
    spec = SpecConfig(policy=f"fixed:{k}", prompt_lookup=args.prompt_lookup)
    llm = LLM(
        args.target, draft_model=args.draft, spec=spec,
        num_threads=args.threads, max_num_seqs=max(1, len(prompts)),
        max_num_batched_tokens=max(512, len(prompts)), dtype=args.dtype,
        draft_weights=args.draft_weights,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    return llm.generate(prompts, params), llm.engine.pair.token_map


def coverage(outputs: list, token_map: torch.Tensor | None) -> list[tuple[int, int]]:
    """Per request, (its output tokens the draft's vocabulary holds, its output tokens)."""
    if token_map is None:
        return [(len(o.token_ids), len(o.token_ids)) for o in outputs]
    held = set(token_map.tolist())
    return [(sum(t in held for t in o.token_ids), len(o.token_ids)) for o in outputs]


def step_ratio(args, context: list[int], repeats: int) -> dict[str, float]:
    """Median batch-1 decode step of the draft and of the target, interleaved so that both see
    the same load on a shared machine."""
    llm = LLM(
        args.target, draft_model=args.draft, spec=SpecConfig(policy="fixed:1"),
        num_threads=args.threads, dtype=args.dtype, draft_weights=args.draft_weights,
    )
    engine = llm.engine
    table: list[int] = []
    if not engine.blocks.allocate("benchmark", table, len(context) + 1):
        raise ValueError("no KV blocks for the timing request")
    runners = {"target": engine.target, "draft": engine.speculator.proposer.runner}
    for runner in runners.values():  # prefill the context once
        runner.forward([Chunk(context, 0, table, num_logits=1)])
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, runner in runners.items():
            start = time.perf_counter()
            runner.forward([Chunk([context[-1]], len(context), table, num_logits=1)])
            times[name].append(time.perf_counter() - start)
    engine.blocks.free(table)
    target, draft = (statistics.median(times[n]) for n in ("target", "draft"))
    return {"target_step_ms": 1e3 * target, "draft_step_ms": 1e3 * draft, "ratio": draft / target}


def summarise(
    categories: list[str], stats_by_k: dict[int, list], held: list[tuple[int, int]]
) -> dict[str, dict]:
    groups = {"overall": list(range(len(categories)))}
    for i, c in enumerate(categories):
        groups.setdefault(c, []).append(i)
    table = {}
    for name, rows in groups.items():
        one = [stats_by_k[1][i] for i in rows]
        drafted = sum(s.num_draft_tokens for s in one)
        entry = {
            "num_prompts": len(rows),
            "alpha": sum(s.num_accepted_tokens for s in one) / drafted if drafted else 0.0,
            "coverage": _ratio(sum(held[i][0] for i in rows), sum(held[i][1] for i in rows)),
        }
        for k in K_VALUES:
            picked = [stats_by_k[k][i] for i in rows]
            steps = sum(s.num_steps for s in picked)
            accepted = sum(s.num_accepted_tokens for s in picked)
            entry[f"tau_k{k}"] = (accepted + steps) / steps if steps else 0.0
        table[name] = entry
    return table


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def print_table(table: dict[str, dict], timing: dict[str, float]) -> None:
    taus = "".join(f"{f'tau@{k}':>8}" for k in K_VALUES)
    header = f"{'category':<16}{'n':>4}{'alpha':>8}{taus}{'coverage':>10}"
    print(header)
    print("-" * len(header))
    for name, e in table.items():
        taus = "".join(f"{e[f'tau_k{k}']:>8.2f}" for k in K_VALUES)
        print(f"{name:<16}{e['num_prompts']:>4}{e['alpha']:>8.3f}{taus}{e['coverage']:>10.3f}")
    print(
        f"\nbatch-1 decode step: target {timing['target_step_ms']:.1f} ms, draft "
        f"{timing['draft_step_ms']:.1f} ms, draft/target {timing['ratio']:.3f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default="default-draft", help="draft name or directory")
    parser.add_argument("--data", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--num-prompts", type=int, default=26)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32")
    parser.add_argument("--draft-weights", default="auto", choices=DRAFT_WEIGHTS,
                        help="the draft's weights: int8 (packed bf16), q8_0 (packed float32), "
                        "or the target's")
    parser.add_argument("--prompt-lookup", action=argparse.BooleanOptionalAction, default=True,
                        help="greedy guesses from earlier occurrences of the newest tokens too")
    parser.add_argument("--timing-repeats", type=int, default=30)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    picked = load_prompts(args.data, args.num_prompts)
    categories = [c for c, _ in picked]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.target))
    prompts = [chat_ids(tokenizer, text) for _, text in picked]
    stats_by_k, held = {}, []
    for k in (1, *K_VALUES):
        outputs, token_map = run_fixed(args, k, prompts)
        stats_by_k[k] = [out.spec_stats for out in outputs]
        held = held or coverage(outputs, token_map)  # greedy: every k writes the same tokens
    table = summarise(categories, stats_by_k, held)
    timing = step_ratio(args, prompts[0], args.timing_repeats)
    print_table(table, timing)
    if args.json:
        figures = {"args": {k: str(v) for k, v in vars(args).items()}, "table": table, **timing}
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
