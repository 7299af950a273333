from faser.config import SpecConfig
from faser.spec_decode.trace import DecisionTrace, read_trace


def test_trace_appends_one_json_line_per_step(tmp_path):
    path = tmp_path / "sub" / "trace.jsonl"
    trace = DecisionTrace(SpecConfig(trace_path=str(path)).trace_path)
    assert trace.enabled
    trace.record(
        0,
        "overlap",
        [4, 2],
        None,
        predicted_accepted=[2.1, 0.9],
        realised_accepted=[3, 0],
        predicted_time_s=0.010,
        measured_time_s=0.012,
    )
    trace.record(1, "prune", [1], 1, pressure={"prune": 1.2, "off": 0.3})
    trace.close()
    DecisionTrace(path).record(2, "off", [])  # a second writer appends
    records = read_trace(path)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0]["k"] == [4, 2] and records[0]["realised_accepted"] == [3, 0]
    assert records[0]["measured_time_s"] == 0.012
    assert records[1]["frontier_size"] == 1 and records[1]["pressure"]["prune"] == 1.2
    assert records[2]["mode"] == "off"


def test_trace_is_a_no_op_without_a_path(tmp_path):
    trace = DecisionTrace(SpecConfig().trace_path)
    assert not trace.enabled
    trace.record(0, "off", [0])
    trace.close()
    assert list(tmp_path.iterdir()) == []
