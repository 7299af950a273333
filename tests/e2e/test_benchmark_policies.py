"""Smoke test of `python -m benchmarks.policies` on tiny random models: the records' fields, the
files it writes, and lossless output across policies. Timings are printed, never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.metrics import percentile
from benchmarks.policies import main, parse_policies, round_ratios
from benchmarks.step_prices import priced_rates, read_spans
from benchmarks.workload import encode_prompt, fit_prompt, load_prompts, read_trace, trace_arrivals
from tests.engine.tiny import make_checkpoint, make_noisy_copy

FIELDS = (
    "policy", "num_requests", "output_tokens_per_s", "mean_latency_s", "p99_latency_s",
    "mean_ttft_s", "mean_tpot_s", "mean_acceptance_length", "mean_k",
    "target_positions_computed", "slo_attainment",
)
TRACE = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:15:46.6805900,374,44\n"
    "2023-11-16 18:15:46.7805900,396,3\n"
    "2023-11-16 18:15:46.8805900,120,5\n"
)


@pytest.fixture(scope="module")
def bench_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bench")
    target = make_checkpoint(root / "target", "gqa_tied")
    prompts = root / "prompts.jsonl"
    lines = [
        {"question_id": 1, "category": "writing", "turns": ["Tell me about foxes.", "More."]},
        {"question_id": 2, "category": "math", "turns": ["What is 2 + 2?"]},
        {"question_id": 3, "category": "ids", "prompt_token_ids": [5, 6, 7, 8, 9]},
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    trace = root / "trace.csv"
    trace.write_text(TRACE)
    return {
        "target": target,
        "draft": make_noisy_copy(target, root / "draft", noise=0.12),
        "prompts": prompts,
        "trace": trace,
        "root": root,
    }


def test_two_policies_two_concurrencies_and_a_trace(bench_files, capsys):
    root = bench_files["root"]
    records = main([
        "--model", str(bench_files["target"]), "--draft-model", str(bench_files["draft"]),
        "--prompts", str(bench_files["prompts"]), "--num-prompts", "4", "--max-tokens", "8",
        "--concurrency", "1,2", "--policies", "off,fixed:3",
        "--trace", str(bench_files["trace"]), "--time-scale", "10", "--max-requests", "3",
        "--slo-tpot-ms", "10000", "--slo-ttft-ms", "10000",
        "--json", str(root / "out.json"), "--plots", str(root / "plots"),
        "--profile-cache", str(root / "profiles"), "--no-progress",
    ])
    printed = capsys.readouterr().out
    assert "fixed:3" in printed and "time scale 10" in printed

    assert json.loads((root / "out.json").read_text()) == records
    closed = [r for r in records if "concurrency" in r]
    opened = [r for r in records if "trace" in r]
    # interleaved by load level: every policy at C = 1, then every policy at C = 2
    assert [(r["policy"], r["concurrency"]) for r in closed] == [
        ("off", 1), ("fixed:3", 1), ("off", 2), ("fixed:3", 2)
    ]
    assert [r["policy"] for r in opened] == ["off", "fixed:3"]
    for r in records:
        assert all(field in r for field in FIELDS), r
        assert r["output_tokens_per_s"] > 0 and r["p99_latency_s"] >= r["mean_ttft_s"] > 0
        assert r["slo_attainment"] == 1.0  # targets far above anything a tiny model takes
        assert r["outputs_match_first_policy"] == 1.0  # lossless: greedy output never changes
    for r in closed:
        assert r["num_requests"] == 4 and r["num_output_tokens"] == 4 * 8
    # the trace asks for 44, 3 and 5 tokens, capped at 8 (ignore_eos in open loop)
    assert all(r["num_output_tokens"] == 8 + 3 + 5 for r in opened)
    assert opened[0]["time_scale"] == 10.0 and opened[0]["replay_span_s"] == pytest.approx(0.02)
    for r in (r for r in records if r["policy"] == "off"):
        assert r["mean_k"] == 0.0 and r["mean_acceptance_length"] == 1.0
    for r in (r for r in records if r["policy"] == "fixed:3"):
        assert 0.0 < r["mean_k"] <= 3.0 and 1.0 <= r["mean_acceptance_length"] <= 4.0
    assert (root / "plots" / "closed_loop.png").stat().st_size > 0
    assert (root / "plots" / "open_loop.png").stat().st_size > 0


def test_repeats_rotate_the_order_and_keep_each_policys_best_round(bench_files):
    root = bench_files["root"]
    records = main([
        "--model", str(bench_files["target"]), "--draft-model", str(bench_files["draft"]),
        "--prompts", str(bench_files["prompts"]), "--num-prompts", "3", "--max-tokens", "6",
        "--concurrency", "2", "--policies", "off,fixed:2,faser", "--repeats", "3",
        "--trace", str(bench_files["trace"]), "--time-scale", "10", "--max-requests", "3",
        "--profile-cache", str(root / "profiles"), "--no-progress",
    ])
    assert [r["policy"] for r in records] == ["off", "fixed:2", "faser"] * 2
    for r in records:
        rounds = r["rounds_output_tokens_per_s"]
        assert len(rounds) == 3 and len(r["rounds_mean_latency_s"]) == 3
        assert r["outputs_match_first_policy"] == 1.0  # whichever policy ran first that round
    closed, opened = records[:3], records[3:]
    assert all(r["output_tokens_per_s"] == max(r["rounds_output_tokens_per_s"]) for r in closed)
    assert all(r["mean_latency_s"] == min(r["rounds_mean_latency_s"]) for r in opened)


def test_sliced_rounds_share_out_the_prompts_and_pool_each_policy(bench_files):
    root = bench_files["root"]
    args = [
        "--model", str(bench_files["target"]), "--draft-model", str(bench_files["draft"]),
        "--prompts", str(bench_files["prompts"]), "--num-prompts", "3", "--max-tokens", "5",
        "--policies", "off,fixed:2", "--repeats", "2", "--sliced", "--ignore-eos",
        "--profile-cache", str(root / "profiles"), "--no-progress",
    ]
    records = main([*args, "--concurrency", "1"])
    assert [r["policy"] for r in records] == ["off", "fixed:2"]
    for r in records:
        # slices of 2 and 1 prompts: every prompt ran once, and each round has its own figure
        assert r["num_requests"] == 3 and r["num_output_tokens"] == 15
        assert len(r["rounds_output_tokens_per_s"]) == 2
        assert r["outputs_match_first_policy"] == 1.0
        assert r["output_tokens_per_s"] == pytest.approx(15 / r["wall_s"])
    off, fixed = records
    assert off["target_positions_computed"] < fixed["target_positions_computed"]
    with pytest.raises(ValueError, match="fewer than the concurrency 2"):
        main([*args, "--concurrency", "2"])


def test_step_trace_prices_every_policys_decoding_steps_over_all_its_rounds(bench_files, capsys):
    root = bench_files["root"]
    trace = root / "steps.jsonl"
    records = main([
        "--model", str(bench_files["target"]), "--draft-model", str(bench_files["draft"]),
        "--prompts", str(bench_files["prompts"]), "--num-prompts", "3", "--max-tokens", "6",
        "--concurrency", "1", "--policies", "off,fixed:2,faser", "--repeats", "2",
        "--ignore-eos", "--step-trace", str(trace),
        "--profile-cache", str(root / "profiles"), "--no-progress",
    ])
    assert "C = 1: decode tok/s at each step shape's median, off " in capsys.readouterr().out
    for r in records:
        spans = r["step_trace_spans"]
        assert len(spans) == 2  # both rounds, not only the best
        steps = read_spans(trace, spans)
        assert {s["policy"] for s in steps} == {r["policy"].partition(":")[0]}
        # every output token but each request's first (its prefill's) comes from a decoding step
        assert [n for _, _, n in spans] == [r["num_output_tokens"] - r["num_requests"]] * 2
        committed = sum(1 + sum(s["realised_accepted"]) for s in steps)
        assert committed >= 2 * (r["num_output_tokens"] - r["num_requests"])
        assert r["priced_decode_tokens_per_s"] > 0
    off, fixed, _ = records
    off_steps = read_spans(trace, off["step_trace_spans"])
    assert len(off_steps) == 2 * (off["num_output_tokens"] - off["num_requests"])
    assert {len(s["k"]) for s in off_steps} == {1}  # one request at a time, never a draft
    assert max(sum(s["k"]) for s in read_spans(trace, fixed["step_trace_spans"])) == 2


def test_priced_rates_charge_each_shape_its_median_over_every_run():
    def step(ks, seconds, accepted, prefill=0):
        return {"k": ks, "measured_time_s": seconds, "realised_accepted": accepted,
                "prefill_tokens": prefill, "frontier_size": None}

    runs = {
        # off met a slow moment: its plain steps took 3 s where fixed's took 1 s
        "off": [step([0], 3.0, [0]), step([0], 3.0, [0])],
        "fixed:1": [step([1], 2.0, [1]), step([0], 1.0, [0]), step([1], 2.0, [0])],
        "faser": [step([1], 2.0, [1]), step([0, 0], 5.0, [0, 0], prefill=7)],
    }
    rates = priced_rates(runs, {"off": 2, "fixed:1": 4, "faser": 3})
    # plain steps at the median of 3, 3 and 1 s; a draft token's at the median of its three
    assert rates["off"] == pytest.approx(2 / 6.0)
    assert rates["fixed:1"] == pytest.approx(4 / (2.0 + 3.0 + 2.0))
    assert rates["faser"] == pytest.approx(3 / (2.0 + 5.0))


def test_seeded_samples_are_held_to_the_first_policys_and_unseeded_ones_are_not(bench_files,
                                                                                 capsys):
    root = bench_files["root"]
    args = [
        "--model", str(bench_files["target"]), "--draft-model", str(bench_files["draft"]),
        "--prompts", str(bench_files["prompts"]), "--num-prompts", "3", "--max-tokens", "6",
        "--concurrency", "2", "--policies", "off,fixed:2",
        "--profile-cache", str(root / "profiles"), "--no-progress",
    ]
    records = main([*args, "--temperature", "1.0"])
    assert "temperature 1," in capsys.readouterr().out
    assert [r["policy"] for r in records] == ["off", "fixed:2"]
    for r in records:  # a seed's races: speculation never changes the answer
        assert r["temperature"] == 1.0 and r["seeded"]
        assert r["outputs_match_first_policy"] == 1.0
        assert r["num_output_tokens"] == 3 * 6
    assert records[1]["mean_k"] > 0
    both = main([*args, "--temperature", "1.0", "--sampling", "both"])
    assert "temperature 1, both," in capsys.readouterr().out
    assert [r["policy"] for r in both] == ["off", "fixed:2", "off unseeded", "fixed:2 unseeded"]
    assert all(r["outputs_match_first_policy"] == 1.0 for r in both[:2])
    assert all(not r["seeded"] and "outputs_match_first_policy" not in r for r in both[2:])
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        main([*args, "--temperature", "-0.5"])


def test_round_ratios_hold_faser_against_the_best_other_policy_of_each_round():
    def closed(policy, tok_s):
        return {"policy": policy, "concurrency": 4, "rounds_output_tokens_per_s": tok_s,
                "rounds_mean_latency_s": [1.0] * len(tok_s)}

    def opened(policy, latency_s):
        return {"policy": policy, "concurrency": None, "trace": "conv.csv", "time_scale": 4.0,
                "rounds_output_tokens_per_s": [1.0] * len(latency_s),
                "rounds_mean_latency_s": latency_s}

    records = [
        closed("off", [100.0, 90.0, 80.0]), closed("fixed:1", [110.0, 80.0, 70.0]),
        closed("faser", [99.0, 99.0, 72.0]),
        opened("off", [2.0, 3.0]), opened("faser", [2.5, 2.0]), opened("faser-noprune", [1.0, 1.0]),
    ]
    assert round_ratios(records) == [
        "C = 4: tok/s, faser / best other, per round 0.900, 1.100, 0.900; median 0.900",
        "conv.csv x4.0: mean latency, best other / faser, per round 0.800, 1.500; median 1.150",
    ]
    assert round_ratios([closed("off", [1.0]), closed("fixed:1", [2.0])]) == []


def test_prompts_encode_without_a_tokenizer(bench_files):
    prompts = load_prompts(bench_files["prompts"], 5)
    assert [p.question_id for p in prompts] == [1, 2, 3, 1, 2]  # cycled
    assert encode_prompt(prompts[1], None, 97) == [b % 97 for b in b"What is 2 + 2?"]
    assert encode_prompt(prompts[2], None, 97) == [5, 6, 7, 8, 9]
    assert fit_prompt(list(range(10)), max_tokens=4, max_model_len=10) == [4, 5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="max_tokens"):
        fit_prompt([1], max_tokens=10, max_model_len=10)


def test_trace_arrivals_scale_and_cap(bench_files):
    arrivals = trace_arrivals(read_trace(bench_files["trace"]), 0.5, 2, 8)
    assert [a.offset_s for a in arrivals] == pytest.approx([0.0, 0.2])
    assert [a.max_tokens for a in arrivals] == [8, 3]
    with pytest.raises(ValueError, match="time_scale"):
        trace_arrivals([(0.0, 1, 1)], 0.0, 1, 8)


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="policy"):
        parse_policies("off,nonsense")
    assert parse_policies("fixed:2,faser")[0].spec == {"policy": "fixed", "max_k": 2}
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
