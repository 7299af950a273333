"""Hot operations of a speculative step. Each has a PyTorch twin (CPU, and the test oracle) and a
Triton kernel (CUDA) with the same signature; the functions exported here pick one by device.

Installed under the import name `faser_kernels` (see pyproject.toml), never as `kernels`, which
is an unrelated PyPI package that transformers probes for. Triton is imported lazily, so importing
this package needs neither Triton nor CUDA.
"""

from faser_kernels.attention import paged_attention
from faser_kernels.backend import use_triton
from faser_kernels.cache import store_kvcache
from faser_kernels.rejection import RejectionOutput, rejection_sample

__all__ = ["RejectionOutput", "paged_attention", "rejection_sample", "store_kvcache", "use_triton"]
