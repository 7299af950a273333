"""The AVX2 builds (cpu_linear_avx2.c, cpu_attention_avx2.c, cpu_ops_avx2.c and cpu_decoder.c's)
on a CPU with AVX-512, in a fresh process with FASER_CPU_ISA=avx2 (a process runs one set of
builds): the kernels' float32 tests, the fused layers against the layer-by-layer path and the
engine's float32 exactness. On a CPU without AVX-512 they ran in this process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from faser_kernels import cpu_build

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/kernels/test_cpu_linear.py", "tests/kernels/test_cpu_linear_blocks.py",
         "tests/kernels/test_cpu_attention.py",
         "tests/kernels/test_cpu_ops.py", "tests/engine/test_fused_layers.py",
         "tests/engine/test_exactness.py"]


def test_the_avx2_builds_in_a_fresh_process():
    if cpu_build.isa() == "avx2":
        pytest.skip("this process runs the AVX2 builds: their tests ran here")
    if missing := cpu_build.NEEDED_FLAGS["avx2"][cpu_build.DTYPES[0]] - cpu_build.cpu_flags():
        pytest.skip(f"the CPU lacks {', '.join(sorted(missing))}")
    env = {**os.environ, cpu_build.ISA_ENV: "avx2"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "float32", *TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def test_each_instruction_set_builds_its_own_file(tmp_path, monkeypatch):
    """cpu_decoder.c builds for either set: a cache that one process (or host) filled for one set
    must not hand another its library."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the kernels build for x86 only")
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path / "cache"))
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    built = {target: cpu_build._build(source, target) for target in sorted(cpu_build.FLAGS)}
    assert len(set(built.values())) == len(built)
    assert all(path.exists() and target in path.name for target, path in built.items())
