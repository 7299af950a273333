"""Speculation policies side by side: same models, prompts and machine, one process.

    python -m benchmarks.policies --model M --draft-model D --num-prompts 16 --max-tokens 64 \
        --concurrency 1,4,16,32 --policies off,fixed:4,dsd,heuristic,faser \
        --json out.json --plots out/

    python -m benchmarks.policies ... --trace conv --time-scale 0.02 --max-requests 32

Closed loop (`--concurrency`): C requests in flight, refilled as they finish, until all
`--num-prompts` are done. Open loop (`--trace`): requests arrive at their Azure trace times divided
by `--time-scale` (a list gives one load level each), asking for GeneratedTokens capped by
`--max-tokens`; the prompt is Spec-Bench's (the trace has no text). With `--trace` only the open
loop runs unless `--concurrency` is also given.

One engine serves every policy: the models load once and each request carries its policy
(`add_request(..., speculation={"policy", "max_k"})`). The engine keeps one policy object per
name, so each faser variant has its own mode controller; its state carries over from one load level
to the next. Runs are interleaved by load level (every
policy at C = 1, then every policy at C = 4, ...) so that machine noise hits all alike, after one
untimed warm-up request per policy (which also measures or loads the cost profile).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.common import DEFAULT_PROMPTS
from benchmarks.driver import RunResult, RunSpec, run_closed, run_open
from benchmarks.metrics import summarise
from benchmarks.step_prices import count_lines, priced_rates, read_spans
from benchmarks.table import format_table
from benchmarks.workload import (
    BenchRequest,
    closed_requests,
    encode_prompt,
    fit_prompt,
    load_prompts,
    open_requests,
    read_trace,
    trace_arrivals,
)
from faser.config import POLICIES, EngineConfig, SpecConfig, parse_policy
from faser.engine.llm_engine import LLMEngine
from faser.slo import Slo

DEFAULT_POLICIES = ",".join(("off", "fixed:4", *POLICIES[2:]))
SAMPLINGS = ("seeded", "unseeded", "both")
TRACES_DIR = Path(__file__).resolve().parents[2] / "shared" / "traces"
TRACE_NAMES = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}
WARMUP_TOKENS = 8


@dataclass(frozen=True, slots=True)
class PolicyArg:
    label: str  # as given on the command line, e.g. "fixed:4"; "<label> unseeded" for the twin
    spec: dict  # the per-request override
    seeded: bool = True  # sampled requests carry seeds (races) or not (rejection sampling)


@dataclass(frozen=True, slots=True)
class Level:
    """One load level: every policy runs these requests."""

    fields: dict  # what the records say about the load: concurrency, or trace and time_scale
    requests: list[BenchRequest]
    concurrency: int | None  # None: open loop


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.policies", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target (default: the embedded default)")
    p.add_argument("--draft-model", default=None, help="draft (default: the embedded default)")
    p.add_argument("--prompts", default=None, help=f"Spec-Bench JSON lines ({DEFAULT_PROMPTS})")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64, help="output length (cap, open loop)")
    p.add_argument("--concurrency", default=None, help="closed-loop levels (default 1,4,16,32)")
    p.add_argument("--trace", default=None, help="Azure trace CSV, or `conv` / `code`")
    p.add_argument("--time-scale", default="1.0", help="replay offset = trace offset / S; a list")
    p.add_argument("--max-requests", type=int, default=32, help="trace rows replayed")
    p.add_argument("--policies", default=DEFAULT_POLICIES)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument("--plots", default=None, help="write PNG figures into this directory")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--lane-threads", default=None,
                   help="T,D: threads of the target and draft lanes (overlap mode on a CPU); "
                        "default: the engine splits --threads (no lanes with one thread)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds per load level, the policies' order rotated each round; each "
                        "policy reports its best round (noise only ever slows a run down): "
                        "most tokens/s in closed loop, lowest mean latency on a trace")
    p.add_argument("--sliced", action="store_true",
                   help="closed loop: each round runs its own slice of the prompts (round r the "
                        "r-th of --repeats), every policy the same slice, and each policy's "
                        "figures pool its rounds: short rounds keep the host's drift between "
                        "one round's policies small, and every policy runs every prompt once")
    p.add_argument("--ignore-eos", action="store_true", help="closed loop: always max_tokens")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; above 0 request i is sampled with seed i, a race at each "
                        "position that speculation cannot move (faser.layers.race). Either way "
                        "every policy's output must equal the first's")
    p.add_argument("--sampling", choices=SAMPLINGS, default="seeded",
                   help="above temperature 0: `unseeded` requests carry no seed (rejection "
                        "sampling, which keeps the target's distribution, not plain sampling's "
                        "draws: no output check); `both` runs every policy both ways, the "
                        "unseeded twin labelled '<policy> unseeded'")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--weight-format", default=EngineConfig().weight_format,
                   help="auto, dense or packed")
    p.add_argument("--draft-weights", default=EngineConfig().draft_weights,
                   help="auto, same or int8 (the draft's weights)")
    p.add_argument("--profile-cache", default=None, help="cost profile cache directory")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--step-trace", default=None,
                   help="write every step's decisions here (JSON lines; all policies and levels), "
                        "and print each policy's decisions priced per step shape "
                        "(benchmarks.step_prices)")
    return p.parse_args(argv)


def with_sampling(policies: list[PolicyArg], sampling: str) -> list[PolicyArg]:
    """The policies as `--sampling` runs them: seeded, unseeded, or each both ways."""
    unseeded = [PolicyArg(f"{p.label} unseeded" if sampling == "both" else p.label, p.spec,
                          seeded=False) for p in policies]
    return {"seeded": policies, "unseeded": unseeded, "both": policies + unseeded}[sampling]


def parse_policies(text: str) -> list[PolicyArg]:
    """'off,fixed:4,faser' -> per-request overrides; a bare name keeps the engine's k cap."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, k = parse_policy(item, SpecConfig().num_speculative_tokens)
        spec = {"policy": name, "max_k": k} if ":" in item else {"policy": name}
        out.append(PolicyArg(item, spec))
    if not out:
        raise ValueError("policies: give at least one policy")
    if len({p.label for p in out}) != len(out):
        raise ValueError(f"policies: listed twice in {text!r}")
    return out


