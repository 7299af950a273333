"""The GPU check program (benchmarks/gpu_check.py) runs end to end on a CPU: tiny random-weight
models, the kernels under Triton's interpreter, every section's table and its JSON."""

from __future__ import annotations

import json

import pytest
from triton_mode import run_fresh

pytest.importorskip("triton")


def test_gpu_check_runs_on_cpu(tmp_path):
    done = run_fresh(
        ["-m", "benchmarks.gpu_check", "--device", "cpu", "--tiny", "--out", str(tmp_path)],
        interpret=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["failures"] == []
    sections = report["sections"]
    assert all(r["ok"] for r in sections["kernels"]["attention_store_parity"])
    assert {r["kernel"] for r in sections["kernels"]["times"]} == {
        "paged_attention", "store_kvcache", "rejection_sample"}
    assert [r["tokens"] for r in sections["forward"]["curve"]] == [1, 4, 8]
    engine = sections["engine"]["policies"]
    assert {(r["models"], r["concurrency"], r["policy"]) for r in engine} == {
        (m, c, p) for m in ("independent draft", "draft = target") for c in (1, 4)
        for p in ("off", "fixed:4", "faser")}
    for row in engine:
        assert row["same_as_off"] == 1.0  # fp32 on a CPU: speculation changes no token
        if row["models"] == "draft = target" and row["policy"] == "fixed:4":
            assert row["acceptance_rate"] >= 0.9
    assert "Kernel parity" in done.stdout and "Engine, greedy" in done.stdout
