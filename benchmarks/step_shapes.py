"""The target's forward time for the shapes of a served step, with the CPU attention's requests
grouped by query count and context length (the engine's way) against one padded call for all
(the way before), side by side in one run.

Shapes: 16 or 32 requests, decodes only or with some verifying k = 1, at one short context for
all or at contexts spread over 150-1100 tokens (as Spec-Bench prompts are). Each figure is the
median of interleaved repeats. Usage:
  python -m benchmarks.step_shapes [--threads 2] [--repeats 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

import faser_kernels.attention as attention
from benchmarks.common import interleaved, print_table, timed
from faser import LLM, SpecConfig
from faser.runner.batch import Chunk

MAX_CONTEXT = 1100
SHAPES = {  # name: (queries per request, "short" or "spread" contexts)
    "16 decodes, short": ([1] * 16, "short"),
    "16 decodes, spread": ([1] * 16, "spread"),
    "16, 4 verifying k=1, spread": ([2] * 4 + [1] * 12, "spread"),
    "32 decodes, spread": ([1] * 32, "spread"),
    "32, 8 verifying k=1, spread": ([2] * 8 + [1] * 24, "spread"),
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args()


@contextmanager
def one_call() -> Iterator[None]:
    """The attention as it was: every decode and verification in one padded call."""
    grouped = attention.request_groups

    def single(q_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
        shared = [i for i, n in enumerate(q_lens) if n <= attention.SHARED_MAX_Q]
        alone = [[i] for i, n in enumerate(q_lens) if n > attention.SHARED_MAX_Q]
        return ([shared] if shared else []) + alone

    attention.request_groups = single
    try:
        yield
    finally:
        attention.request_groups = grouped


def allocate_tables(llm: LLM, count: int) -> list[list[int]]:
    """Block tables for `count` requests, shared by every shape (never freed: the process is the
    benchmark's, and the cache's contents do not change the time)."""
    tables = []
    for i in range(count):
        table: list[int] = []
        if not llm.engine.blocks.allocate(f"shape-{i}", table, MAX_CONTEXT + 16):
            raise RuntimeError("not enough KV blocks: raise kv_cache_memory_gb")
        tables.append(table)
    return tables


def forward_timer(llm: LLM, tables, queries: list[int], contexts: list[int], single: bool):
    """Seconds of one target forward over the shape."""
    chunks = [
        Chunk(list(range(100, 100 + q)), contexts[i], tables[i], num_logits=q)
        for i, q in enumerate(queries)
    ]
    forward = llm.engine.target.forward

    def run() -> float:
        if not single:
            return timed(lambda: forward(chunks))
        with one_call():
            return timed(lambda: forward(chunks))

    return run


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    llm = LLM(args.model, spec=SpecConfig(policy="off"), num_threads=args.threads,
              kv_cache_memory_gb=2.0)
    rng = random.Random(args.seed)
    spread = [rng.randint(150, MAX_CONTEXT) for _ in range(32)]
    tables = allocate_tables(llm, max(len(q) for q, _ in SHAPES.values()))
    runs = {}
    for name, (queries, contexts) in SHAPES.items():
        lens = [64] * len(queries) if contexts == "short" else spread[: len(queries)]
        for single in (True, False):
            runs[(name, single)] = forward_timer(llm, tables, queries, lens, single)
    times = interleaved(runs, args.repeats)
    rows = [[name, times[(name, True)] * 1e3, times[(name, False)] * 1e3,
             times[(name, True)] / times[(name, False)]] for name in SHAPES]
    print_table(f"Target forward ms, {args.threads} thread(s), median of {args.repeats}",
                ["step shape", "one call", "grouped", "speed-up"], rows)
    if args.json:
        records = [{"shape": r[0], "one_call_ms": r[1], "grouped_ms": r[2]} for r in rows]
        args.json.write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()
