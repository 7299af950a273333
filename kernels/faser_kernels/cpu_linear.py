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
Q4_BLOCK = 32  # k per 4-bit block, as in cpu_linear_q4.c (GGUF's Q4_1)


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A [n, k] weight in the kernel's panels (cpu_linear.c)."""

    # bf16, int8: [num_panels, k / 2, PANEL, 2]; fp32: [num_panels, k, PANEL]; 4-bit blocks
    # (uint8): [num_panels, k / Q4_BLOCK, bytes] (pack_q4)
    data: torch.Tensor
    n: int
    k: int
    scale: torch.Tensor | None = None  # [n] float32: an int8 weight's per-output scale

    @property
    def dtype(self) -> torch.dtype:
        """The inputs' (and outputs') dtype: an int8 weight takes bf16, a 4-bit one float32."""
        return {torch.int8: torch.bfloat16, torch.uint8: torch.float32}.get(self.data.dtype,
                                                                            self.data.dtype)


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


def pack_q4(weight: torch.Tensor) -> PackedWeight | None:
    """A float32 [n, k] weight whose every block of Q4_BLOCK along k is d * q + m for q in 0..15
    (one rounding), as a checkpoint dequantized from GGUF's Q4_1 is, in 4-bit blocks
    (cpu_linear_q4.c): per panel and block, the panel's d and m, then its q, a sixth of the
    float32 panels' bytes for the same bits out. None for any other weight."""
    found = q4_blocks(weight)
    if found is None:
        return None
    q, d, m = found
    (n, k), num_blocks = weight.shape, weight.shape[1] // Q4_BLOCK
    num_panels = -(-n // PANEL)
    pad = num_panels * PANEL - n  # zero columns: q, d and m 0
    q = F.pad(q, (0, 0, 0, 0, 0, pad)).view(num_panels, PANEL, num_blocks, Q4_BLOCK)
    q = q.permute(0, 2, 3, 1)  # [panel, block, k, column]
    half = PANEL // 2
    nibbles = q[..., :half] | (q[..., half:] << 4)  # column j low, column j + half high
    head = F.pad(torch.stack([d, m]), (0, 0, 0, pad)).view(2, num_panels, PANEL, num_blocks)
    head = head.permute(1, 3, 0, 2).contiguous().view(torch.uint8)  # [panel, block, 2, 4 PANEL]
    data = torch.cat([head.reshape(num_panels, num_blocks, -1),
                      nibbles.reshape(num_panels, num_blocks, -1)], dim=-1)
    return PackedWeight(data.contiguous(), n, k)


def q4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [n, k / Q4_BLOCK, Q4_BLOCK] uint8, d, m [n, k / Q4_BLOCK] float32) with
    fma(q, d, m) == weight bit for bit in every block; None when some block has none. m is a
    block's least weight (its q is 0); d, a float16 in GGUF, is the float16 nearest
    (max - min) / 15 or one of its neighbours."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % Q4_BLOCK:
        return None
    n, k = weight.shape
    w = weight.detach().reshape(-1, Q4_BLOCK)  # [blocks, Q4_BLOCK]
    m = w.amin(dim=-1)
    guess = ((w.amax(dim=-1).double() - m.double()) / 15).to(torch.float16).view(torch.int16)
    q_found = torch.zeros(w.shape, dtype=torch.uint8)
    d_found = torch.zeros_like(m)
    left = torch.arange(len(w))  # blocks without a d yet
    for ulps in (0, -1, 1, -2, 2):
        d = (guess[left] + ulps).clamp_min(0).view(torch.float16).float()[:, None]
        base = m[left, None]
        q = torch.nan_to_num((w[left] - base) / d).round().clamp(0, 15)
        # q * d is exact (4 bits times float16's 11), so this rounds once, as the FMA does
        exact = ((q * d + base).view(torch.int32) == w[left].view(torch.int32)).all(dim=-1)
        q_found[left[exact]], d_found[left[exact]] = q[exact].to(torch.uint8), d[exact, 0]
        left = left[~exact]
        if not len(left):
            shape = (n, k // Q4_BLOCK)
            return q_found.view(*shape, Q4_BLOCK), d_found.view(shape), m.view(shape)
    return None


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
    if weight.data.dtype == torch.uint8:
        run = _library().faser_linear_q4
    elif x.dtype == torch.bfloat16:
        run = _library().faser_linear_bf16
    else:
        run = _library().faser_linear_f32
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
        "faser_linear_q4": [ptr] * 4 + [long] * 3,
    }
    for name, argtypes in signatures.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = None
    lib.faser_linear_uses_amx.argtypes = []
    lib.faser_linear_uses_amx.restype = ctypes.c_int
    return lib
