"""Runs the Triton kernels under Triton's interpreter on the CPU.

Triton decides interpreter or compiler when a kernel is decorated, i.e. when its module is first
imported. Without a GPU, TRITON_INTERPRET=1 is set here, before any test imports the kernels. So
that the interpreter cases work even when something imported the compiled modules earlier (or a
GPU is present and they must stay compiled for the CUDA cases), `interpreted` loads private,
interpreted copies of the three kernel modules from their files.
"""

from __future__ import annotations

import importlib.util
import os
import types
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
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
    return {name: _load_interpreted(name) for name in TRITON_MODULES}


@pytest.fixture(autouse=True)
def _one_thread():
    # the machine is shared; small kernels gain nothing from more threads
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
