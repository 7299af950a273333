"""The CPU kernels' C sources, compiled on first use with the system's C compiler into the user's
cache and loaded with ctypes.

Each library links libgomp.so.1, the soname of the OpenMP runtime torch itself loads (torch is
imported first), so a kernel's threads are torch's: `torch.set_num_threads` sets both, and no
second pool of spinning threads competes for the cores. Where the CPU lacks AVX-512 or no compiler
is found, `unavailable_reason` says why and callers keep their PyTorch twin.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp", "-mavx512f", "-mavx512bw",
         "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma")
NEEDED_FLAGS = {
    torch.float32: {"avx512f", "avx512bw", "avx512vl"},
    torch.bfloat16: {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"},
}
CACHE_ENV = "FASER_CACHE"


def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def unavailable_reason(source: str, dtype: torch.dtype) -> str | None:
    """None where the kernel of `source` runs for `dtype` on this CPU; else why it cannot."""
    if dtype not in NEEDED_FLAGS:
        return f"no CPU kernel for {dtype}"
    missing = NEEDED_FLAGS[dtype] - cpu_flags()
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}"
    try:
        library(source)
    except (OSError, RuntimeError) as exc:
        return f"the kernel could not be built: {exc}"
    return None


@functools.cache
def library(source: str) -> ctypes.CDLL:
    """`source` (a C file beside this module) compiled and loaded."""
    return ctypes.CDLL(str(_build(HERE / source)))


@functools.cache
def sources_digest() -> str:
    """What every kernel here is built from: the sources (a source may include its siblings, as
    cpu_decoder.c includes the other kernels) and the flags. Step costs measured with one build
    are not another's."""
    texts = [f.read_bytes() for f in sorted([*HERE.glob("*.h"), *HERE.glob("*.c")])]
    return hashlib.sha256(b"".join(texts) + " ".join(FLAGS).encode()).hexdigest()[:16]


def _build(source: Path) -> Path:
    """Built once per source text (its siblings included) and flags; concurrent builders each
    leave a whole file."""
    digest = sources_digest()
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "faser") / "kernels"
    path = cache / f"{source.stem}-{digest}.so"
    if path.exists():
        return path
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / path.name
        done = subprocess.run([compiler, *FLAGS, str(source), "-o", str(built)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip()[-2000:])
        os.replace(built, path)
    return path
