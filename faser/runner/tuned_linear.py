"""The "tuned" weight layout: for each weight shape and row count, the GEMM kernel that measured
fastest on this machine.

Which fp32 kernel is fastest depends on the CPU, the weight's shape and the number of rows, and no
one layout wins everywhere. On an AMD EPYC (Zen 3, no AVX-512; 2 threads; `python -m
benchmarks.gemm_kernels`, docs/bench/gemm_kernels_epyc.txt) the target's gate/up projection at
one row took 0.97 ms a layer as a plain row-major `F.linear`, 0.56 ms as a product with the
transposed weight and 0.58 ms packed for MKL; its down projection 0.34, 0.39 and 0.51 ms; the
49,152-row head 14.5, 7.4 and 8.5 ms; at four rows the gate/up projection 1.63 plain, 2.13
transposed, 1.76 packed and 1.26 with oneDNN. So a linear layer keeps the weight in the layouts
its measured choices use, and each forward runs the kernel chosen for its row count. The values
are unchanged; only the order of floating-point accumulation differs, as between any two GEMM
kernels.

Kernels: "dense" `F.linear(x, W)`; "transposed" `x @ W.T` with W.T stored contiguous;
"packed" MKL's packed-weight GEMM at exactly the bucket's row count (a batch is padded up to it);
"onednn" oneDNN's linear on the weight in its blocked layout."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

KERNELS = ("dense", "transposed", "packed", "onednn")
# row counts measured; a batch of n rows runs the choice of the first bucket >= n, and one of
# more rows than the last (a prefill chunk, a large batch) runs dense, as in the "mkl" layout:
# kernels past 32 rows were not compared
ROW_BUCKETS = (1, 2, 3, 4, 8, 16, 32)
TIMING_BYTES = 64 << 20  # weights streamed per timed call: more than a CPU's last-level cache
TIMING_REPEATS = 5


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The kernel for each row bucket of one weight shape."""

    buckets: tuple[int, ...]
    kernels: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.buckets) != len(self.kernels) or not self.buckets:
            raise ValueError("a kernel choice names one kernel per row bucket")
        if unknown := set(self.kernels) - set(KERNELS):
            raise ValueError(f"unknown kernels {sorted(unknown)}; known: {KERNELS}")

    def kernel_for(self, rows: int) -> tuple[str, int]:
        """(kernel, bucket) for a batch of `rows` rows."""
        for bucket, kernel in zip(self.buckets, self.kernels, strict=True):
            if rows <= bucket:
                return kernel, bucket
        return "dense", rows


