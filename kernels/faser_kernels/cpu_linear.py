"""Row-invariant linear layers on x86 CPUs with AVX-512 (cpu_linear.c; float32 also with AVX2,
cpu_linear_avx2.c), and their PyTorch twin.

Row m of an M-row call has the bits of a one-row call, for any M: each output is one fp32
accumulator over k in a fixed order. The weight is packed once into the kernel's panels, which
it streams once per call whatever M is, so verifying k + 1 positions costs about one decode.
Where the CPU has AMX, bf16 weights are multiplied on its tiles (cpu_linear.c says why).
A draft's weights may be packed in int8 with a scale per output (`pack_weight(w, int8=True)`):
half the bytes of bf16 to stream, for bf16 inputs; never the target's, whose output must be exact.

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

    data: torch.Tensor  # bf16, int8: [num_panels, k / 2, PANEL, 2]; fp32: [num_panels, k, PANEL]
    n: int
    k: int
    scale: torch.Tensor | None = None  # [n] float32: an int8 weight's per-output scale

    @property
    def dtype(self) -> torch.dtype:
        """The inputs' (and outputs') dtype: an int8 weight takes bf16."""
        return torch.bfloat16 if self.data.dtype == torch.int8 else self.data.dtype


def unavailable_reason(dtype: torch.dtype) -> str | None:
    """None where the kernel runs for `dtype` on this CPU; else why it cannot."""
    return cpu_build.unavailable_reason("cpu_linear.c", dtype)


def uses_amx() -> bool:
    """Whether bf16 weights are multiplied on AMX tiles here (the CPU has them and Linux grants
    this process their state); else on AVX-512 registers. Either way rows stay invariant."""
    return unavailable_reason(torch.bfloat16) is None and bool(_library().faser_linear_uses_amx())


def pack_weight(weight: torch.Tensor, int8: bool = False) -> PackedWeight:  # [n, k] -> panels
    n, k = weight.shape
    if weight.dtype not in cpu_build.DTYPES:
        raise ValueError(f"cpu_linear packs float32 or bfloat16 weights, got {weight.dtype}")
    if int8 and weight.dtype != torch.bfloat16:
        raise ValueError(f"int8 weights take bf16 inputs: pack a bf16 weight, got {weight.dtype}")
    if weight.dtype == torch.bfloat16 and k % 2:
        raise ValueError(f"a bf16 weight needs an even in-feature count, got {k}")
    scale = None
    if int8:
        weight, scale = quantize_int8(weight)
    num_panels = -(-n // PANEL)
    padded = F.pad(weight.detach(), (0, 0, 0, num_panels * PANEL - n))  # zero columns
    panels = padded.view(num_panels, PANEL, k)
    if weight.dtype == torch.float32:
        data = panels.permute(0, 2, 1)
    else:
        data = panels.view(num_panels, PANEL, k // 2, 2).permute(0, 2, 1, 3)
    return PackedWeight(data.contiguous(), n, k, scale)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, k] as int8 [n, k] times a float32 scale [n] per output (symmetric, max |w| -> 127)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale.contiguous()


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
    if not m:
        return out
    b = bias.data_ptr() if bias is not None else None
    if weight.scale is not None:
        _library().faser_linear_i8(x.data_ptr(), weight.data.data_ptr(), weight.scale.data_ptr(),
                                   b, out.data_ptr(), m, weight.n, weight.k)
        return out
    run = _library().faser_linear_bf16 if x.dtype == torch.bfloat16 else \
        _library().faser_linear_f32
    run(x.data_ptr(), weight.data.data_ptr(), b, out.data_ptr(), m, weight.n, weight.k)
    return out


def linear_torch(
    x: torch.Tensor,  # [m, k]
    weight: torch.Tensor,  # [n, k], unpacked
    bias: torch.Tensor | None = None,  # [n] float32
    scale: torch.Tensor | None = None,  # [n] float32, for an int8 weight
) -> torch.Tensor:  # [m, n], x's dtype
    """The twin: the same product accumulated in fp32 (in another order, so equal to rounding).
    An int8 weight's twin is `linear_torch(x, q, bias, scale)` with `quantize_int8`'s q, scale."""
    out = x.float() @ weight.float().T
    if scale is not None:
        out = out * scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@functools.cache
def _library() -> ctypes.CDLL:
    lib = cpu_build.library("cpu_linear.c")
    ptr, long = ctypes.c_void_p, ctypes.c_long
    signatures = {  # an AVX2 build has the float32 kernel only (cpu_build)
        "faser_linear_bf16": [ptr] * 4 + [long] * 3,
        "faser_linear_f32": [ptr] * 4 + [long] * 3,
        "faser_linear_i8": [ptr] * 5 + [long] * 3,
    }
    for name, argtypes in signatures.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = None
    lib.faser_linear_uses_amx.argtypes = []
    lib.faser_linear_uses_amx.restype = ctypes.c_int
    return lib
