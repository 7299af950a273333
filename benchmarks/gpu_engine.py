"""The GPU check's model sections: a model's forward time against the tokens in its batch (eager,
and CUDA graphs where they apply), graph-against-eager parity, and the engine's policies side by
side at a given concurrency."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from torch import nn

from faser import LLM, SamplingParams, SpecConfig
from faser.runner.batch import Chunk
from faser.runner.model_runner import ModelRunner, RunnerOptions

CONTEXT = 256  # cached tokens each timed request attends to
VERIFY_LEN = 5  # tokens a verification chunk feeds (k = 4)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_time(fn, device: str, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_runner(model: nn.Module, device: str, options: RunnerOptions | None = None,
                num_blocks: int = 64) -> ModelRunner:
    """A runner with its own small cache beside the engine's (the timed requests share one
    block table, as the cost profiler's do)."""
    return ModelRunner(model, num_blocks, 16, device, options or RunnerOptions())


def _table() -> list[int]:
    return list(range(1, -(-(CONTEXT + VERIFY_LEN) // 16) + 1))


def decode_chunks(n: int) -> list[Chunk]:
    return [Chunk([7], CONTEXT, _table(), 1)] * n


def verify_chunks(n: int) -> list[Chunk]:
    """n tokens as n / VERIFY_LEN verifications of k = VERIFY_LEN - 1 drafts each."""
    return [Chunk([7] * VERIFY_LEN, CONTEXT, _table(), VERIFY_LEN)] * max(1, n // VERIFY_LEN)


def forward_curve(runners: dict[str, ModelRunner], points: list[int], device: str,
                  reps: int) -> list[dict]:
    """ms of one forward for each runner at each batch size; `runners` maps a column name to
    (runner, shape) where shape is 'decode' or 'verify'."""
    rows = []
    for n in points:
        row: dict[str, object] = {"tokens": n}
        for name, (runner, shape) in runners.items():
            graphs = runner.graphs
            if (shape == "verify" and n < VERIFY_LEN) or (graphs and n > graphs.sizes[-1]):
                row[name] = None  # no such batch / no graph that large: not a graph's time
                continue
            chunks = decode_chunks(n) if shape == "decode" else verify_chunks(n)
            row[name] = _median_time(lambda r=runner, c=chunks: r.forward(c), device, reps) * 1e3
        rows.append(row)
    return rows


def graph_parity(model: nn.Module, device: str, sizes: list[int], max_batch: int) -> list[dict]:
    """Logits of the same decode step, eager and replayed from a CUDA graph (padded up to a
    captured size), after the same prefills in two caches."""
    eager = make_runner(model, device, num_blocks=4 * max(sizes) + 8)
    graphs = make_runner(model, device, RunnerOptions(
        cuda_graphs=True, max_graph_batch=max_batch, max_blocks_per_seq=8,
    ), num_blocks=4 * max(sizes) + 8)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        tables = [[1 + 4 * i + j for j in range(4)] for i in range(n)]
        ctx = torch.randint(8, 40, (n,), generator=gen).tolist()
        prompts = [torch.randint(0, 500, (c,), generator=gen).tolist() for c in ctx]
        prefill = [Chunk(p, 0, t, 1) for p, t in zip(prompts, tables, strict=True)]
        decode = [Chunk([3 + i], c, t, 1) for i, (c, t) in enumerate(zip(ctx, tables,
                                                                          strict=True))]
        for runner in (eager, graphs):
            runner.forward(prefill)
        want, got = eager.forward(decode), graphs.forward(decode)
        err = float((want - got).abs().max())
        scale = float(want.abs().max())
        agree = float((want.argmax(-1) == got.argmax(-1)).float().mean())
        rows.append({"batch": n, "max_abs_err": err, "max_logit": scale,
                     "argmax_agree": agree, "ok": err <= 5e-2 * max(1.0, scale)})
    return rows


# -- the engine ------------------------------------------------------------------------------


def build_llm(target: Path, draft: Path, device: str, dtype: str, max_seqs: int,
              max_len: int, profile_dir: Path, prompt_lookup: bool = True, **options) -> LLM:
    blocks_per_seq = -(-(max_len + 32) // 16)
    spec = SpecConfig(policy="faser", profile_cache_dir=str(profile_dir),
                      prompt_lookup=prompt_lookup)
    return LLM(
        str(target), draft_model=str(draft), device=device, dtype=dtype, spec=spec,
        block_size=16, num_kv_blocks=max_seqs * blocks_per_seq + 16, max_num_seqs=max_seqs,
        max_num_batched_tokens=max(2048, max_seqs), max_model_len=max_len,
        prefix_caching=False, **options,  # every policy's run sends the same prompts
    )


def engine_runs(llm: LLM, label: str, prompts: list[list[int]], concurrencies: list[int],
                policies: list[str], max_tokens: int) -> list[dict]:
    """Output tokens/s of each policy at each concurrency (all requests sent at once, greedy,
    ignore_eos), with acceptance figures; one warm-up per policy first."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    rows = []
    for c in concurrencies:
        batch = prompts[:c]
        tokens_off: list[list[int]] | None = None
        for policy in policies:
            llm.generate(batch, warm, speculation={"policy": policy})
            start = time.perf_counter()
            outputs = llm.generate(batch, params, speculation={"policy": policy})
            seconds = time.perf_counter() - start
            tokens = [o.token_ids for o in outputs]
            if policy == "off":
                tokens_off = tokens
            drafted = sum(o.spec_stats.num_draft_tokens for o in outputs)
            accepted = sum(o.spec_stats.num_accepted_tokens for o in outputs)
            rows.append({
                "models": label, "concurrency": c, "policy": policy,
                "seconds": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds,
                "ms_per_token": seconds / max_tokens * 1e3,
                "acceptance_rate": accepted / drafted if drafted else None,
                "mean_acceptance_length": statistics.mean(
                    o.spec_stats.mean_acceptance_length for o in outputs),
                "draft_tokens": drafted,
                "same_as_off": None if tokens_off is None else sum(
                    a == b for a, b in zip(tokens, tokens_off, strict=True)) / len(tokens),
                # the mode the faser controller ended in (the engine's own policy is faser)
                "mode": llm.engine.speculator.mode if policy == "faser" else None,
            })
    return rows
