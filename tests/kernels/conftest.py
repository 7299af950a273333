"""Runs the Triton kernels under Triton's interpreter on the CPU.

Without a GPU, TRITON_INTERPRET=1 is set here, before any test imports Triton, so the
interpreter cases (those using the `interpreted` fixture, marked `triton_interpreter`) run in
this process on private, interpreted copies of the kernel modules. Where Triton was already
imported to compile (a GPU machine, or an earlier test), they skip here and
test_interpreter_process.py runs them in a fresh process instead.
"""

from __future__ import annotations

import importlib.util
import os
import types
from pathlib import Path

import pytest
import torch
from triton_mode import interpreter_in_process

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels" / "faser_kernels"
TRITON_MODULES = ("triton_cache", "triton_attention", "triton_rejection")


def _load_interpreted(name: str) -> types.ModuleType:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location(
            f"_interpreted_{name}", KERNEL_DIR / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return module


@pytest.fixture(scope="session")
def interpreted() -> dict[str, types.ModuleType]:
    """name -> an interpreted copy of faser_kernels.<name>."""
    pytest.importorskip("triton")
    if not interpreter_in_process():
        pytest.skip("Triton compiles in this process: test_interpreter_process.py runs this")
    return {name: _load_interpreted(name) for name in TRITON_MODULES}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "triton_interpreter: runs a kernel in Triton's interpreter")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "interpreted" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.triton_interpreter)


@pytest.fixture(autouse=True)
def _one_thread():
    # the machine is shared; small kernels gain nothing from more threads
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
