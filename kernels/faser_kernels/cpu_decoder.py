"""A model's Llama decoder layers and final norm in one C call on AVX-512 CPUs (`cpu_decoder.c`;
float32 also on AVX2 ones, the same source over the AVX2 builds):
the same kernels as the layer-by-layer path, in the same order, so the same bits; its twin is that
path itself (faser.models.llama, run layer by layer), which the tests compare it with. The call
also takes the feature rows a feature draft reads (the residual stream after given layers,
RMS-scaled), since each torch operation between C calls runs with the weights' stream having
flushed the caches."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from faser_kernels import cpu_build
from faser_kernels.cpu_linear import BLOCK_FORMATS, PackedWeight

_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_L = ctypes.c_long


PROJECTIONS = ("qkv", "o", "gate_up", "down")


class _Layers(ctypes.Structure):
    _fields_ = [
        *((name, _PP) for name in ("input_norm", "qkv", "qkv_bias", "o", "post_norm",
                                   "gate_up", "down", "qkv_scale", "o_scale", "gate_up_scale",
                                   "down_scale", "k_cache", "v_cache")),
        *((name, _P) for name in ("positions", "slot_mapping", "block_tables", "seq_lens",
                                  "cu_seqlens_q", "cos_table", "sin_table")),
        *((name, _L) for name in ("num_tokens", "num_seqs", "max_blocks", "block_size", "hidden",
                                  "num_heads", "num_kv_heads", "head_dim", "intermediate")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("bf16", ctypes.c_int),
        ("blocks", _P),
        *((name, _P) for name in ("x", "normed", "qkv_out", "q", "attn", "gate_up_out", "act",
                                  "residual")),
        ("has_residual", ctypes.c_int),
        ("taps", _P), ("num_taps", _L), ("tap_out", _PP), ("unit", _P), ("tap_eps", ctypes.c_float),
        ("final_norm", _P), ("final_out", _P), ("summed", _P),
        *((name, _P) for name in ("ids", "embed", "features", "fuse", "fc", "fuse_scale",
                                  "fc_scale")),
        ("fuse_blocks", ctypes.c_int), ("fc_blocks", ctypes.c_int),
        ("feature_dim", _L), ("joined", _P),
    ]


@dataclass(frozen=True, slots=True)
class Prologue:
    """A feature draft's input, built inside the call: x = [embed[ids], fuse(features)] fc (no
    fuse for features of hidden width). Its twin: faser.models.feature_draft's torch path."""

    ids: torch.Tensor  # [n] int64
    embed: torch.Tensor  # [vocab, hidden], the model's dtype
    features: torch.Tensor  # [n, feature_dim], the model's dtype
    fuse: PackedWeight | None  # [hidden, feature_dim]
    fc: PackedWeight  # [hidden, 2 hidden]

    def pointers(self, joined: torch.Tensor) -> dict[str, object]:
        fuse, fc = self.fuse, self.fc
        return dict(
            ids=self.ids.data_ptr(), embed=self.embed.data_ptr(),
            features=self.features.data_ptr(), fuse=fuse.data.data_ptr() if fuse else None,
            fc=fc.data.data_ptr(), feature_dim=self.features.shape[1],
            fuse_scale=_scale(fuse), fc_scale=_scale(fc), joined=joined.data_ptr(),
            fuse_blocks=_blocks(fuse), fc_blocks=_blocks(fc),
        )


@dataclass(frozen=True, slots=True)
class LayerShapes:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


