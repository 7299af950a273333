"""Row-invariant linear layers on x86 CPUs with AVX-512 (cpu_linear.c; float32 also with AVX2,
cpu_linear_avx2.c), and their PyTorch twin.

Row m of an M-row call has the bits of a one-row call, for any M: each output is one fp32
accumulator over k in a fixed order. The weight is packed once into the kernel's panels, which
it streams once per call whatever M is, so verifying k + 1 positions costs about one decode.
Where the CPU has AMX, bf16 weights are multiplied on its tiles (cpu_linear.c says why).
A float32 weight that GGUF's Q4_1 or Q8_0 blocks hold exactly (a checkpoint dequantized from a
GGUF file) stays in those blocks (`pack_blocks`), for float32 inputs or, rounded to bf16 as the
kernel dequantizes it, for bf16 ones: a third to a half of the bytes, the same bits.
A draft's weights may be packed in int8 with a scale per output (`pack_weight(w, int8=True)`):
half the bytes of bf16 to stream, for bf16 inputs; or, for float32 inputs, rounded into GGUF's
Q8_0 blocks (`quantize_q8_0`): 1.125 bytes a weight against 4. Never the target's, whose output
must be exact.

The C source is built and loaded by cpu_build; where it cannot run, `unavailable_reason`
says why and callers keep torch's own linear.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from faser_kernels import cpu_build

PANEL = 32  # output columns per packed panel, as in cpu_linear.c
BLOCK = 32  # k per block of GGUF's Q4_1 and Q8_0, as in cpu_linear_blocks.c
BLOCK_FORMATS = {"q4_1": 1, "q8_0": 2}  # cpu_linear_blocks.c's codes
SAMPLE_BLOCKS = 256


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A [n, k] weight in the kernel's panels (cpu_linear.c)."""

    # bf16, int8: [num_panels, k / 2, PANEL, 2]; fp32: [num_panels, k, PANEL]; GGUF's blocks
    # (uint8): [num_panels, k / BLOCK, bytes] (pack_blocks)
    data: torch.Tensor
    n: int
    k: int
    scale: torch.Tensor | None = None  # [n] float32: an int8 weight's per-output scale
    blocks: str | None = None  # a float32 weight's GGUF format (BLOCK_FORMATS), else None
    # what the blocks are multiplied as: the float32 weight, or it rounded to bf16 (a bf16 model
    # loaded from the float32 checkpoint holds that)
    block_dtype: torch.dtype = torch.float32

    @property
    def dtype(self) -> torch.dtype:
        """The inputs' (and outputs') dtype: an int8 weight takes bf16, GGUF's blocks their
        block_dtype."""
        if self.blocks is not None:
            return self.block_dtype
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


def pack_blocks(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> PackedWeight | None:
    """A float32 [n, k] weight that GGUF's Q4_1 or Q8_0 holds exactly, as a checkpoint dequantized
    from such a file does, in those blocks (cpu_linear_blocks.c): per panel and block of BLOCK k,
    the panel's scales in float32, then its q: 0.75 (Q4_1) or 1.125 (Q8_0) bytes a weight against
    float32's 4, for the same bits out. `dtype` bfloat16: multiplied as `weight.bfloat16()` (the
    weight a bf16 model loaded from that checkpoint holds), against bf16's 2 bytes a weight, for
    the bits of its bf16 panels. None for any other weight."""
    for name, find in _sample_formats(weight):
        if (found := find(weight.detach().reshape(-1, BLOCK))) is not None:
            n, k = weight.shape
            return PackedWeight(_panels(n, k, *found), n, k, blocks=name, block_dtype=dtype)
    return None


def may_hold_blocks(weight: torch.Tensor) -> bool:
    """Whether `pack_blocks` may find a float32 weight's blocks: its first few blocks are
    GGUF's (the rest is only known by packing it)."""
    return bool(_sample_formats(weight))


def _sample_formats(weight: torch.Tensor) -> list[tuple[str, Callable]]:
    """GGUF's formats (and their finders) that hold a float32 weight's first SAMPLE_BLOCKS
    blocks: a weight of no such file fails there, at a small part of a whole search's cost."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        return []
    sample = weight.detach().reshape(-1, BLOCK)[:SAMPLE_BLOCKS]
    return [(name, find) for name, find in (("q4_1", _q4_1), ("q8_0", _q8_0))
            if find(sample) is not None]


def quantize_q8_0(weight: torch.Tensor) -> PackedWeight:
    """Any float32 [n, k] weight rounded into Q8_0 blocks, d the float16 of a block's max |w| / 127
    (as GGUF quantizes): a draft's, where only the bytes a step reads matter, not the bits."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"Q8_0 takes a float32 weight of k a multiple of {BLOCK}, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    blocks = weight.detach().reshape(-1, BLOCK)
    d = (blocks.abs().amax(dim=-1) / 127).to(torch.float16).float()
    q = torch.nan_to_num(blocks / d[:, None]).round().clamp(-127, 127).to(torch.int8)
    return PackedWeight(_panels(n, k, q, [d], _q8_0_bytes), n, k, blocks="q8_0")


def unpack_blocks(weight: PackedWeight) -> torch.Tensor:
    """The float32 [n, k] weight that GGUF's blocks hold: the kernel's twin reads it."""
    num_panels, num_blocks, _ = weight.data.shape
    num_scales = 2 if weight.blocks == "q4_1" else 1
    head = weight.data[..., : num_scales * 4 * PANEL].contiguous().view(torch.float32)
    scales = head.view(num_panels, num_blocks, num_scales, 1, PANEL).unbind(dim=2)
    body = weight.data[..., num_scales * 4 * PANEL :].reshape(num_panels, num_blocks, BLOCK, -1)
    if weight.blocks == "q4_1":
        q = torch.cat([body & 0x0F, body >> 4], dim=-1).float()
        w = q * scales[0] + scales[1]
    else:
        w = body.contiguous().view(torch.int8).float() * scales[0]
    # [panel, block, k, column] -> [n, k]
    w = w.permute(0, 3, 1, 2).reshape(num_panels * PANEL, num_blocks * BLOCK)
    return w[: weight.n].contiguous()


def _q4_1(w: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], Callable] | None:
    """Q4_1: q 0..15 with fma(q, d, m) the weight's bits; m is a block's least weight (q 0), d a
    float16. q as bytes, column j's in the low nibble and column j + PANEL / 2's in the high."""
    m = w.amin(dim=-1)
    found = _scaled(w, (w.amax(dim=-1).double() - m.double()) / 15, m, 0, 15)
    if found is None:
        return None
    q, d = found
    half = PANEL // 2
    return q, [d, m], lambda q: q[..., :half] | (q[..., half:] << 4)


