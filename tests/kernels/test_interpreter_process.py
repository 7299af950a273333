"""The interpreter cases, in a fresh process, wherever this one's Triton compiles (see
triton_mode.py); and the compile check, in a fresh process, wherever this one's interprets."""

from __future__ import annotations

import pytest
from triton_mode import interpreter_in_process, run_fresh

pytest.importorskip("triton")


def test_interpreter_cases_in_a_fresh_process():
    if interpreter_in_process():
        pytest.skip("the interpreter cases ran in this process")
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "triton_interpreter",
            "tests/kernels"]
    done = run_fresh(args, interpret=True)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def test_kernels_compile_for_hopper():
    done = run_fresh(["tests/kernels/compile_for_hopper.py", "--quick"], interpret=False)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
