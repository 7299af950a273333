"""The kernels package is importable without Triton or CUDA, and can never pass for the unrelated
PyPI package `kernels` that transformers probes for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"


def _run(code: str, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "FASER_KERNELS": "auto"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_installed_project_exposes_no_top_level_kernels(tmp_path):
    """From anywhere but the repository root (whose cwd Python itself puts on sys.path), the
    name `kernels` resolves to nothing of ours; the directory imports as `faser_kernels`."""
    out = _run(
        "import importlib.util as u\n"
        "s = u.find_spec('kernels')\n"
        "print(s.origin if s and s.origin else s)\n"
        "print(u.find_spec('faser_kernels').origin)",
        cwd=tmp_path,
    )
    kernels_origin, ours = out.splitlines()
    assert not kernels_origin.startswith(str(KERNEL_DIR))
    assert Path(ours) == KERNEL_DIR / "__init__.py"


def test_transformers_sees_no_kernels_package():
    from transformers.utils import is_kernels_available

    assert is_kernels_available() is False


def test_import_needs_neither_triton_nor_cuda(tmp_path):
    """With Triton unimportable, the package loads and its CPU paths run."""
    out = _run(
        "import sys\n"
        "sys.modules['triton'] = None  # any `import triton` now raises ImportError\n"
        "import torch, faser_kernels\n"
        "k = torch.zeros(1, 1, 16)\n"
        "cache = torch.zeros(2, 4, 1, 16)\n"
        "faser_kernels.store_kvcache(k + 1, k + 2, cache, cache.clone(), torch.tensor([5]))\n"
        "print(float(cache[1, 1].sum()), torch.cuda.is_initialized())",
        cwd=tmp_path,
    )
    assert out == "16.0 False"