class TunedLinear(nn.Module):
    """A bias-free linear layer that runs, at each row count, the kernel its choice names."""

    def __init__(self, linear: nn.Linear, choice: KernelChoice) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("TunedLinear is for bias-free projections")
        self.out_features = linear.out_features
        self.weight = linear.weight  # shared, not copied: a tied head stays tied
        self.choice = choice
        weight = linear.weight.detach().contiguous()
        if "transposed" in choice.kernels:
            self.register_buffer("transposed", weight.t().contiguous(), persistent=False)
        if "onednn" in choice.kernels:
            self.register_buffer("onednn", weight.to_mkldnn(), persistent=False)
        for bucket, kernel in zip(choice.buckets, choice.kernels, strict=True):
            if kernel == "packed":
                packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, bucket)
                self.register_buffer(f"packed_{bucket}", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        n = x.shape[0]
        kernel, bucket = self.choice.kernel_for(n)
        if kernel == "dense":
            return nn.functional.linear(x, self.weight)
        if kernel == "transposed":
            return torch.mm(x, self.transposed)
        if kernel == "onednn":
            return torch.ops.aten.mkldnn_linear(x.to_mkldnn(), self.onednn, None).to_dense()
        if bucket > n:  # rows are independent: zero padding rows are cut off again
            x = torch.cat([x, x.new_zeros(bucket - n, x.shape[1])])
        packed = getattr(self, f"packed_{bucket}")
        return torch.ops.mkl._mkl_linear(x, packed, self.weight, None, bucket)[:n]


def extra_bytes(linear: nn.Linear, choice: KernelChoice) -> int:
    """Memory the choice adds to the layer's own weight: one copy per layout beside dense."""
    copies = (
        ("transposed" in choice.kernels) + ("onednn" in choice.kernels)
        + choice.kernels.count("packed")
    )
    return copies * linear.weight.numel() * linear.weight.element_size()


# (kernel, rows, run) -> seconds one call of `run` took
Timer = Callable[[str, int, Callable[[], object]], float]


def tune_group(
    linears: list[nn.Linear],
    buckets: Iterable[int] = ROW_BUCKETS,
    repeats: int = TIMING_REPEATS,
    timer: Timer | None = None,
) -> KernelChoice:
    """The fastest kernel at each bucket for layers of one shape (kernel_times)."""
    buckets = tuple(buckets)
    times = kernel_times(linears, buckets, repeats, timer)
    kernels = tuple(min(times[bucket], key=times[bucket].get) for bucket in buckets)
    return KernelChoice(buckets, kernels)


def kernel_times(
    linears: list[nn.Linear],
    buckets: Iterable[int] = ROW_BUCKETS,
    repeats: int = TIMING_REPEATS,
    timer: Timer | None = None,
) -> dict[int, dict[str, float]]:
    """bucket -> kernel -> seconds of one call over the layers, for layers of one shape, timed
    over as many of them in turn as stream TIMING_BYTES: one weight timed alone would sit in the
    cache, where a model larger than the cache never finds its weights (a one-layer draft's group
    is one weight, and is timed as hot as it runs). Kernels interleaved so that a shared
    machine's changing load hits each alike; medians of `repeats`."""
    timer = timer or _seconds
    weights = [lin.weight.detach().contiguous() for lin in streamed_layers(linears)]
    onednn = [w.to_mkldnn() for w in weights] if torch.backends.mkldnn.is_available() else None
    layouts = ([w.t().contiguous() for w in weights], onednn)
    medians = {}
    for bucket in buckets:
        runs = _kernel_runs(weights, *layouts, bucket)
        for run in runs.values():  # warm-up: first calls allocate and dispatch
            run()
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(repeats):
            for kernel, run in runs.items():
                times[kernel].append(timer(kernel, bucket, run))
        medians[bucket] = {k: statistics.median(t) for k, t in times.items()}
    return medians


def streamed_layers(linears: list[nn.Linear]) -> list[nn.Linear]:
    """The layers a timed call multiplies in turn: as many as stream TIMING_BYTES."""
    per_layer = linears[0].weight.numel() * linears[0].weight.element_size()
    return linears[: max(1, TIMING_BYTES // per_layer)]


def _kernel_runs(
    weights: list[torch.Tensor], transposed: list[torch.Tensor],
    onednn: list[torch.Tensor] | None, rows: int,
) -> dict[str, Callable[[], object]]:
    """One call per kernel that multiplies `rows` rows by every weight in turn ("onednn" only
    where torch has oneDNN; "packed" needs MKL, which the "tuned" layout requires)."""
    x = torch.randn(rows, weights[0].shape[1], dtype=weights[0].dtype)
    packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]

    def dense() -> None:
        for w in weights:
            nn.functional.linear(x, w)

    def by_transposed() -> None:
        for t in transposed:
            torch.mm(x, t)

    def by_packed() -> None:
        for p, w in zip(packed, weights, strict=True):
            torch.ops.mkl._mkl_linear(x, p, w, None, rows)

    def by_onednn() -> None:
        for w in onednn:  # each call converts its input and output, as TunedLinear's does
            torch.ops.aten.mkldnn_linear(x.to_mkldnn(), w, None).to_dense()

    runs = {"dense": dense, "transposed": by_transposed, "packed": by_packed, "onednn": by_onednn}
    if onednn is None:
        del runs["onednn"]
    return runs


def cached_tune_group(
    linears: list[nn.Linear], cache_file: Path | None, timer: Timer | None = None
) -> KernelChoice:
    """tune_group's choice, read from `cache_file` when this machine, torch, thread count and
    shape were measured before (each replica of a fleet would otherwise spend its start-up, 15 s
    for the default pair on a 2-core EPYC, measuring the same thing)."""
    if cache_file is None:
        return tune_group(linears, timer=timer)
    key = _cache_key(linears)
    cached = _read_cache(cache_file).get(key)
    if cached is not None:
        try:
            return KernelChoice(ROW_BUCKETS, tuple(cached))
        except (TypeError, ValueError):
            pass  # written by another version: measured again
    choice = tune_group(linears, timer=timer)
    entries = _read_cache(cache_file)  # again: another process may have added entries meanwhile
    entries[key] = list(choice.kernels)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    tmp.replace(cache_file)  # atomic: a concurrent reader never sees half a file
    return choice


def _cache_key(linears: list[nn.Linear]) -> str:
    weight = linears[0].weight
    return (
        f"{_cpu_name()}|torch={torch.__version__}|threads={torch.get_num_threads()}|"
        f"{weight.dtype}|{tuple(weight.shape)}|streamed={len(streamed_layers(linears))}|"
        f"buckets={ROW_BUCKETS}|kernels={KERNELS}"
    )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} x{os.cpu_count()}"


def _read_cache(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _seconds(kernel: str, rows: int, run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start
