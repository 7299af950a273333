"""The row-local ops of a decoder layer fused on x86 CPUs with AVX-512 (cpu_ops.c; float32 also
with AVX2, cpu_ops_avx2.c, which has no rescoring: a float32 head needs none), each beside
its PyTorch twin with the same signature: residual add + RMSNorm, rotary embedding in place,
SiLU(gate) * up; and the head's: its leading candidates rescored in float32, each row's argmax.
A row gets the same bits whatever else shares the call; one call replaces the handful of torch
ops, and their dispatch, that each takes."""

from __future__ import annotations

import ctypes
import functools
import os

import torch
import torch.nn.functional as F

from faser_kernels import cpu_build

MAX_RESCORED = 64  # as cpu_ops.c


def runs_on(x: torch.Tensor) -> bool:
    """The fused kernels take x: a CPU tensor of a dtype they have, on a CPU they run on, unless
    FASER_KERNELS forces another path (`torch`: the twins; `triton`: the Triton tests)."""
    forced = os.environ.get("FASER_KERNELS", "auto") != "auto"
    return not forced and x.device.type == "cpu" and _runs(x.dtype)


@functools.cache
def _runs(dtype: torch.dtype) -> bool:
    return cpu_build.unavailable_reason("cpu_ops.c", dtype) is None


def add_rms_norm(
    x: torch.Tensor,  # [m, d], the model's dtype
    residual: torch.Tensor | None,  # [m, d] float32: the residual stream; None at the first layer
    weight: torch.Tensor,  # [d], x's dtype
    eps: float,
    out_dtype: torch.dtype | None = None,  # None: x's
) -> tuple[torch.Tensor, torch.Tensor]:  # RMSNorm(h) * weight, h = x + residual
    """The residual stream h is kept in float32 whatever the model's dtype: rounded to bf16 at
    every layer, its error builds up over depth."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype)
    summed = torch.empty(x.shape, dtype=torch.float32)
    _library().faser_add_rms_norm(
        x.data_ptr(), None if residual is None else residual.contiguous().data_ptr(),
        weight.data_ptr(), out.data_ptr(), summed.data_ptr(), x.shape[0], x.shape[1], eps,
        _is_bf16(x), _is_bf16(out),
    )
    return out, summed


def add_rms_norm_torch(x, residual, weight, eps, out_dtype=None):
    summed = x.float() if residual is None else x.float() + residual
    out_dtype = out_dtype or x.dtype
    normed = (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps)).to(out_dtype)
    return (weight.to(out_dtype) * normed).to(out_dtype), summed


def rotary_(
    x: torch.Tensor,  # [n, heads, head_dim], heads and head_dim contiguous; rotated in place
    positions: torch.Tensor,  # [n] int64
    cos: torch.Tensor,  # [max_position, head_dim / 2] float32
    sin: torch.Tensor,
) -> torch.Tensor:
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError("rotary_ needs each row's heads contiguous")
    n, heads, head_dim = x.shape
    _library().faser_rotary(
        x.data_ptr(), positions.contiguous().data_ptr(), cos.data_ptr(), sin.data_ptr(), n,
        heads, head_dim, x.stride(0), _is_bf16(x),
    )
    return x


def rotary_torch_(x, positions, cos, sin):
    return rotate_half_(x, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))


def rotate_half_(
    x: torch.Tensor,  # [n, heads, head_dim], rotated in place
    cos: torch.Tensor,  # [n, 1, head_dim / 2] float32: each token's row of the table
    sin: torch.Tensor,
) -> torch.Tensor:
    """The "rotate half" layout of Hugging Face Llama checkpoints, in fp32, rounded once."""
    x1, x2 = x.float().chunk(2, dim=-1)
    x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [m, 2 * inter] -> [m, inter]
    gate_up = gate_up.contiguous()
    m, width = gate_up.shape
    out = gate_up.new_empty(m, width // 2)
    _library().faser_silu_mul(gate_up.data_ptr(), out.data_ptr(), m, width // 2,
                              _is_bf16(gate_up))
    return out


def silu_mul_torch(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rescore_head(
    logits: torch.Tensor,  # [m, vocab] bfloat16: the head's output
    hidden: torch.Tensor,  # [m, d] float32: its input
    weight: torch.Tensor,  # [vocab, d] float32: the head's weight
    num_top: int,
) -> torch.Tensor:  # [m, vocab] float32
    """`logits` widened, with each row's `num_top` largest (on equal values the lower index)
    recomputed in float32 from the row's hidden state."""
    (m, vocab), d = logits.shape, hidden.shape[-1]
    if logits.dtype != torch.bfloat16 or weight.dtype != torch.float32:
        raise ValueError(f"rescore_head takes bf16 logits and a float32 weight, got "
                         f"{logits.dtype} and {weight.dtype}")
    if hidden.shape != (m, d) or weight.shape != (vocab, d) or not 0 < num_top <= MAX_RESCORED:
        raise ValueError(f"rescore_head: logits {tuple(logits.shape)}, hidden "
                         f"{tuple(hidden.shape)}, weight {tuple(weight.shape)}, num_top {num_top} "
                         f"(1..{MAX_RESCORED})")
    logits, hidden, weight = logits.contiguous(), hidden.float().contiguous(), weight.contiguous()
    out = torch.empty(logits.shape, dtype=torch.float32)
    _library().faser_rescore_head(logits.data_ptr(), hidden.data_ptr(), weight.data_ptr(),
                                  out.data_ptr(), m, vocab, d, num_top)
    return out


