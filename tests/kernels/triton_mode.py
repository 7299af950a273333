"""Which Triton this process has: interpreted or compiled. Triton decides once, when it and each
kernel module are first imported, from TRITON_INTERPRET; its own library functions (tl.max,
tl.cumsum, ...) then only work in that mode. So a process whose Triton compiles cannot also
interpret, and the reverse: the kernel tests run each mode in a process that has it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def interpreter_in_process() -> bool:
    try:
        import triton.language.standard as standard
    except ImportError:
        return False
    return type(standard.max).__name__ == "InterpretedFunction"


def run_fresh(
    args: list[str], interpret: bool, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`python <args>` from the repository root in a new process with Triton in the given mode;
    the interpreter runs on the CPU, so it gets no GPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASER_KERNELS")}
    if interpret:
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout,
    )