class DecoderLayers:
    """A model's layers and final norm as the C call sees them: per-layer pointers to the packed
    weights and the norms, gathered once (the tensors must outlive this object), and to the KV
    caches of the runner that calls (one model may serve several runners, each with its own)."""

    def __init__(
        self,
        shapes: LayerShapes,
        # input_norm, qkv, qkv_bias, o, ...; and qkv_scale, o_scale, ... (None: not int8)
        weights: dict[str, list[torch.Tensor | None]],
        final_norm: torch.Tensor,  # [hidden], the model's dtype
        dtype: torch.dtype,
        # qkv, o, gate_up, down: per layer, GGUF's format of a weight in blocks (PackedWeight)
        blocks: dict[str, list[str | None]] | None = None,
    ) -> None:
        self.shapes, self.dtype = shapes, dtype
        self.num_layers = len(weights["input_norm"])
        blocks = blocks or {name: [None] * self.num_layers for name in PROJECTIONS}
        # [layer, projection]: 0 the dtype's panels, else cpu_linear_blocks.c's format
        self.blocks = torch.tensor(
            [[BLOCK_FORMATS[b] if b else 0 for b in layer]
             for layer in zip(*(blocks[name] for name in PROJECTIONS), strict=True)],
            dtype=torch.int32)
        self._final_norm = final_norm
        self._unit = torch.ones(shapes.hidden, dtype=dtype)  # the taps' norm weight
        pointers = {name: _pointers(ts) for name, ts in weights.items()}
        self._arrays = {name: pointer for name, (pointer, _) in pointers.items()}
        self._keep = (pointers, weights)  # the struct points into them
        self._caches: tuple[object, dict] | None = None  # the last caches' pointers

    def _cache_pointers(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
        if self._caches is None or self._caches[0] is not kv_caches:
            k, v = _pointers([k for k, _ in kv_caches]), _pointers([v for _, v in kv_caches])
            self._caches = (kv_caches, {"k_cache": k[0], "v_cache": v[0], "_arrays": (k, v)})
        return self._caches[1]

    def run(
        self,
        x: torch.Tensor,  # [n, hidden], the model's dtype: the input embeddings; overwritten
        positions: torch.Tensor,  # [n] int64
        slot_mapping: torch.Tensor,  # [n] int64
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32
        cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
        cos: torch.Tensor,  # [max_position, head_dim / 2] float32
        sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer, [blocks, block, kv, d]
        taps: Sequence[int],  # ascending, in [1, num_layers)
        tap_eps: float,
        prologue: Prologue | None = None,  # then x is only written: the prologue's output
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every layer, then the final norm: its output [n, hidden] float32, and per tap t the
        residual stream after t layers, RMS-scaled with `tap_eps` ([n, hidden], the model's
        dtype): the features a feature draft reads, taken inside the one call."""
        s, n = self.shapes, x.shape[0]
        joined = torch.empty(n, 3 * s.hidden, dtype=self.dtype) if prologue else None
        inputs = prologue.pointers(joined) if prologue else {}
        caches = self._cache_pointers(kv_caches)
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        scratch = [
            torch.empty(n, width, dtype=self.dtype)
            for width in (s.hidden, q_size + 2 * kv_size, q_size, q_size, 2 * s.intermediate,
                          s.intermediate)
        ]
        residual, summed = torch.empty(2, n, s.hidden)  # the stream, and h's scratch
        out = torch.empty(n, s.hidden)
        tapped = [torch.empty(n, s.hidden, dtype=self.dtype) for _ in taps]
        tap_out, _keep = _pointers(tapped)
        tap_layers = (ctypes.c_long * len(taps))(*taps)
        args = _Layers(
            **self._arrays, k_cache=caches["k_cache"], v_cache=caches["v_cache"],
            positions=positions.data_ptr(), slot_mapping=slot_mapping.data_ptr(),
            block_tables=block_tables.data_ptr(), seq_lens=seq_lens.data_ptr(),
            cu_seqlens_q=cu_seqlens_q.data_ptr(), cos_table=cos.data_ptr(),
            sin_table=sin.data_ptr(), num_tokens=n, num_seqs=seq_lens.numel(),
            max_blocks=block_tables.shape[1], block_size=kv_caches[0][0].shape[1], hidden=s.hidden,
            num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
            intermediate=s.intermediate, eps=s.eps, scale=s.head_dim**-0.5,
            bf16=int(self.dtype == torch.bfloat16), blocks=self.blocks.data_ptr(), x=x.data_ptr(),
            normed=scratch[0].data_ptr(), qkv_out=scratch[1].data_ptr(),
            q=scratch[2].data_ptr(), attn=scratch[3].data_ptr(),
            gate_up_out=scratch[4].data_ptr(), act=scratch[5].data_ptr(),
            residual=residual.data_ptr(), has_residual=0,
            taps=ctypes.addressof(tap_layers), num_taps=len(taps), tap_out=tap_out,
            unit=self._unit.data_ptr(), tap_eps=tap_eps, final_norm=self._final_norm.data_ptr(),
            final_out=out.data_ptr(), summed=summed.data_ptr(), **inputs,
        )
        code = _library().faser_decoder_layers(ctypes.byref(args), self.num_layers)
        if code != 0:
            raise RuntimeError(f"cpu decoder layers failed ({code})")
        return out, tapped


def _blocks(weight: PackedWeight | None) -> int:
    """cpu_linear_blocks.c's code of a weight in GGUF's blocks; 0 for the dtype's panels."""
    return BLOCK_FORMATS[weight.blocks] if weight is not None and weight.blocks else 0


def _scale(weight: PackedWeight | None) -> int | None:
    return weight.scale.data_ptr() if weight is not None and weight.scale is not None else None


def _pointers(tensors: list[torch.Tensor | None]):
    array = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() if t is not None else None
                                               for t in tensors))
    return ctypes.cast(array, _PP), array  # the pointer, and the array it must not outlive


def unavailable_reason(dtype: torch.dtype) -> str | None:
    return cpu_build.unavailable_reason("cpu_decoder.c", dtype)


@functools.cache
def _library() -> ctypes.CDLL:
    lib = cpu_build.library("cpu_decoder.c")
    lib.faser_decoder_layers.argtypes = [ctypes.POINTER(_Layers), ctypes.c_long]
    lib.faser_decoder_layers.restype = ctypes.c_int
    return lib
