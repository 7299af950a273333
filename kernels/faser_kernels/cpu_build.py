"""The CPU kernels' C sources, compiled on first use with the system's C compiler into the user's
cache and loaded with ctypes.

Each library links libgomp.so.1, the soname of the OpenMP runtime torch itself loads (torch is
imported first), so a kernel's threads are torch's: `torch.set_num_threads` sets both, and no
second pool of spinning threads competes for the cores.

Two instruction sets: AVX-512 (every kernel, float32 and, with AVX-512 BF16, bf16) and, on CPUs
without it, AVX2 with FMA, for which every kernel but the bf16 head's rescoring has a float32
build (`AVX2_SOURCES`: the same exported functions and the same row-invariance).
FASER_CPU_ISA=avx2 takes the AVX2 builds on an AVX-512 CPU too (their tests run everywhere).
Where neither runs or no compiler is found, `unavailable_reason` says why and callers keep their
PyTorch twin.
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
COMMON_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp")
FLAGS = {
    "avx512": (*COMMON_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
               "-mavx512bf16", "-mfma"),
    # no multiply-add contracted that the source does not write: its scalar sums keep their
    # rounding
    "avx2": (*COMMON_FLAGS, "-mavx2", "-mfma", "-ffp-contract=off"),
}
NEEDED_FLAGS = {  # per instruction set, per dtype
    "avx512": {
        torch.float32: {"avx512f", "avx512bw", "avx512vl"},
        torch.bfloat16: {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"},
    },
    "avx2": {torch.float32: {"avx2", "fma"}},
}
# the AVX2 build of each source (cpu_decoder.c builds for either, from the sources it includes)
AVX2_SOURCES = {"cpu_linear.c": "cpu_linear_avx2.c", "cpu_attention.c": "cpu_attention_avx2.c",
                "cpu_ops.c": "cpu_ops_avx2.c", "cpu_decoder.c": "cpu_decoder.c"}
DTYPES = (torch.float32, torch.bfloat16)
CACHE_ENV = "FASER_CACHE"
ISA_ENV = "FASER_CPU_ISA"


def cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("flags", "model name", ...); empty where
    there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_flags() -> frozenset[str]:
    return frozenset(cpu_info().get("flags", "").split())


@functools.cache
def isa() -> str:
    """The instruction set the kernels are built for: FASER_CPU_ISA's, else "avx512" where the
    CPU has AVX-512's base, else "avx2". Read once: a process runs one set of builds."""
    forced = os.environ.get(ISA_ENV)
    if forced is not None:
        if forced not in FLAGS:
            raise ValueError(f"{ISA_ENV} must be one of {sorted(FLAGS)}, got {forced!r}")
        return forced
    return "avx512" if NEEDED_FLAGS["avx512"][torch.float32] <= cpu_flags() else "avx2"


def unavailable_reason(source: str, dtype: torch.dtype) -> str | None:
    """None where the kernel of `source` runs for `dtype` on this CPU; else why it cannot."""
    if dtype not in DTYPES:
        return f"no CPU kernel for {dtype}"
    target = isa()
    if dtype not in NEEDED_FLAGS[target]:
        return f"no {target} build of {source} for {dtype}"
    missing = NEEDED_FLAGS[target][dtype] - cpu_flags()
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}"
    try:
        library(source)
    except (OSError, RuntimeError) as exc:
        return f"the kernel could not be built: {exc}"
    return None


def library(source: str) -> ctypes.CDLL:
    """`source` (a C file beside this module) compiled for this CPU's instruction set (`isa`)
    and loaded."""
    target = isa()
    built = AVX2_SOURCES[source] if target == "avx2" else source
    return _load(built, target)


@functools.cache
def _load(source: str, target: str) -> ctypes.CDLL:
    return ctypes.CDLL(str(_build(HERE / source, target)))


@functools.cache
def sources_digest() -> str:
    """What every kernel here is built from: the sources (a source may include its siblings, as
    cpu_decoder.c includes the other kernels) and the flags. Step costs measured with one build
    are not another's."""
    texts = [f.read_bytes() for f in sorted([*HERE.glob("*.h"), *HERE.glob("*.c")])]
    flags = " ".join(f for target in sorted(FLAGS) for f in FLAGS[target])
    return hashlib.sha256(b"".join(texts) + flags.encode()).hexdigest()[:16]


def _build(source: Path, target: str) -> Path:
    """Built once per source text (its siblings included), flags and instruction set; concurrent
    builders each leave a whole file. The set is in the file's name because one source builds
    for either (cpu_decoder.c), and a cache may be shared by processes or hosts that run
    different sets."""
    digest = sources_digest()
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "faser") / "kernels"
    path = cache / f"{source.stem}-{target}-{digest}.so"
    if path.exists():
        return path
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / path.name
        done = subprocess.run([compiler, *FLAGS[target], str(source), "-o", str(built)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip()[-2000:])
        os.replace(built, path)
    return path