def parse_list(text: str, kind: type, field: str) -> list:
    try:
        values = [kind(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{field}: expected a comma-separated list, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{field}: values must be > 0, got {text!r}")
    return values


def trace_file(name: str) -> Path:
    return TRACES_DIR / TRACE_NAMES[name] if name in TRACE_NAMES else Path(name)


def build_engine(args: argparse.Namespace, max_concurrency: int) -> LLMEngine:
    spec = SpecConfig(policy="off", profile_cache_dir=args.profile_cache,
                      trace_path=args.step_trace)
    config = EngineConfig(
        model=args.model, draft_model=args.draft_model, spec=spec, device=args.device,
        dtype=args.dtype, weight_format=args.weight_format, draft_weights=args.draft_weights,
        num_threads=args.threads,
        lane_threads=_lane_threads(args.lane_threads), seed=args.seed,
        max_num_seqs=max(64, max_concurrency),
        max_num_batched_tokens=max(512, max_concurrency),
        # every round and policy sends the same prompts: a prefix cache would prefill them once
        # and hand the first round's cost to whichever policy ran it
        prefix_caching=False,
    )
    return LLMEngine(config)


def _lane_threads(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    values = parse_list(text, int, "lane_threads")
    if len(values) != 2:
        raise ValueError(f"lane_threads: expected T,D (target and draft threads), got {text!r}")
    return values[0], values[1]


def build_levels(args: argparse.Namespace, prompt_ids: list[list[int]]) -> list[Level]:
    levels = []
    if args.concurrency is not None or args.trace is None:
        requests = closed_requests(prompt_ids, args.max_tokens)
        for c in parse_list(args.concurrency or "1,4,16,32", int, "concurrency"):
            levels.append(Level({"concurrency": c}, requests, c))
    if args.trace is not None:
        path = trace_file(args.trace)
        rows = read_trace(path)
        for scale in parse_list(args.time_scale, float, "time_scale"):
            arrivals = trace_arrivals(rows, scale, args.max_requests, args.max_tokens)
            fields = {"trace": path.name, "time_scale": scale, "max_requests": len(arrivals),
                      "replay_span_s": arrivals[-1].offset_s}
            levels.append(Level(fields, open_requests(prompt_ids, arrivals), None))
    return levels


def engine_slo_kwargs(engine: LLMEngine, slo: Slo | None) -> dict:
    """The SLO as an add_request argument when the engine takes one; else attainment is only
    measured here."""
    if slo is None or "slo" not in inspect.signature(engine.add_request).parameters:
        return {}
    return {"slo": slo.as_ms()}


def mode_steps(engine: LLMEngine, policy: str) -> dict[str, int]:
    """Steps the policy's mode controller has spent in each mode so far (faser family only)."""
    instance = engine.speculator._policies.get(policy)  # read only: never creates one
    controller = getattr(instance, "controller", None)
    return dict(controller.steps_in_mode) if controller is not None else {}


def run_level(engine: LLMEngine, level: Level, run: RunSpec, bar: tqdm) -> RunResult:
    if level.concurrency is None:
        return run_open(engine, level.requests, run, on_finish=lambda: bar.update(1))
    return run_closed(engine, level.requests, level.concurrency, run, lambda: bar.update(1))


def warm_up(engine: LLMEngine, policies: list[PolicyArg], prompt: list[int]) -> None:
    """One short untimed request per policy: first-call costs and the cost profile."""
    request = [BenchRequest(tuple(prompt), WARMUP_TOKENS)]
    for p in policies:
        run_closed(engine, request, 1, RunSpec(f"warmup-{p.label}", p.spec, ignore_eos=True))


@dataclass(frozen=True, slots=True)
class Bench:
    """Everything a benchmark run needs, prepared before any timing starts."""

    engine: LLMEngine
    policies: list[PolicyArg]
    levels: list[Level]
    slo: Slo | None
    slo_kwargs: dict  # passed to add_request (empty when the engine takes no SLO)


def prepare(args: argparse.Namespace) -> Bench:
    policies = parse_policies(args.policies)
    if args.temperature > 0:
        policies = with_sampling(policies, args.sampling)
    slo = Slo.parse({"tpot_ms": args.slo_tpot_ms, "ttft_ms": args.slo_ttft_ms})
    if args.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {args.max_tokens}")
    if args.repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {args.repeats}")
    if not args.temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {args.temperature}")
    torch.manual_seed(args.seed)
    max_c = max(parse_list(args.concurrency, int, "concurrency")) if args.concurrency else 32
    engine = build_engine(args, max_c)
    vocab = engine.pair.target.config.vocab_size
    prompt_ids = [
        fit_prompt(encode_prompt(p, engine.tokenizer, vocab), args.max_tokens, engine.max_model_len)
        for p in load_prompts(args.prompts, args.num_prompts)
    ]
    levels = build_levels(args, prompt_ids)
    warm_up(engine, policies, prompt_ids[0])
    return Bench(engine, policies, levels, slo, engine_slo_kwargs(engine, slo))


def benchmark(args: argparse.Namespace) -> list[dict]:
    bench = prepare(args)
    rounds = 1 if args.sliced else args.repeats  # sliced rounds share out the requests
    total = sum(len(level.requests) for level in bench.levels) * len(bench.policies) * rounds
    records: list[dict] = []
    with tqdm(total=total, desc="requests", disable=args.no_progress, file=sys.stderr) as bar:
        for n, level in enumerate(bench.levels):
            records += run_policies(bench, args, n, level, bar)
    return records


def run_policies(bench: Bench, args, n: int, level: Level, bar: tqdm) -> list[dict]:
    """Every policy at one load level, `args.repeats` rounds, each starting one policy later (a
    burst of load on the shared machine, or whatever one engine's earlier runs leave behind,
    then hits no policy in every round); each policy keeps its best round, or with --sliced
    pools its rounds, each over its own slice of the prompts."""
    if args.sliced:
        rounds = [run_round(bench, args, n, part, bar, r)
                  for r, part in enumerate(slice_level(level, args.repeats))]
        return [_pooled([r[i] for r in rounds], bench.slo) for i in range(len(bench.policies))]
    rounds = [run_round(bench, args, n, level, bar, r) for r in range(args.repeats)]
    return [_best_round([r[i][0] for r in rounds]) for i in range(len(bench.policies))]


def slice_level(level: Level, num_rounds: int) -> list[Level]:
    """The level's requests in `num_rounds` contiguous slices of about equal size, each a level
    of its own; a closed loop's slices must each fill its concurrency."""
    if level.concurrency is None:
        raise ValueError("--sliced takes a closed loop (--concurrency), not a trace")
    size, extra = divmod(len(level.requests), num_rounds)
    if size < level.concurrency:
        raise ValueError(
            f"--sliced: {len(level.requests)} prompts in {num_rounds} rounds leave slices of "
            f"{size}, fewer than the concurrency {level.concurrency}; raise --num-prompts")
    bounds = [r * size + min(r, extra) for r in range(num_rounds + 1)]
    return [replace(level, requests=level.requests[a:b]) for a, b in itertools.pairwise(bounds)]


def _pooled(rounds: list[tuple[dict, RunResult]], slo: Slo | None) -> dict:
    """One policy's rounds over their slices as one run: the figures of all its requests and the
    time of all its rounds, and each round's own tokens/s and mean latency."""
    records = [record for record, _ in rounds]
    results = [result for _, result in rounds]
    pooled = RunResult(
        [o for r in results for o in r.outputs], sum(r.wall_s for r in results),
        sum(r.target_positions_computed for r in results),
        sum(r.draft_positions_computed for r in results),
    )
    record = {**records[0], **summarise(pooled, slo)}
    if "outputs_match_first_policy" in record:  # greedy: each round held to its first policy
        record["outputs_match_first_policy"] = sum(
            r["outputs_match_first_policy"] * r["num_requests"] for r in records
        ) / len(pooled.outputs)
    modes = [r.get("mode_steps", {}) for r in records]
    if any(modes):
        record["mode_steps"] = dict(sum((Counter(m) for m in modes), Counter()))
    record["rounds_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in records]
    record["rounds_mean_latency_s"] = [r["mean_latency_s"] for r in records]
    record["sliced"] = True
    return _with_every_rounds_steps(record, records)


def _best_round(records: list[dict]) -> dict:
    """Closed loop: the round of most output tokens/s; open loop (arrivals fix the throughput):
    the round of the lowest mean latency."""
    if records[0].get("concurrency") is None:
        best = dict(min(records, key=lambda r: r["mean_latency_s"]))
    else:
        best = dict(max(records, key=lambda r: r["output_tokens_per_s"]))
    if len(records) > 1:
        best["rounds_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in records]
        best["rounds_mean_latency_s"] = [r["mean_latency_s"] for r in records]
    return _with_every_rounds_steps(best, records)


def _with_every_rounds_steps(record: dict, rounds: list[dict]) -> dict:
    """The record with the decision-trace spans of all its policy's rounds, not only its own."""
    if "step_trace_spans" in record:
        record["step_trace_spans"] = [span for r in rounds for span in r["step_trace_spans"]]
    return record


def priced_ratios(records: Sequence[dict], trace: str | Path) -> list[str]:
    """Per load level, each policy's decoding steps over all its rounds priced at their shapes'
    medians (benchmarks.step_prices), stored in its record, and faser's over the best other's."""
    lines = []
    for level in _levels(records):
        runs = [r for r in records if _level_key(r) == level and "step_trace_spans" in r]
        steps = {r["policy"]: read_spans(trace, r["step_trace_spans"]) for r in runs}
        tokens = {r["policy"]: sum(span[2] for span in r["step_trace_spans"]) for r in runs}
        rates = priced_rates(steps, tokens)
        for r in runs:
            r["priced_decode_tokens_per_s"] = rates[r["policy"]]
        shown = ", ".join(f"{name} {rate:.1f}" for name, rate in rates.items())
        line = f"{_level_name(runs[0])}: decode tok/s at each step shape's median, {shown}"
        others = [v for name, v in rates.items()
                  if not name.startswith("faser") and not name.endswith(" unseeded")]
        if "faser" in rates and others and max(others) > 0:
            line += f"; faser / best other {rates['faser'] / max(others):.3f}"
        lines.append(line)
    return lines


def round_ratios(records: Sequence[dict]) -> list[str]:
    """Per load level, faser's figure over the best other policy's in each round, and their
    median: policies of one round ran minutes apart, so the ratio escapes most of the host's
    drift between rounds, which each policy's best round does not (the first policy of a round
    that met a fast moment wins the table)."""
    lines = []
    for level in _levels(records):
        runs = [r for r in records if _level_key(r) == level and "rounds_output_tokens_per_s" in r]
        ours = [r for r in runs if r["policy"] == "faser"]
        # seeded against seeded: an unseeded twin samples another way
        others = [r for r in runs if not r["policy"].startswith("faser")
                  and r.get("seeded", True) == ours[0].get("seeded", True)] if ours else []
        if not ours or not others:
            continue
        ratios = [_round_ratio(ours[0], others, j)
                  for j in range(len(ours[0]["rounds_output_tokens_per_s"]))]
        what = ("mean latency, best other / faser" if level[0] is None
                else "tok/s, faser / best other")
        shown = ", ".join(f"{x:.3f}" for x in ratios)
        lines.append(f"{_level_name(ours[0])}: {what}, per round {shown}; "
                     f"median {statistics.median(ratios):.3f}")
    return lines


def _round_ratio(ours: dict, others: list[dict], j: int) -> float:
    if ours.get("concurrency") is None:  # open loop: lower latency is better
        return min(r["rounds_mean_latency_s"][j] for r in others) / ours["rounds_mean_latency_s"][j]
    return ours["rounds_output_tokens_per_s"][j] / max(
        r["rounds_output_tokens_per_s"][j] for r in others)


def _level_key(record: dict) -> tuple:
    return record.get("concurrency"), record.get("trace"), record.get("time_scale")


def _levels(records: Sequence[dict]) -> list[tuple]:
    return list(dict.fromkeys(_level_key(r) for r in records))


def _level_name(record: dict) -> str:
    if record.get("concurrency") is not None:
        return f"C = {record['concurrency']}"
    return f"{record['trace']} x{record['time_scale']}"


def run_round(bench: Bench, args, n: int, level: Level, bar: tqdm,
              shift: int) -> list[tuple[dict, RunResult]]:
    """Every policy once, starting with policy `shift`; (record, run) in the policies' own order.
    The first greedy or seeded run's outputs are the reference every other such run must match."""
    count = len(bench.policies)
    order = [(shift + j) % count for j in range(count)]
    records: dict[int, tuple[dict, RunResult]] = {}
    reference: list[list[int]] | None = None
    for i in order:
        p = bench.policies[i]
        ignore_eos = args.ignore_eos or level.concurrency is None
        run = RunSpec(f"L{n}-R{shift}-{p.label}", p.spec, ignore_eos, bench.slo_kwargs,
                      args.temperature, p.seeded)
        before = mode_steps(bench.engine, p.spec["policy"])
        first_step = count_lines(args.step_trace) if args.step_trace else 0
        result = run_level(bench.engine, level, run, bar)
        modes = _delta(before, mode_steps(bench.engine, p.spec["policy"]))
        record = {"policy": p.label, **level.fields, "max_tokens": args.max_tokens}
        record.update(summarise(result, bench.slo))
        if args.temperature > 0:
            record["temperature"] = args.temperature
            record["seeded"] = p.seeded
        if args.temperature == 0 or p.seeded:
            reference = reference or [o.token_ids for o in result.outputs]
            matches = [o.token_ids == ref
                       for o, ref in zip(result.outputs, reference, strict=True)]
            # greedy or seeded output is plain decoding's whatever the policy: every run must
            # match the first
            record["outputs_match_first_policy"] = sum(matches) / len(matches)
        if modes:
            record["mode_steps"] = modes
        if args.step_trace:  # this run's lines of the decision trace, and what its steps made
            decode_tokens = record["num_output_tokens"] - record["num_requests"]
            record["step_trace_spans"] = [[first_step, count_lines(args.step_trace), decode_tokens]]
        if bench.slo is not None:
            record.update(slo_tpot_ms=args.slo_tpot_ms, slo_ttft_ms=args.slo_ttft_ms,
                          slo_passed_to_engine=bool(bench.slo_kwargs))
        records[i] = record, result
    return [records[i] for i in range(len(bench.policies))]


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {mode: n - before.get(mode, 0) for mode, n in after.items() if n - before.get(mode, 0)}


def describe(args: argparse.Namespace) -> str:
    lines = [
        f"target {args.model or 'default (smollm2-135m-instruct)'}, "
        f"draft {args.draft_model or 'default'}, {args.device} {args.dtype} "
        f"({args.weight_format} weights, draft {args.draft_weights}), "
        f"{args.threads} torch thread(s), lanes {args.lane_threads or 'default'}, "
        f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature:g}'}"
        f"{f', {args.sampling}' if args.temperature > 0 else ''}, "
        f"seed {args.seed}",
        f"prompts {args.prompts or DEFAULT_PROMPTS} (first {args.num_prompts}, first turn, chat "
        f"template), max_tokens {args.max_tokens}",
    ]
    if args.trace is not None:
        lines.append(
            f"open loop: trace {trace_file(args.trace)}, time scale {args.time_scale} (replay "
            f"offset = trace offset / scale), first {args.max_requests} rows, GeneratedTokens "
            f"capped at {args.max_tokens}, ignore_eos"
        )
    if args.sliced:
        lines.append(f"sliced: {args.repeats} rounds, each over its own slice of the prompts; "
                     f"each policy's figures pool its rounds")
    if args.slo_tpot_ms is not None or args.slo_ttft_ms is not None:
        lines.append(f"SLO: TPOT <= {args.slo_tpot_ms} ms, TTFT <= {args.slo_ttft_ms} ms")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    records = benchmark(args)
    print(describe(args))
    print(format_table(records))
    for line in round_ratios(records):
        print(line)
    if args.step_trace:
        for line in priced_ratios(records, args.step_trace):
            print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(records, indent=1))
    if args.plots:
        from benchmarks.plots import plot_records

        for path in plot_records(records, args.plots, title=describe(args).splitlines()[0]):
            print(f"wrote {path}")
    return records


if __name__ == "__main__":
    main()
