"""SLOs through the engine on tiny models: validation, lossless output under tight and loose
targets, whether each request met its targets, the engine's counts and the decision trace."""

from __future__ import annotations

import pytest

from faser import LLM, SamplingParams, SpecConfig
from faser.spec_decode.trace import read_trace
from tests.spec_decode.spec_profiles import roofline

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 30)), [60] * 9]
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def engine(models, tmp_path=None, policy="faser"):
    trace = str(tmp_path / "trace.jsonl") if tmp_path is not None else None
    llm = LLM(
        str(models["gqa_tied"]), draft_model=str(models["gqa_tied_draft"]),
        spec=SpecConfig(policy=policy, trace_path=trace, profile_cache_dir=_cache(tmp_path)),
        num_kv_blocks=96, block_size=4, num_threads=1, dtype="float32",
    )
    # a GPU-shaped profile, so that faser speculates (on these tiny CPU models it would not)
    llm.engine.speculator.use_cost_profile(roofline())
    return llm.engine


def _cache(tmp_path):
    return str(tmp_path / "profiles") if tmp_path is not None else None


def run(eng, slos: list[dict | None]) -> list:
    ids = [
        eng.add_request(None, prompt, GREEDY, slo=slo)
        for prompt, slo in zip(PROMPTS, slos, strict=True)
    ]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


@pytest.mark.parametrize(
    ("slo", "field"),
    [({"tpot_ms": 0}, "tpot_ms"), ({"ttft_ms": "1"}, "ttft_ms"), ({"tpot": 5}, "tpot")],
)
def test_bad_slo_is_refused_before_the_request_runs(tiny_models, slo, field):
    eng = engine(tiny_models, policy="off")
    with pytest.raises(ValueError, match=field):
        eng.add_request(None, PROMPTS[0], GREEDY, slo=slo)
    assert not eng.has_unfinished_requests()


def test_tight_and_loose_slos_stay_lossless_and_report_attainment(
    tiny_models, hf_greedy, tmp_path
):
    eng = engine(tiny_models, tmp_path)
    impossible = {"tpot_ms": 1e-3, "ttft_ms": 1e-3}  # a microsecond: never met
    generous = {"tpot_ms": 1e6, "ttft_ms": 1e6}  # 17 minutes: always met
    outputs = run(eng, [impossible, generous, None, {"tpot_ms": 1e-3}])
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy("gqa_tied", prompt, MAX_TOKENS)
    assert [o.spec_stats.slo_met for o in outputs] == [False, True, None, False]
    assert (eng.stats.num_slo_requests, eng.stats.num_slo_met) == (3, 1)
    assert eng.num_free_blocks == eng.num_total_blocks

    records = read_trace(tmp_path / "trace.jsonl")
    slo_steps = [r for r in records if "slo_met_predicted" in r]
    assert slo_steps, "steps with SLO requests must say whether the plan keeps their limits"
    assert all(isinstance(r["slo_met_predicted"], bool) for r in slo_steps if r["mode"] != "off")
    assert eng.stats.num_draft_tokens > 0  # it did speculate


def test_without_slos_the_trace_has_no_slo_fields(tiny_models, tmp_path):
    eng = engine(tiny_models, tmp_path)
    outputs = run(eng, [None] * len(PROMPTS))
    assert all(o.spec_stats.slo_met is None for o in outputs)
    assert eng.stats.num_slo_requests == 0
    assert not any(k.startswith("slo_") for r in read_trace(tmp_path / "trace.jsonl") for k in r)


def test_baseline_policies_report_attainment_too(tiny_models, hf_greedy):
    eng = engine(tiny_models, policy="fixed:3")
    outputs = run(eng, [{"ttft_ms": 1e6}] * len(PROMPTS))
    assert all(o.spec_stats.slo_met is True for o in outputs)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy("gqa_tied", prompt, MAX_TOKENS)


def test_the_trace_names_the_mode_of_the_policy_the_requests_ran(tiny_models, tmp_path):
    """The benchmark runs every policy on one engine whose own policy is off; the trace must give
    the mode the requests' policy chose, not the engine policy's (which planned no step)."""
    eng = engine(tiny_models, tmp_path, policy="off")
    eng.speculator.use_cost_profile(roofline())
    for prompt in PROMPTS:
        eng.add_request(None, prompt, GREEDY, speculation={"policy": "faser"})
    while eng.has_unfinished_requests():
        eng.step()
    records = read_trace(tmp_path / "trace.jsonl")
    assert records and all(r["policy"] == "faser" for r in records)
    assert any(r["mode"] != "off" for r in records)
    assert all(r["mode"] != "off" for r in records if any(r["k"]))


def test_an_engine_that_cannot_overlap_never_plans_an_overlapped_step(tiny_models, tmp_path):
    """One thread, so no lanes: the controller must price every step as sequential."""
    eng = engine(tiny_models, tmp_path)
    assert eng.speculator.overlap is None
    run(eng, [None] * len(PROMPTS))
    modes = {r["mode"] for r in read_trace(tmp_path / "trace.jsonl")}
    assert modes and "overlap" not in modes
    assert eng.speculator.policy("faser").controller.can_overlap is False


def test_a_busy_fleet_caps_k_through_the_engine(tiny_models, hf_greedy, tmp_path):
    """The router's signal reaches each step's plan: k at most half its cap while busy."""
    planned = {}
    for cluster_load in (0.0, 1.0):
        eng = engine(tiny_models, tmp_path / str(cluster_load))
        # the drafting scale learns what this host's draft forward costs, and no plain step
        # corrects the target's: a target step of 0.1 s makes the whole cap pay at idle on any
        # host, so that only the busy cap can shorten k
        eng.speculator.use_cost_profile(roofline(flat_s=0.1))
        eng.set_cluster_load(cluster_load)
        outputs = run(eng, [None] * len(PROMPTS))
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            assert out.token_ids == hf_greedy("gqa_tied", prompt, MAX_TOKENS)
        records = read_trace(tmp_path / str(cluster_load) / "trace.jsonl")
        assert {r["cluster_load"] for r in records} == {cluster_load}
        planned[cluster_load] = max(k for r in records for k in r["planned_k"])
    max_k = eng.config.spec.max_k
    assert planned[0.0] > -(-max_k // 2) >= planned[1.0] > 0
