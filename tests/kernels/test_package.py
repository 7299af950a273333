"""The project's kernels import as `faser_kernels`, and nothing of ours can pass for the unrelated
PyPI package `kernels` that transformers depends on and imports, not even from the repository root
(the working directory of pytest, `serve run deployments:app` and `python -m ...`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OURS = REPO / "kernels" / "faser_kernels"


def _run(code: str, cwd: Path) -> str:
    """`python -c code` in cwd, which Python puts first on sys.path, as `python -c` does."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "FASER_KERNELS": "auto"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_repository_root_shadows_no_kernels_package():
    """From the root, `kernels` is PyPI's package where one is installed (never a folder of ours),
    and `faser_kernels` is the project's."""
    out = _run(
        "import importlib.util as u\n"
        "s = u.find_spec('kernels')\n"
        "print(s.origin if s is not None else None)\n"
        "print(u.find_spec('faser_kernels').origin)",
        cwd=REPO,
    )
    kernels_origin, ours = out.splitlines()
    assert kernels_origin == "None" or not kernels_origin.startswith(str(REPO / "kernels"))
    assert kernels_origin != "None" or _pypi_kernels_absent()
    assert Path(ours) == OURS / "__init__.py"


def _pypi_kernels_absent() -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("kernels")
    except PackageNotFoundError:
        return True
    return False


def test_transformers_loads_a_llama_model_from_the_repository_root(tmp_path):
    """transformers imports PyPI's `kernels` when it is installed; from the root it must still
    load and run a Llama model."""
    out = _run(
        "import torch, transformers as t\n"
        "c = t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,\n"
        "    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)\n"
        f"t.LlamaForCausalLM(c).save_pretrained({str(tmp_path)!r})\n"
        f"m = t.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})\n"
        "print(tuple(m(torch.tensor([[1, 2, 3]])).logits.shape))",
        cwd=REPO,
    )
    assert out.splitlines()[-1] == "(1, 3, 64)"


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
