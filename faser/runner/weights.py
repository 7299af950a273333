"""How a model's linear weights are laid out in memory for the device.

On a CPU a batch-1 step streams every weight once, so the layout decides its speed. Plain row-major
fp32 GEMMs ("dense") run at memory bandwidth for up to 3 rows, but from 4 rows on MKL takes a
slower path: a 4-row forward of the target cost 1.5x a 3-row one. MKL's packed-weight GEMM does
not jump there, so "mkl" keeps the weights also packed at a few row counts and pads a flat batch up
to the next (at the price of a copy of the weights per row count); "mkldnn" prepacks for oneDNN.
"tuned" (faser.runner.tuned_linear) measures, per weight shape and row count, which of plain,
transposed, MKL-packed and oneDNN is fastest on this machine, and keeps only the layouts it
chose. The values are unchanged; only the layout (and so the order of floating-point
accumulation) differs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from faser.runner.tuned_linear import TunedLinear, cached_tune_group, extra_bytes

WEIGHT_FORMATS = ("auto", "dense", "mkldnn", "mkl", "tuned")
# row counts "mkl" packs for: fewer rows than the first stay dense (already bandwidth-bound), a
# flat batch is padded up to the next, and one past the last runs dense. Each is a full copy of
# the layer's weight, so the model's linear weights take 1 + len(MKL_ROW_BUCKETS) times the memory.
MKL_ROW_BUCKETS = (4, 8, 16, 32)
MEMORY_SHARE = 0.25  # "tuned" keeps its copies of the weights within this share of free memory


class PackedLinear(nn.Module):
    """A linear layer whose weight is held in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("weight", weight.to_mkldnn(), persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else torch.zeros(self.out_features)
        self.register_buffer("bias", bias.float().to_mkldnn(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        return torch._C._nn.mkldnn_linear(x.to_mkldnn(), self.weight, self.bias).to_dense()


class MKLPackedLinear(nn.Module):
    """A bias-free linear layer with its weight also packed for MKL's GEMM at each row count of
    `buckets`; the padding rows are zeros and are cut off again (rows are independent)."""

    def __init__(self, linear: nn.Linear, buckets: tuple[int, ...] = MKL_ROW_BUCKETS) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("MKLPackedLinear is for bias-free projections")
        self.out_features = linear.out_features
        self.weight = linear.weight  # shared, not copied: a tied head stays tied
        self.buckets = tuple(sorted(buckets))
        weight = linear.weight.detach().contiguous()
        for rows in self.buckets:
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
            self.register_buffer(f"packed_{rows}", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        n = x.shape[0]
        if n < self.buckets[0] or n > self.buckets[-1]:
            return nn.functional.linear(x, self.weight)
        rows = next(b for b in self.buckets if b >= n)
        if rows > n:
            x = torch.cat([x, x.new_zeros(rows - n, x.shape[1])])
        packed = getattr(self, f"packed_{rows}")
        return torch.ops.mkl._mkl_linear(x, packed, self.weight, None, rows)[:n]


def resolve_weight_format(weight_format: str, device: str, dtype: str) -> str:
    """The layout "auto" stands for: "tuned" for float32 on a CPU whose torch has MKL (it keeps
    its copies within MEMORY_SHARE of the free memory, see pack_weights), else "dense"."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if weight_format != "auto":
        return weight_format
    if device != "cpu" or dtype != "float32" or not torch.backends.mkl.is_available():
        return "dense"
    return "tuned"


def _available_memory() -> int:
    """Free memory, within the container's limit where one is set (a pod's 8 GiB, not the
    node's free memory)."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # not a POSIX system: no copies we cannot account for
        return 0
    headroom = cgroup_headroom(Path("/sys/fs/cgroup"))
    return free if headroom is None else min(free, headroom)


def cgroup_headroom(root: Path) -> int | None:
    """Limit minus usage of the cgroup at `root` (v2 `memory.max`, or v1 `memory/`), None
    where no finite limit is set or readable."""
    for limit_file, usage_file in (
        (root / "memory.max", root / "memory.current"),
        (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes"),
    ):
        try:
            limit = limit_file.read_text().strip()
            usage = int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # v1 reports "no limit" as about 2^63
            return max(0, int(limit) - usage)
    return None


def pack_weights(
    model: nn.Module, weight_format: str, device: str, tuning_cache: Path | None = None
) -> nn.Module:
    """Repacks the decoder layers' projections in place; "mkldnn" leaves the embedding and lm_head
    dense (the head is tied to the embedding in most small models, and a packed copy would double
    it), "mkl" and "tuned" take the head too (a verification asks it for many rows). "tuned"
    reads and extends its measured choices in `tuning_cache` (a JSON file) when one is given."""
    if weight_format == "auto":
        raise ValueError("resolve 'auto' first (resolve_weight_format): it depends on the pair")
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if weight_format == "dense":
        return model
    if weight_format == "mkl":
        return _pack_mkl(model, device)
    if weight_format == "tuned":
        budget = int(MEMORY_SHARE * _available_memory())
        return _pack_tuned(model, device, budget, tuning_cache)
    if device != "cpu" or not torch.backends.mkldnn.is_available():
        raise ValueError("weight_format 'mkldnn' needs a CPU with oneDNN")
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("weight_format 'mkldnn' is for float32 weights (bf16 is oneDNN already)")
    _replace_projections(model, PackedLinear)
    return model


def _replace_projections(model: nn.Module, pack: Callable[[nn.Linear], nn.Module | None]) -> None:
    """Each decoder layer's linear projection replaced by `pack(it)` (kept where that is None)."""
    for parent, name, child in _decoder_projections(model):
        packed = pack(child)
        if packed is not None:
            setattr(parent, name, packed)


def _decoder_projections(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) of every linear projection of the decoder layers."""
    return [
        (parent, name, child)
        for layer in model.layers
        for parent in (layer.self_attn, layer.mlp)
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]


def _pack_mkl(model: nn.Module, device: str) -> nn.Module:
    """Every bias-free projection and the head (a verification asks it for many rows too)."""
    if device != "cpu" or not torch.backends.mkl.is_available():
        raise ValueError("weight_format 'mkl' needs a CPU build of torch with MKL")
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("weight_format 'mkl' is for float32 weights")
    _replace_projections(model, lambda lin: MKLPackedLinear(lin) if lin.bias is None else None)
    if isinstance(model.lm_head, nn.Linear) and model.lm_head.bias is None:
        model.lm_head = MKLPackedLinear(model.lm_head)
    return model


def _pack_tuned(
    model: nn.Module, device: str, budget_bytes: int, cache_file: Path | None
) -> nn.Module:
    """Each shape of bias-free projection (and the head) measured (or its choice read from
    `cache_file`) and replaced by TunedLinear; a shape whose chosen layouts would take the copies
    past `budget_bytes` stays dense."""
    if device != "cpu" or not torch.backends.mkl.is_available():
        raise ValueError("weight_format 'tuned' needs a CPU build of torch with MKL")
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("weight_format 'tuned' is for float32 weights")
    groups: dict[tuple[int, int], list[nn.Linear]] = {}
    for lin in tunable_projections(model):
        groups.setdefault(tuple(lin.weight.shape), []).append(lin)
    choices = {}
    for shape, linears in groups.items():
        choice = cached_tune_group(linears, cache_file)
        cost = sum(extra_bytes(lin, choice) for lin in linears)
        if cost <= budget_bytes and set(choice.kernels) != {"dense"}:
            choices[shape], budget_bytes = choice, budget_bytes - cost

    def tuned(lin: nn.Linear) -> nn.Module | None:
        choice = choices.get(tuple(lin.weight.shape))
        return TunedLinear(lin, choice) if lin.bias is None and choice else None

    _replace_projections(model, tuned)
    if isinstance(model.lm_head, nn.Linear) and (packed := tuned(model.lm_head)) is not None:
        model.lm_head = packed
    return model


def tunable_projections(model: nn.Module) -> list[nn.Linear]:
    """The bias-free linear layers pack_weights may replace: decoder projections and the head."""
    found = [child for _, _, child in _decoder_projections(model)]
    if isinstance(model.lm_head, nn.Linear):
        found.append(model.lm_head)
    return [lin for lin in found if lin.bias is None]
