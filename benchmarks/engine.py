"""Side-by-side benchmark of the engine core, in one run on one machine:

  A. plain decoding against Hugging Face `generate` (batch 1 and 16, output tokens/s, ratio);
  B. `fixed` speculation against `off` (batch 1 and 16);
  C. the target's forward time for 1-32 tokens of one request against a warm KV cache.

Each figure is the median of interleaved repeats. Usage:
  python -m benchmarks.engine [--model M --draft-model D] [--variants bf16-packed,fp32-dense]
      [--threads 1] [--max-tokens 48] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import (
    DEFAULT_PROMPTS,
    chat_ids,
    interleaved,
    print_table,
    spec_bench_prompts,
    timed,
)
from faser import LLM, SamplingParams, SpecConfig
from faser.runner.batch import Chunk

FORWARD_TOKENS = (1, 2, 3, 4, 5, 8, 9, 16, 32)  # 2: a k = 1 verification
CONTEXT = 300


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--variants", default="bf16-packed,bf16-dense,fp32-packed,fp32-dense",
                    help="DTYPE-LAYOUT side by side: bf16 or fp32, packed or dense weights")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--ks", default="2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args()


def make_engine(args: argparse.Namespace, variant: str) -> LLM:
    dtype, _, weight_format = variant.partition("-")
    dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype)
    return LLM(args.model, draft_model=args.draft_model, spec=SpecConfig(policy="off"),
               num_threads=args.threads, weight_format=weight_format, dtype=dtype,
               max_num_seqs=32)


def engine_run(llm: LLM, prompts, max_tokens: int, spec: dict | None = None) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seconds = timed(lambda: llm.generate(prompts, params, spec=spec))
    return len(prompts) * max_tokens / seconds


def hf_run(model, tokenizer, prompts, max_tokens: int) -> float:
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        seconds = timed(lambda: model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
            min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad,
        ))
    return len(prompts) * max_tokens / seconds


def throughput_runs(engines: dict[str, LLM], hf, tokenizer, prompts, args) -> dict:
    """name -> a call that measures output tokens/s once."""
    tokens = args.max_tokens
    runs = {f"faser off ({fmt})": (lambda e=e: engine_run(e, prompts, tokens))
            for fmt, e in engines.items()}
    if hf is not None:
        runs["hf generate"] = lambda: hf_run(hf, tokenizer, prompts, tokens)
    has_draft = next(iter(engines.values())).engine.speculator.has_draft
    for k in (int(k) for k in args.ks.split(",")) if has_draft else ():
        for fmt, e in engines.items():
            spec = {"policy": "fixed", "max_k": k}
            runs[f"faser fixed:{k} ({fmt})"] = (
                lambda e=e, spec=spec: engine_run(e, prompts, tokens, spec)
            )
    return runs


def forward_timer(llm: LLM, n: int):
    engine = llm.engine
    table: list[int] = []
    engine.blocks.allocate("bench", table, CONTEXT + max(FORWARD_TOKENS))
    engine.target.forward([Chunk(list(range(100, 100 + CONTEXT)), 0, table, 1)])  # warm cache
    chunk = Chunk(list(range(500, 500 + n)), CONTEXT, table, num_logits=n)
    return lambda: timed(lambda: engine.target.forward([chunk]))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    formats = args.variants.split(",")
    engines = {fmt: make_engine(args, fmt) for fmt in formats}
    first = engines[formats[0]]
    tokenizer = first.tokenizer
    rows = spec_bench_prompts(args.prompts, max(int(b) for b in args.batch_sizes.split(",")))
    prompts = [chat_ids(tokenizer, r["turns"][0]) for r in rows]
    records: list[dict] = []
    hf = None if args.no_hf else _hf_model(first)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        runs = throughput_runs(engines, hf, tokenizer, prompts[:batch], args)
        for e in engines.values():  # warm-up
            engine_run(e, prompts[:1], 4)
        result = interleaved(runs, args.repeats)
        base = result.get("hf generate") or result[f"faser off ({formats[0]})"]
        table = [[name, batch, tps, tps / base] for name, tps in result.items()]
        print_table(f"Output tokens/s at batch {batch} ({args.max_tokens} tokens, greedy, "
                    f"{args.threads} thread(s)); ratio to {'HF' if hf else 'the first'}",
                    ["engine", "batch", "tok/s", "ratio"], table)
        records += [{"table": "throughput", "engine": r[0], "batch": batch, "tokens_per_s": r[2]}
                    for r in table]
    runs = {f"{fmt} {n}": forward_timer(e, n) for fmt, e in engines.items() for n in FORWARD_TOKENS}
    times = interleaved(runs, max(5, args.repeats * 3))
    table = []
    for fmt in formats:
        one = times[f"{fmt} 1"]
        table += [[fmt, n, times[f"{fmt} {n}"] * 1e3, times[f"{fmt} {n}"] / one]
                  for n in FORWARD_TOKENS]
    print_table(f"Target forward, one request, {CONTEXT} cached tokens",
                ["weights", "tokens", "ms", "x one token"], table)
    records += [{"table": "forward", "weights": r[0], "tokens": r[1], "ms": r[2]} for r in table]
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


def _hf_model(llm: LLM):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llm.engine.pair.target_dir).eval()


if __name__ == "__main__":
    main()
