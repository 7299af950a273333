"""The load-test harness's pure parts (no server), and one short headless run against a stub.

Nothing here imports Locust in the test process: Locust monkey-patches the standard library
with gevent on import, which other tests in the same session must not inherit.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from openai_stub import MODEL, start_stub

from loadtest.body import request_body
from loadtest.prompts import Prompt, approx_tokens, load_prompts, sized_prompt
from loadtest.records import RecordWriter, RequestRecord, read_records
from loadtest.report import write_report
from loadtest.run import run_headless
from loadtest.run_data import load_run, summarize
from loadtest.schedule import ArrivalSchedule
from loadtest.settings import LoadSettings, speculation_field
from loadtest.shapes import (
    DiurnalProfile,
    ReplayProfile,
    SpikeProfile,
    StepProfile,
    UserTarget,
    closed_loop_profile,
)
from loadtest.sse import parse_stream, sse_data
from loadtest.time_series import bin_records
from loadtest.trace import (
    TraceRequest,
    TraceRow,
    TraceWindow,
    read_trace,
    to_arrivals,
    to_requests,
    trace_path,
)

SHARED = Path(__file__).resolve().parents[3] / "shared"

# A chat stream as vLLM's OpenAI server sends it with stream_options.include_usage.
CHAT_STREAM = """\
data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}

data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hello"},"finish_reason":null}]}

: keep-alive comment

data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" there"},"finish_reason":null}]}

data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":", friend"},"finish_reason":"length"}]}

data: {"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":12,"total_tokens":17,"completion_tokens":5}}

data: [DONE]

"""  # noqa: E501 - captured lines are kept whole
COMPLETIONS_STREAM = """\
data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":null}]}

data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"b","finish_reason":null}]}

data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"c","finish_reason":"stop"}]}

data: [DONE]

