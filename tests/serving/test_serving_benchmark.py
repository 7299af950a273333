"""Smoke test of `python -m benchmarks.serving` against an in-process HTTP server (uvicorn on a
thread, the OpenAI app over a LocalEngineClient, no Ray) on tiny random-weight models: the
records' counts and fields, the printed header and tables, the JSON. Timings are printed, never
asserted."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from benchmarks import cpu
from benchmarks.common import DEFAULT_PROMPTS
from benchmarks.serving import (
    OFFLINE,
    OFFLINE_APP_UP,
    OURS,
    Load,
    Offline,
    drive,
    main,
    make_target,
    measure,
    parse_app_args,
    parse_args,
    random_texts,
    report,
    round_conversations,
    round_texts,
    settings,
    spec_bench_conversations,
    summarise,
)
from tests.fixtures.local_app import serve_over_http

MAX_TOKENS = 6
TEXTS = ["Tell me about foxes.", "What is 2 + 2?", "Hello, world!"]


@pytest.fixture(scope="module")
def server_url(local_app):
    yield from serve_over_http(local_app)


def check_records(records, num: int, concurrency: int) -> None:
    assert sorted(r.index for r in records) == list(range(num))
    for r in records:
        assert r.ok, r.error
        assert r.server == OURS and r.concurrency == concurrency
        assert r.output_tokens == MAX_TOKENS and r.prompt_tokens > 0
        assert 1 <= r.num_chunks <= MAX_TOKENS
        assert 0 <= r.ttft_s <= r.latency_s and r.tpot_s >= 0


@pytest.mark.parametrize("load", [Load(2), Load(2, rate=50.0)], ids=["closed", "open"])
def test_load_driver_records(server_url, load):
    target = make_target(OURS, server_url, None)
    assert target.model == "tiny" and target.base_url.endswith("/v1")
    done = asyncio.run(drive(target, [(t,) for t in TEXTS], load, MAX_TOKENS))
    check_records(done.records, len(TEXTS), load.concurrency)
    summary = summarise(OURS, load, [done])
    assert summary.num_completed == len(TEXTS) and summary.num_failed == 0
    assert summary.output_tokens == len(TEXTS) * MAX_TOKENS and summary.output_tokens_per_s > 0
    assert summary.ttft_p50_s <= summary.ttft_p90_s <= summary.ttft_p99_s


def test_a_conversations_later_turns_carry_its_earlier_ones(server_url, capsys):
    """Each later turn sends the earlier turns and the answers the server gave them, so its
    prompt holds the first request's prompt and answer, and the server's prefix cache reads
    them (its usage says how many)."""
    target = make_target(OURS, server_url, None)
    conversations = [(f"({i}) Tell me about foxes, and then about their dens.",
                      "Shorter, please.", "Once more.") for i in range(3)]
    done = asyncio.run(drive(target, conversations, Load(2), MAX_TOKENS))
    assert [(r.index, r.turn) for r in done.records] == [(i, t) for i in range(3) for t in range(3)]
    assert all(r.ok and r.output_tokens == MAX_TOKENS for r in done.records)
    for first, second, third in zip(*[iter(done.records)] * 3, strict=True):
        assert first.prompt_tokens + MAX_TOKENS < second.prompt_tokens < third.prompt_tokens
        assert first.cached_tokens == 0 and second.cached_tokens > first.prompt_tokens // 2
    summary = summarise(OURS, Load(2), [done])
    assert len(summary.ttft_p50_by_turn_s) == 3 and summary.num_completed == 9
    report([[summary]], [Load(2)], [], {}, MAX_TOKENS)
    assert f"{OURS}: TTFT p50 s by turn: 1: " in capsys.readouterr().out


def test_turns_are_checked():
    with pytest.raises(SystemExit):
        parse_args(["--turns", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--turns", "2", "--offline"])
    conversations = spec_bench_conversations(DEFAULT_PROMPTS, 5, 2)
    assert len(conversations) == 5 and all(len(c) == 2 for c in conversations)
    assert len({c[0] for c in conversations}) == 5
    marked = round_conversations(conversations, "tag", 1)
    assert all(m[0].endswith(c[0]) and m[0] != c[0] and m[1] == c[1]
               for m, c in zip(marked, conversations, strict=True))


def test_unreachable_server_counts_failures():
    target = make_target(OURS, "http://127.0.0.1:9", "tiny")  # discard port: nothing listens
    done = asyncio.run(drive(target, [(t,) for t in TEXTS[:2]], Load(1), MAX_TOKENS))
    assert [r.ok for r in done.records] == [False, False]
    summary = summarise(OURS, Load(1), [done])
    assert summary.num_completed == 0 and summary.num_failed == 2
    # a conversation's turns after a failed one are not sent, and count as failed
    done = asyncio.run(drive(target, [("one", "two", "three")], Load(1), MAX_TOKENS))
    assert [(r.turn, r.ok) for r in done.records] == [(0, False), (1, False), (2, False)]
    assert done.records[2].error == "not sent: turn 1 failed"


def test_random_prompts_have_their_length(tiny_pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    texts = random_texts(tokenizer, 4, 12, seed=1)
    assert len(texts) == 4 and len(set(texts)) == 4
    lengths = [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    assert all(abs(n - 12) <= 2 for n in lengths), lengths


def test_main_with_url_offline_and_json(server_url, tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    out = main([
        "--url", server_url, "--concurrency", "1,2", "--num-requests", "3",
        "--max-tokens", str(MAX_TOKENS), "--prompts", "random", "--input-len", "8",
        "--app-arg", f"model={target}", "--app-arg", f"draft_model={draft}",
        "--app-arg", "policy=fixed:2", "--app-arg", "num_kv_blocks=64",
        "--offline", "--json", str(tmp_path / "serving.json"),
    ])
    printed = capsys.readouterr().out
    assert "host: " in printed and "C = 1 (closed loop" in printed and "C = 2" in printed
    assert json.loads((tmp_path / "serving.json").read_text()) == out
    assert [(s["server"], s["concurrency"]) for s in out["summaries"]] == [
        (OURS, 1), (OFFLINE, 1), (OURS, 2), (OFFLINE, 2)
    ]
    for s in out["summaries"]:
        # the offline figure pools a round before the served one and one after
        runs = 2 if s["server"] == OFFLINE else 1
        assert s["num_completed"] == 3 * runs and s["num_failed"] == 0
        assert s["output_tokens"] == 3 * runs * MAX_TOKENS
    assert len(out["requests"]) == 6
    assert all(r["output_tokens"] == MAX_TOKENS for r in out["requests"])


def test_a_peer_app_takes_checked_arguments_and_environment():
    args = parse_args(["--peer-app-arg", "stream_interval_ms=0", "--peer-env", "RAY_X=1"])
    run = settings(args, {})
    assert run["peer_app_args"] == {"stream_interval_ms": "0"}
    assert run["peer_env"] == {"RAY_X": "1"}
    with pytest.raises(SystemExit, match="--peer-env takes KEY=VALUE"):
        settings(parse_args(["--peer-env", "RAY_X"]), {})
    with pytest.raises(ValueError, match="stream_interval_ms"):
        parse_app_args(["stream_interval_ms=-1"])


def test_cpu_of_the_app_during_its_rounds(server_url, capsys):
    # the in-process server runs in this process, so the "app" is this process's tree
    target = make_target(OURS, server_url, None, pid=os.getpid())
    args = parse_args(["--cpu", "--num-requests", "3", "--max-tokens", str(MAX_TOKENS),
                       "--rounds", "2"])
    levels, records, use = measure([target], [(t,) for t in TEXTS], [Load(2)], args)
    assert len(records) == 6 and levels[0][0].num_completed == 6
    assert [(u["server"], u["concurrency"]) for u in use] == [(OURS, 2)]
    cores = use[0]["cores"]
    assert cpu.CpuUse.CLIENT in cores and sum(cores.values()) > 0
    assert report(levels, [Load(2)], use, {}, MAX_TOKENS) == levels[0]
    assert f"CPU during {OURS}'s rounds, cores of {os.cpu_count()}" in capsys.readouterr().out


def test_each_round_sends_its_own_prompts_unless_asked_to_repeat_them():
    """A prefix cache (vLLM's default) must not serve one round's or run's prefills from
    another's."""
    args, again = parse_args([]), parse_args([])
    assert args.prompt_tag != again.prompt_tag  # a peer kept up between runs
    marked = [round_texts(TEXTS, tag, r) for tag in (args.prompt_tag, again.prompt_tag)
              for r in (0, 1)]
    for texts in zip(*marked, strict=True):
        text = TEXTS[marked[0].index(texts[0])]
        heads = [t[: t.index(text)] for t in texts]
        assert all(t.endswith(text) for t in texts) and len(set(heads)) == len(heads)
    assert settings(args, {})["prompt_tag"] == args.prompt_tag
    assert settings(parse_args(["--repeat-prompts"]), {})["prompt_tag"] is None


@pytest.mark.parametrize("tag", ["a1b2c3", None])
def test_the_offline_rounds_mark_their_prompts_as_the_served_ones_do(tiny_pair, tag):
    """The engine caches prefixes: a round that repeated an earlier one's prompts would read
    their blocks and compute only the last one's tokens, unless asked to repeat them."""
    target, draft = tiny_pair
    app = {"model": str(target), "draft_model": str(draft), "policy": "off",
           "num_kv_blocks": 64, "block_size": 4}
    texts = ["the first prompt, long enough for blocks", "a second one, as long as the first"]
    offline = Offline(app, texts, MAX_TOKENS, tag)
    computed = []
    for _ in range(2):
        before = offline.engine.target.num_positions_computed
        offline.run([Load(1)], 1)
        computed.append(offline.engine.target.num_positions_computed - before)
    if tag is None:
        assert computed[1] < computed[0] - 8
    else:
        assert computed[1] == computed[0]


def test_the_offline_engine_runs_a_round_after_each_served_one_while_the_app_is_up(
        server_url, tiny_pair, capsys):
    """Its rounds while the app is up are pooled under their own label, apart from the rounds
    with no app up, and each sends its own marked prompts."""
    target, draft = tiny_pair
    app = {"model": str(target), "draft_model": str(draft), "policy": "off",
           "num_kv_blocks": 64}
    offline = Offline(app, list(TEXTS), MAX_TOKENS, "t4g")
    offline.run([Load(2)], 1)
    args = parse_args(["--num-requests", "3", "--max-tokens", str(MAX_TOKENS), "--rounds", "2"])
    levels, _, _ = measure([make_target(OURS, server_url, None)], [(t,) for t in TEXTS],
                           [Load(2)], args, offline)
    assert [len(offline.rounds[(label, 2)]) for label in (OFFLINE, OFFLINE_APP_UP)] == [1, 2]
    up = offline.summaries(OFFLINE_APP_UP)[2]
    assert up.server == OFFLINE_APP_UP and up.num_completed == 2 * len(TEXTS)
    assert offline.summaries()[2].num_completed == len(TEXTS)
    rows = {2: [offline.summaries()[2], up]}
    assert [s.server for s in report(levels, [Load(2)], [], rows, MAX_TOKENS)] == [
        OURS, OFFLINE, OFFLINE_APP_UP]
    assert OFFLINE_APP_UP in capsys.readouterr().out