def rescore_head_torch(logits, hidden, weight, num_top):
    out = logits.float()
    kth = out.topk(num_top, dim=-1).values[:, -1:]  # each row's num_top-th largest
    above, tied = out > kth, out == kth
    # the tied values fill what is left, lowest index first (torch.topk picks among them freely)
    left = num_top - above.sum(-1, keepdim=True)
    top = (above | (tied & (tied.cumsum(-1) <= left))).nonzero()[:, 1].view(-1, num_top)
    exact = (weight[top] * hidden.float()[:, None, :]).sum(-1)  # [m, num_top]
    return out.scatter_(1, top, exact)


def first_argmax(rows: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab] -> [num_rows]
    """Each row's first maximum, as torch.argmax gives it; by argmax_rows where it runs (float32
    rows on a CPU with the kernels), which reads a row several times faster."""
    if runs_on(rows) and rows.dtype == torch.float32:
        return argmax_rows(rows)
    return rows.argmax(dim=-1)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [m, n] float32 -> [m] int64
    """Each row's first maximum (rows without NaN)."""
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"argmax_rows takes [m, n] float32, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    index = torch.empty(x.shape[0], dtype=torch.int64)
    _library().faser_argmax_rows(x.data_ptr(), index.data_ptr(), *x.shape)
    return index


def argmax_rows_torch(x):
    return x.argmax(dim=-1)


def _is_bf16(x: torch.Tensor) -> int:
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"cpu_ops takes bfloat16 or float32, got {x.dtype}")
    return int(x.dtype == torch.bfloat16)


@functools.cache
def _library() -> ctypes.CDLL:
    lib = cpu_build.library("cpu_ops.c")
    ptr, long, i32, f32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    signatures = {
        "faser_add_rms_norm": [ptr] * 5 + [long, long, f32, i32, i32],
        "faser_rotary": [ptr] * 4 + [long] * 4 + [i32],
        "faser_silu_mul": [ptr, ptr, long, long, i32],
        "faser_rescore_head": [ptr] * 4 + [long] * 4,  # not in an AVX2 build: bf16 only
        "faser_argmax_rows": [ptr, ptr, long, long],
    }
    for name, argtypes in signatures.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = None
    return lib