"""  # noqa: E501 - captured lines are kept whole


def timed(stream: str, step_s: float = 0.1) -> list[tuple[float, str]]:
    """Each line arriving `step_s` after the previous one."""
    return [((i + 1) * step_s, line) for i, line in enumerate(stream.splitlines())]


# ---- settings and request bodies ---------------------------------------------------------------


def test_a_run_against_nothing_fails_at_once_saying_so(tmp_path) -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(RuntimeError, match=f"nothing answers at http://127.0.0.1:{port}"):
        run_headless(f"http://127.0.0.1:{port}", out=tmp_path / "run", duration_s=30)
    assert not (tmp_path / "run").exists()


def test_settings_from_env_reads_json_and_single_variables() -> None:
    env = {"FASER_LOADTEST": json.dumps({"shape": "spike", "users": 4}), "FASER_MODEL": "m"}
    settings = LoadSettings.from_env(env)
    assert (settings.shape, settings.users, settings.model) == ("spike", 4, "m")
    assert LoadSettings.from_mapping(json.loads(settings.to_json())) == settings


@pytest.mark.parametrize(
    ("values", "field"),
    [({"shape": "ramp"}, "shape"), ({"time_scale": 0}, "time_scale"), ({"bogus": 1}, "bogus"),
     ({"users": 2, "base_users": 3}, "base_users"), ({"speculation": "{oops"}, "speculation")],
)
def test_settings_reject_bad_fields_by_name(values: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LoadSettings.from_mapping(values)


def test_speculation_field_accepts_a_policy_name_or_json() -> None:
    assert speculation_field("faser") == {"policy": "faser"}
    assert speculation_field('{"policy": "fixed", "max_k": 4}') == {"policy": "fixed", "max_k": 4}
    assert speculation_field(None) is None
    for bad in ('{"policy": ', "[1]", '{"policy": "x"} extra'):
        with pytest.raises(ValueError, match="speculation"):
            speculation_field(bad)


def test_request_body_chat_and_completions() -> None:
    chat = request_body(LoadSettings(speculation="off"), "m", "hi", 7)
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert (chat["max_tokens"], chat["ignore_eos"]) == (7, True)
    assert chat["speculation"] == {"policy": "off"}
    plain = request_body(LoadSettings(api="completions", ignore_eos=False), "m", "hi", 3)
    assert plain["prompt"] == "hi" and "messages" not in plain
    assert "ignore_eos" not in plain and "speculation" not in plain


# ---- prompts -----------------------------------------------------------------------------------


@pytest.mark.skipif(not (SHARED / "data" / "spec_bench_dev.jsonl").is_file(), reason="no data")
def test_load_prompts_reads_the_first_turn_of_spec_bench() -> None:
    prompts = load_prompts()
    assert len(prompts) == 240
    assert prompts[0].text.startswith("Compose an engaging travel blog post")
    assert len({p.category for p in prompts}) == 13


def test_load_prompts_from_env_path_and_missing_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"question_id": 1, "category": "c", "turns": ["one two", "later"]}\n\n')
    monkeypatch.setenv("FASER_PROMPTS", str(path))
    assert load_prompts() == [Prompt(1, "c", "one two")]
    with pytest.raises(ValueError, match="prompts_path"):
        load_prompts(tmp_path / "absent.jsonl")


@pytest.mark.parametrize("num_tokens", [1, 5, 13, 100, 1000])
def test_sized_prompt_cuts_or_pads_to_about_the_token_count(num_tokens: int) -> None:
    text = "the quick brown fox jumps over the lazy dog"  # 9 words, about 12 tokens
    sized = sized_prompt(text, num_tokens)
    assert abs(approx_tokens(sized) - num_tokens) <= 2
    assert text.startswith(sized) or sized.startswith(text)  # cut from, or repeats, the text


def test_sized_prompt_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        sized_prompt("a b", 0)
    with pytest.raises(ValueError, match="text"):
        sized_prompt("   ", 4)


# ---- trace -------------------------------------------------------------------------------------


def write_trace(path: Path, rows: list[tuple[str, int, int]]) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        writer.writerows(rows)
    return path


@pytest.fixture
def small_trace(tmp_path) -> list[TraceRow]:
    rows = [  # deliberately out of order; 7 fractional digits as in the Azure files
        ("2023-11-16 18:15:48.0000000", 3000, 40),
        ("2023-11-16 18:15:46.5000000", 100, 10),
        ("2023-11-16 18:15:47.0000000", 200, 500),
        ("2023-11-16 18:15:56.5000000", 50, 5),
    ]
    return read_trace(write_trace(tmp_path / "t.csv", rows))


def test_read_trace_sorts_and_offsets_from_the_first_row(small_trace) -> None:
    assert [r.offset_s for r in small_trace] == [0.0, 0.5, 1.5, 10.0]
    assert [(r.context_tokens, r.generated_tokens) for r in small_trace][0] == (100, 10)


def test_to_arrivals_scales_time_and_caps_lengths(small_trace) -> None:
    window = TraceWindow(time_scale=0.5, max_prompt_tokens=1000, max_output_tokens=64)
    arrivals = to_arrivals(small_trace, window)
    assert [a.offset_s for a in arrivals] == [0.0, 1.0, 3.0, 20.0]  # slowed down 2x
    assert [a.prompt_tokens for a in arrivals] == [100, 200, 1000, 50]
    assert [a.output_tokens for a in arrivals] == [10, 64, 40, 5]


def test_to_arrivals_window_rebases_and_counts(small_trace) -> None:
    window = TraceWindow(time_scale=2.0, start_s=0.5, span_s=5.0)
    assert [a.offset_s for a in to_arrivals(small_trace, window)] == [0.0, 0.5]
    assert len(to_arrivals(small_trace, TraceWindow(max_requests=3))) == 3
    assert to_arrivals(small_trace, TraceWindow(start_s=100.0)) == []


@pytest.mark.parametrize(
    "kwargs", [{"time_scale": 0}, {"span_s": 0}, {"max_requests": 0}, {"max_output_tokens": 0}]
)
def test_trace_window_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        TraceWindow(**kwargs)


def test_read_trace_rejects_a_bad_row(tmp_path) -> None:
    path = write_trace(tmp_path / "bad.csv", [("yesterday", 1, 1)])
    with pytest.raises(ValueError, match="bad row"):
        read_trace(path)


def test_to_requests_pairs_sized_prompts_cyclically(small_trace) -> None:
    prompts = [Prompt(1, "a", "alpha beta gamma"), Prompt(2, "b", "delta epsilon")]
    requests = to_requests(to_arrivals(small_trace, TraceWindow(max_prompt_tokens=60)), prompts)
    assert [r.prompt.split()[0] for r in requests] == ["alpha", "delta", "alpha", "delta"]
    assert [r.max_tokens for r in requests] == [10, 128, 40, 5]
    assert all(abs(approx_tokens(r.prompt) - r.prompt_tokens) <= 2 for r in requests)


@pytest.mark.skipif(not (SHARED / "traces").is_dir(), reason="no traces")
def test_azure_conv_trace_reads() -> None:
    rows = read_trace(trace_path("conv"))
    assert len(rows) > 19_000 and rows[0].offset_s == 0.0
    assert 3000 < rows[-1].offset_s < 3700  # an hour of arrivals


# ---- SSE ---------------------------------------------------------------------------------------


def test_sse_data_extracts_payloads_only() -> None:
    assert sse_data(b'data: {"a":1}\n') == '{"a":1}'
    assert sse_data("data:[DONE]") == "[DONE]"
    assert sse_data(": comment") is None and sse_data("") is None
    assert sse_data("event: ping") is None


def test_parse_chat_stream_times_first_token_and_counts_usage() -> None:
    result = parse_stream(timed(CHAT_STREAM), latency_s=1.2)
    assert result.error is None
    assert result.text == "Hello there, friend"
    assert result.ttft_s == pytest.approx(0.3)  # line 3; the role-only chunk carries no text
    assert (result.output_tokens, result.prompt_tokens) == (5, 12)
    assert result.tpot_s == pytest.approx((1.2 - 0.3) / 4)


def test_parse_completions_stream_without_usage_counts_text_chunks() -> None:
    result = parse_stream(timed(COMPLETIONS_STREAM, step_s=0.5), latency_s=3.0)
    assert (result.text, result.output_tokens, result.prompt_tokens) == ("abc", 3, None)
    assert result.ttft_s == pytest.approx(0.5)
    assert result.tpot_s == pytest.approx((3.0 - 0.5) / 2)


def test_parse_stream_flags_truncation_and_error_events() -> None:
    cut = CHAT_STREAM.replace("data: [DONE]", "")
    assert "[DONE]" in parse_stream(timed(cut), 1.0).error
    broken = 'data: {"error": {"message": "boom", "code": 500}}\n\ndata: [DONE]\n'
    assert "boom" in parse_stream(timed(broken), 1.0).error
    assert "bad SSE chunk" in parse_stream(timed("data: {nope\n\ndata: [DONE]\n"), 1.0).error


# ---- shapes and the replay schedule ------------------------------------------------------------


def test_step_profile_climbs_then_holds_then_ends() -> None:
    step = StepProfile(start_users=1, step_users=2, step_s=10.0, max_users=6, duration_s=60.0)
    users = [step.users_at(t).users for t in (0, 9.9, 10, 25, 35, 59)]
    assert users == [1, 1, 3, 5, 6, 6]
    assert step.users_at(60.0) is None


def test_spike_profile_jumps_for_its_length_only() -> None:
    spike = SpikeProfile(base_users=1, peak_users=10, spike_at_s=20, spike_len_s=10, duration_s=60)
    assert [spike.users_at(t).users for t in (0, 19.9, 20, 29.9, 30)] == [1, 1, 10, 10, 1]
    assert spike.users_at(20).spawn_rate == 10.0
    assert spike.users_at(61) is None


def test_diurnal_profile_is_a_cosine_between_trough_and_peak() -> None:
    day = DiurnalProfile(min_users=2, max_users=10, period_s=40.0, duration_s=80.0)
    assert [day.users_at(t).users for t in (0, 10, 20, 30, 40)] == [2, 6, 10, 6, 2]
    assert day.users_at(80.0) is None


def test_closed_loop_profile_defaults_follow_the_duration() -> None:
    spike = closed_loop_profile(LoadSettings(shape="spike", duration_s=60, users=5))
    assert spike == SpikeProfile(1, 5, 20.0, 10.0, 60.0)
    diurnal = closed_loop_profile(LoadSettings(shape="diurnal", duration_s=30, base_users=0))
    assert diurnal.users_at(15.0) == UserTarget(8, 8.0)
    with pytest.raises(ValueError, match="shape"):
        closed_loop_profile(LoadSettings(shape="trace"))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_schedule_hands_out_arrivals_in_order_with_due_times() -> None:
    clock = FakeClock()
    requests = [TraceRequest(offset, "p", 4, 8) for offset in (0.0, 1.5, 4.0)]
    schedule = ArrivalSchedule(requests, clock)
    first, second = schedule.take(), schedule.take()
    assert (first.due, second.due) == (100.0, 101.5)
    assert schedule.wait_s(second) == 1.5 and schedule.lateness_s(first) == 0.0
    clock.now = 105.0  # no pool user was free: the third goes out a second late
    third = schedule.take()
    assert schedule.wait_s(third) == 0.0 and schedule.lateness_s(third) == pytest.approx(1.0)
    assert schedule.take() is None
    profile = ReplayProfile(pool_users=4, duration_s=30.0, is_done=schedule.is_done)
    for _ in range(2):
        schedule.finish()
    assert profile.users_at(1.0) == UserTarget(4, 4.0)
    schedule.finish()
    assert profile.users_at(1.0) is None  # every arrival answered: the replay ends itself


# ---- records and reports -----------------------------------------------------------------------


def record(start: float, status: str = "ok", ttft: float = 0.1, tokens: int = 10) -> RequestRecord:
    ok = status == "ok"
    return RequestRecord(
        start=start, latency_s=1.0, ttft_s=ttft if ok else None, tpot_s=0.1 if ok else None,
        output_tokens=tokens if ok else 0, prompt_tokens=5, status=status,
        http_status={"ok": 200, "backpressure": 503, "error": 500}[status], users=2,
    )


def test_records_round_trip_and_skip_a_torn_line(tmp_path) -> None:
    path = tmp_path / "records.jsonl"
    writer = RecordWriter(path)
    writer.write(record(1.0))
    writer.write(record(2.0, "backpressure"))
    writer.close()
    with path.open("a") as handle:
        handle.write('{"start": 3.0, "lat')  # a run killed mid-write
    assert read_records(path) == [record(1.0), record(2.0, "backpressure")]


def test_bin_records_rates_and_percentiles() -> None:
    records = [record(0.0), record(0.5, ttft=0.3)]
    records += [record(2.0, "backpressure"), record(3.0, "error")]
    series = bin_records(records, t0=0.0, bin_s=1.0)
    assert list(series.t_s) == [0.0, 1.0, 2.0, 3.0]
    assert list(series.output_tok_s) == [0.0, 20.0, 0.0, 0.0]  # both finish in [1, 2)
    assert list(series.backpressure_per_s) == [0.0, 0.0, 0.0, 1.0]
    assert list(series.errors_per_s) == [0.0, 0.0, 0.0, 1.0]  # completion clipped to last bin
    assert series.ttft_ms[50][0] == pytest.approx(200.0)
    assert math.isnan(series.ttft_ms[50][1])
    assert series.in_flight[0] == pytest.approx(1.5)  # one whole second plus half of another


def write_run(folder: Path, records: list[RequestRecord], settings: dict) -> Path:
    folder.mkdir(parents=True)
    writer = RecordWriter(folder / "records.jsonl")
    for r in records:
        writer.write(r)
    writer.close()
    run = {"host": "http://127.0.0.1:8000", "settings": settings, "started": 0.0, "ended": 20.0}
    (folder / "run.json").write_text(json.dumps(run))
    return folder


def test_report_writes_plots_and_a_side_by_side_summary(tmp_path) -> None:
    fast = [record(float(t), ttft=0.05) for t in range(20)] + [record(5.5, "backpressure")]
    slow = [record(float(t), ttft=0.5, tokens=20) for t in range(0, 20, 2)] + [record(3.0, "error")]
    run_a = write_run(tmp_path / "faser", fast, {"shape": "trace", "time_scale": 0.05})
    run_b = write_run(tmp_path / "off", slow, {"shape": "step", "users": 4})
    metrics = {
        "mode": {"status": "success", "data": {"resultType": "matrix", "result": [
            {"metric": {}, "values": [[1.0, "2"], [10.0, "1"]]}]}},
        "replicas": [[0.0, 1], [12.0, 2]],
    }
    (run_a / "metrics.json").write_text(json.dumps(metrics))

    summary = write_report([run_a, run_b], tmp_path / "report")

    for name in ("throughput", "ttft", "tpot", "metrics"):
        png = tmp_path / "report" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    text = summary.read_text()
    assert "| | faser | off |" in text
    assert "| requests | 21 | 11 |" in text
    assert "| failures | 0 | 1 |" in text and "| 503s | 1 | 0 |" in text
    assert "| TTFT p50 (ms) | 50.0 | 500.0 |" in text
    assert "time_scale=0.05" in text and "users=4" in text


def test_summary_falls_back_to_locust_csv(tmp_path) -> None:
    folder = tmp_path / "other"
    folder.mkdir()
    header = "Type,Name,Request Count,Failure Count,Average Response Time,Average Content Size,"
    header += "50%,99%"
    rows = [
        "POST,/v1/chat/completions,10,2,2000.0,32.0,1800,4000",
        "POST,/v1/chat/completions [503 backpressure],3,0,2.0,0.0,2,3",
        "METRIC,ttft,8,0,150.0,0.0,120,300",
        "METRIC,tpot,8,0,40.0,0.0,38,60",
    ]
    (folder / "locust_stats.csv").write_text("\n".join([header, *rows]) + "\n")
    (folder / "run.json").write_text(json.dumps({"started": 0.0, "ended": 32.0}))
    s = summarize(load_run(folder))
    assert (s.requests, s.ok, s.failures, s.backpressure) == (13, 8, 2, 3)
    assert s.output_tok_s == pytest.approx(10.0)
    assert (s.ttft_p50_ms, s.tpot_p99_ms, s.latency_p99_s) == (120.0, 60.0, 4.0)


# ---- one headless Locust run against a stub server ---------------------------------------------


@pytest.mark.slow
def test_run_headless_replays_a_trace_against_a_stub_server(tmp_path) -> None:
    from loadtest.run import run_headless

    server, stub = start_stub(reject_every=3)
    try:
        host = f"http://127.0.0.1:{server.server_address[1]}"
        out = run_headless(
            host, tmp_path / "run", progress_s=1.0, shape="trace", trace="conv", time_scale=50.0,
            max_requests=6, max_output_tokens=8, duration_s=20, speculation="fixed",
        )
    finally:
        server.shutdown()
    records = read_records(out / "records.jsonl")
    assert sorted(r.status for r in records) == ["backpressure"] * 2 + ["ok"] * 4
    assert all(r.output_tokens <= 8 and r.ttft_s is not None for r in records if r.status == "ok")
    assert all(r.scheduled_s is not None for r in records)
    assert all(b["model"] == MODEL and b["speculation"] == {"policy": "fixed"} for b in stub.bodies)
    stats = (out / "locust_stats.csv").read_text()
    assert "[503 backpressure]" in stats and "METRIC,ttft" in stats
    run = json.loads((out / "run.json").read_text())
    assert run["settings"]["time_scale"] == 50.0 and run["locust_exit_code"] == 0