def _q8_0(w: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], Callable] | None:
    """Q8_0: q -128..127 with d * q (exact) the weight's bits; d a float16."""
    found = _scaled(w, w.abs().amax(dim=-1).double() / 127, torch.zeros(len(w)), -128, 127)
    if found is None:
        return None
    q, d = found
    return q, [d], _q8_0_bytes


def _q8_0_bytes(q: torch.Tensor) -> torch.Tensor:
    """Q8_0's q (int8) as the bytes the blocks hold."""
    return q.view(torch.uint8)


def _scaled(w: torch.Tensor, step: torch.Tensor, m: torch.Tensor, lo: int,
            hi: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [blocks, BLOCK] in [lo, hi], d [blocks]) with q * d + m == w bit for bit in every block,
    d the float16 nearest `step` or one of its neighbours (GGUF stores d in float16); None when a
    block has none. q * d is exact (at most 8 bits times float16's 11), so q * d + m rounds once,
    as the kernel's FMA does."""
    guess = step.to(torch.float16).view(torch.int16)
    q_found = torch.zeros(w.shape, dtype=torch.int8 if lo < 0 else torch.uint8)
    d_found = torch.zeros(len(w))
    left = torch.arange(len(w))  # blocks without a d yet
    for ulps in (0, -1, 1, -2, 2):
        d = (guess[left] + ulps).clamp_min(0).view(torch.float16).float()[:, None]
        base, target = m[left, None], w[left]
        q = torch.nan_to_num((target - base) / d).round().clamp(lo, hi)
        exact = ((q * d + base).view(torch.int32) == target.view(torch.int32)).all(dim=-1)
        q_found[left[exact]], d_found[left[exact]] = q[exact].to(q_found.dtype), d[exact, 0]
        left = left[~exact]
        if not len(left):
            return q_found, d_found
        if 2 * len(left) > len(w):  # GGUF's d is the nearest float16 for nearly every block
            return None
    return None


def _panels(n: int, k: int, q: torch.Tensor, scales: list[torch.Tensor],
            to_bytes: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """[num_panels, k / BLOCK, bytes]: per panel and block, each of `scales` for the panel's
    columns (float32), then the block's k rows of the columns' q as `to_bytes` lays them out."""
    num_blocks, num_panels = k // BLOCK, -(-n // PANEL)
    pad = num_panels * PANEL - n  # zero columns: q and every scale 0
    q = F.pad(q.view(n, num_blocks, BLOCK), (0, 0, 0, 0, 0, pad))
    q = q.view(num_panels, PANEL, num_blocks, BLOCK).permute(0, 2, 3, 1)  # [panel, block, k, col]
    head = F.pad(torch.stack(scales).view(len(scales), n, num_blocks), (0, 0, 0, pad))
    head = head.view(len(scales), num_panels, PANEL, num_blocks).permute(1, 3, 0, 2)
    head = head.contiguous().view(torch.uint8)  # [panel, block, scale, 4 PANEL]
    body = to_bytes(q.contiguous())
    return torch.cat([head.reshape(num_panels, num_blocks, -1),
                      body.reshape(num_panels, num_blocks, -1)], dim=-1).contiguous()


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
    if weight.blocks is not None:
        run = _library().faser_linear_blocks_bf16 if x.dtype == torch.bfloat16 else \
            _library().faser_linear_blocks
        run(x.data_ptr(), weight.data.data_ptr(), b, out.data_ptr(), m, weight.n, weight.k,
            BLOCK_FORMATS[weight.blocks])
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
        "faser_linear_blocks": [ptr] * 4 + [long] * 3 + [ctypes.c_int],
        "faser_linear_blocks_bf16": [ptr] * 4 + [long] * 3 + [ctypes.c_int],
    }
    for name, argtypes in signatures.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = None
    lib.faser_linear_uses_amx.argtypes = []
    lib.faser_linear_uses_amx.restype = ctypes.c_int
    return lib
