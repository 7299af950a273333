"""Does a dtype keep the target's answers? Each dtype's teacher-forced top-1 agreement with the
float32 engine's own greedy answers to Spec-Bench prompts, and each dtype's answer to a question
with one right answer.

The float32 engine answers every prompt greedily; each engine then reads prompt + answer in one
prefill and predicts every answer token. float32 itself must agree 1.0 (the step is
row-invariant: a prefill row has the bits of the decode that produced it). Usage:
  python -m benchmarks.precision [--num-prompts 32] [--max-tokens 128] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import DEFAULT_PROMPTS, chat_ids, print_table, spec_bench_prompts
from faser import LLM, SamplingParams, SpecConfig
from faser.runner.batch import Chunk

QUESTION = "What is the capital of France?"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args()


def teacher_forced_top1(llm: LLM, prompt: list[int], answer: list[int]) -> list[int]:
    """The engine's argmax after each of prompt + answer[:-1], at the answer's positions."""
    engine = llm.engine
    ids = prompt + answer
    table: list[int] = []
    if not engine.blocks.allocate("precision", table, len(ids)):
        raise RuntimeError("no KV blocks for a teacher-forced pass")
    try:
        logits = engine.target.forward([Chunk(ids[:-1], 0, table, num_logits=len(answer))])
    finally:
        engine.blocks.free(table)
    return logits.argmax(dim=-1).tolist()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    dtypes = args.dtypes.split(",")
    engines = {d: LLM(args.model, draft_model=None, spec=SpecConfig(policy="off"), dtype=d,
                      num_threads=args.threads) for d in dtypes}
    reference = engines.get("float32") or LLM(args.model, dtype="float32",
                                              num_threads=args.threads)
    tokenizer = reference.tokenizer
    rows = spec_bench_prompts(args.prompts, args.num_prompts)
    prompts = [chat_ids(tokenizer, r["turns"][0]) for r in rows]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    answers = [o.token_ids for o in reference.generate(prompts, greedy)]
    records, table = [], []
    for dtype, llm in engines.items():
        agree = total = 0
        for prompt, answer in zip(prompts, answers, strict=True):
            top1 = teacher_forced_top1(llm, prompt, answer)
            agree += sum(a == b for a, b in zip(top1, answer, strict=True))
            total += len(answer)
        reply = llm.generate([chat_ids(tokenizer, QUESTION)], greedy)[0].text.strip()
        table.append([dtype, total, agree / total, reply[:60]])
        records.append({"dtype": dtype, "tokens": total, "agreement": agree / total,
                        "capital_of_france": reply})
    print_table(f"Teacher-forced top-1 agreement with float32's greedy answers "
                f"({len(prompts)} Spec-Bench prompts, up to {args.max_tokens} tokens each)",
                ["dtype", "tokens", "agreement", f"answer to {QUESTION!r}"], table)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
