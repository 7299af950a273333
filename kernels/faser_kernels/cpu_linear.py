"""Row-invariant linear layers on x86 CPUs with AVX-512 (cpu_linear.c), and their PyTorch twin.

Row m of an M-row call has the bits of a one-row call, for any M: each output is one fp32
accumulator over k in a fixed order. The weight is packed once into the kernel's panels, which
it streams once per call whatever M is, so verifying k + 1 positions costs about one decode.

The C source is built and loaded by cpu_build; where it cannot run, `unavailable_reason`
says why and callers keep torch's own linear.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from faser_kernels import cpu_build

PANEL = 32  # output columns per packed panel, as in cpu_linear.c


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A [n, k] weight in the kernel's panels (cpu_linear.c)."""

    data: torch.Tensor  # bf16: [num_panels, k / 2, PANEL, 2]; fp32: [num_panels, k, PANEL]
    n: int
    k: int

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def unavailable_reason(dtype: torch.dtype) -> str | None:
    """None where the kernel runs for `dtype` on this CPU; else why it cannot."""
    return cpu_build.unavailable_reason("cpu_linear.c", dtype)


def pack_weight(weight: torch.Tensor) -> PackedWeight:  # [n, k] -> panels
    n, k = weight.shape
    if weight.dtype not in cpu_build.NEEDED_FLAGS:
        raise ValueError(f"cpu_linear packs float32 or bfloat16 weights, got {weight.dtype}")
    if weight.dtype == torch.bfloat16 and k % 2:
        raise ValueError(f"a bf16 weight needs an even in-feature count, got {k}")
    num_panels = -(-n // PANEL)
    padded = F.pad(weight.detach(), (0, 0, 0, num_panels * PANEL - n))  # zero columns
    panels = padded.view(num_panels, PANEL, k)
    if weight.dtype == torch.bfloat16:
        data = panels.view(num_panels, PANEL, k // 2, 2).permute(0, 2, 1, 3)
    else:
        data = panels.permute(0, 2, 1)
    return PackedWeight(data.contiguous(), n, k)


def linear(
    x: torch.Tensor,  # [m, k], the weight's dtype
    weight: PackedWeight,
    bias: torch.Tensor | None = None,  # [n] float32
) -> torch.Tensor:  # [m, n], x's dtype
    if x.dtype != weight.dtype or x.shape[-1] != weight.k:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit a {weight.dtype} weight "
                         f"of {weight.k} in-features")
    x = x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, weight.n, dtype=x.dtype)
    if m:
        run = _library().faser_linear_bf16 if x.dtype == torch.bfloat16 else \
            _library().faser_linear_f32
        run(x.data_ptr(), weight.data.data_ptr(), bias.data_ptr() if bias is not None else None,
            out.data_ptr(), m, weight.n, weight.k)
    return out


def linear_torch(
    x: torch.Tensor,  # [m, k]
    weight: torch.Tensor,  # [n, k], unpacked
    bias: torch.Tensor | None = None,  # [n] float32
) -> torch.Tensor:  # [m, n], x's dtype
    """The twin: the same product accumulated in fp32 (in another order, so equal to rounding)."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@functools.cache
def _library() -> ctypes.CDLL:
    lib = cpu_build.library("cpu_linear.c")
    for name in ("faser_linear_bf16", "faser_linear_f32"):
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
        getattr(lib, name).restype = None
    return lib
